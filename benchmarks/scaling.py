"""Does the step get faster with ranks? torch.optim.Muon + torch.optim.AdamW in one process, then
every strategy on 1 rank (in this process) and on N ranks (DP = N, TP = 1, one process and one
thread each), on the same parameters: 4 transformer layers at d = 768 (qkv 2304x768, proj 768x768,
fc 3072x768, fc2 768x3072 to Muon) and 32 vectors of 768 to AdamW. Only step() is timed, gradients
preset; a step's time on N ranks is that of its slowest rank. Figures and ratios, never verdicts:
this machine is shared and noisy.

    python benchmarks/scaling.py                          # 1 and 2 ranks here (2 cores), about 3 minutes
    python benchmarks/scaling.py --ranks 1 2 4 8 --json scaling.json --figure scaling.png

Goals it reports against (issue 13): every strategy within 1.02x torch's step on 1 rank; owner
and comm-free at least 1.7x faster than torch on 2 ranks; owner at least 0.85 N x on N free cores.
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distributed_muon_cpu as dm  # noqa: E402

D, LAYERS, VECTORS, ROUNDS = 768, 4, 32, 5  # GPT-2 small's width; the median of 5 steps
MATRICES = {f"layers.{i}.{n}": s for i in range(LAYERS)
            for n, s in (("qkv", (3 * D, D)), ("proj", (D, D)), ("fc", (4 * D, D)), ("fc2", (D, 4 * D)))}
OTHERS = {f"vector.{i}": (D,) for i in range(VECTORS)}
TORCH = "torch.optim.Muon + AdamW"


def parameters():
    """Fresh copies of the same starting parameters and gradients: (params, grads), {name: tensor} each."""
    params = {n: torch.randn(s, generator=torch.Generator().manual_seed(k)) * 0.02
              for k, (n, s) in enumerate(MATRICES.items())}
    params.update({n: torch.zeros(s) for n, s in OTHERS.items()})
    g = torch.Generator().manual_seed(len(params))
    return params, {n: torch.randn(p.shape, generator=g) for n, p in params.items()}


def build(strategy, params, grid):
    groups = [dict(params=[(n, params[n]) for n in MATRICES], algorithm="muon"),
              dict(params=[(n, params[n]) for n in OTHERS], algorithm="adamw")]
    return dm.OPTIMIZERS[strategy](groups, grid=grid, lr=0.02, weight_decay=0.1)


def step_ms(step, params, grads, barrier=lambda: None):
    """The median time of ROUNDS calls of step(), each with the gradients set afresh."""
    times = []
    for _ in range(ROUNDS):
        for n, p in params.items():
            p.grad = grads[n]
        barrier()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def rank_main(rank, world, port, out_dir):
    """One of N ranks: every strategy in turn, its step times written to out_dir."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    grid = dm.make_grid(world, 1, rank)
    times = {}
    for strategy in dm.STRATEGIES:
        params, grads = parameters()
        times[strategy] = step_ms(build(strategy, params, grid).step, params, grads, dist.barrier)
    torch.save(times, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def on_one_process():
    """{name: step times} for torch and every strategy on one rank, all in this process."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dm.free_port()}", rank=0, world_size=1)
    grid = dm.make_grid(1, 1, 0)
    params, grads = parameters()
    reference = [torch.optim.Muon([params[n] for n in MATRICES], lr=0.02, weight_decay=0.1),
                 torch.optim.AdamW([params[n] for n in OTHERS], lr=0.02, weight_decay=0.1, foreach=False)]
    times = {TORCH: step_ms(lambda: [o.step() for o in reference], params, grads)}
    for strategy in dm.STRATEGIES:
        params, grads = parameters()
        times[strategy] = step_ms(build(strategy, params, grid).step, params, grads)
    dist.destroy_process_group()
    return times


def on_ranks(world):
    """{strategy: per-step times of the slowest rank} on `world` ranks."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(rank_main, args=(world, dm.free_port(), out_dir), nprocs=world,
                           start_method=dm.start_method())
        per_rank = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]
    return {s: [max(r[s][i] for r in per_rank) for i in range(ROUNDS)] for s in dm.STRATEGIES}


def main(argv=None):
    p = argparse.ArgumentParser(description="Step time of every strategy against torch's, over ranks.")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts (default: 1 2)")
    p.add_argument("--json", metavar="PATH", help="write every step time")
    p.add_argument("--figure", metavar="PATH", help="write the speed-up against ranks as a PNG")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.ranks):
        p.error("--ranks must be >= 1")
    for path in (args.json, args.figure):
        if path:
            dm.check_writable(path, "--json" if path == args.json else "--figure")
    one = on_one_process()
    torch_ms = statistics.median(one[TORCH])
    runs = {1: {s: one[s] for s in dm.STRATEGIES}}
    runs.update({n: on_ranks(n) for n in args.ranks if n > 1})
    print(f"{LAYERS} layers at d = {D}, step() only, 1 thread per rank, median of {ROUNDS} steps, "
          f"{os.cpu_count()} cores here; torch {torch.__version__}")
    print(f"{TORCH} in one process: median {torch_ms:.0f} ms (min {min(one[TORCH]):.0f})\n")
    rows = []
    for n in sorted(runs):
        for s in dm.STRATEGIES:
            median = statistics.median(runs[n][s])
            goal = ("<= 1.02x torch's time" if n == 1 else
                    ">= 1.7x faster" if n == 2 and s != "gather" else
                    f">= {0.85 * n:.2f}x faster" if s == "owner" and n <= (os.cpu_count() or 1) else "-")
            rows.append([n, s, f"{min(runs[n][s]):.0f}", f"{median:.0f}",
                         f"{median / torch_ms:.3f}", f"{torch_ms / median:.2f}x", goal])
    print(dm.format_table(["ranks", "strategy", "min ms", "median ms", "time / torch's", "speed-up", "goal"], rows,
                          [">", "<", ">", ">", ">", ">", "<"]))
    if args.json:
        dm.write_json(args.json, dict(torch=torch.__version__, torch_ms=one[TORCH],
                                      runs={str(n): r for n, r in runs.items()}))
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ranks = sorted(runs)
        for s in dm.STRATEGIES:
            plt.plot(ranks, [torch_ms / statistics.median(runs[n][s]) for n in ranks], marker="o", label=s)
        plt.plot(ranks, ranks, color="gray", linestyle="--", label="N x (ideal)")
        plt.xlabel("ranks (DP = N, TP = 1)")
        plt.ylabel(f"speed-up over {TORCH}, one process")
        plt.legend()
        plt.savefig(args.figure, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
