"""Does the step get faster with ranks? torch.optim.Muon + torch.optim.AdamW in one process, then
every strategy (and the owner strategies with --overlap, section 7) on 1 rank (in this process) and
on N ranks (DP = N, TP = 1, one process and one thread each), on the same parameters: 4 transformer
layers at d = 768 (qkv 2304x768, proj 768x768, fc 3072x768, fc2 768x3072 to Muon) and 32 vectors of
768 to AdamW. Only step() is timed, gradients preset; a step's time on N ranks is that of its
slowest rank. Figures and ratios, never verdicts: this machine is shared and noisy.

    python benchmarks/scaling.py                          # 1 and 2 ranks here (2 cores)
    python benchmarks/scaling.py --ranks 1 2 4 8 --json scaling.json --figure scaling.png
    python benchmarks/scaling.py --d 128                  # a CPU without bf16 units (see below)
    python benchmarks/scaling.py --without-ns --ranks 1   # everything but Newton-Schulz, at d = 768

The first line printed is this CPU's one-thread matmul speed in bf16 and fp32. Newton-Schulz runs
in bf16; on a CPU without bf16 matrix units (AVX512-BF16 / AMX) bf16 is tens of times slower than
fp32, Newton-Schulz is then nearly the whole step, and the ratios say little about communication:
use --d to keep the run short there, and read the ratios with that in mind.

Every round steps every variant once, in turn (interleaved), so that drift in the machine's load
hits them alike. --without-ns replaces Newton-Schulz, in torch.optim.Muon and here alike, by the
bf16 cast it starts with: what is left is what each strategy does around Newton-Schulz (momentum,
copies, collectives, the weight update, AdamW), the part the 1-rank goal is about, and it runs in
seconds at d = 768 even where bf16 matmuls crawl. Its results are not Muon steps (the weights it
writes are wrong by design); it times them and nothing else.

Goals it reports against (issue 13): every strategy within 1.02x torch's step on 1 rank; owner
and comm-free at least 1.7x faster than torch on 2 ranks; owner at least 0.85 N x on N free cores.
"""

import datetime
import os
import statistics
import sys
import tempfile
import time


if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distributed_muon_cpu  # noqa: E402
from distmuon import large_runs, owners  # noqa: E402
from distmuon.dtensor import exchange  # noqa: E402
import muon_tools  # noqa: E402

D, LAYERS, VECTORS, ROUNDS = 768, 4, 32, 5  # GPT-2 small's width; the median of 5 steps
TORCH = "torch.optim.Muon + AdamW"
HYPERPARAMETERS = dict(lr=0.02, weight_decay=0.1)  # for torch's optimizers and ours alike
# What is timed: every strategy, and those that take overlap (the owner strategies) with their step overlapped.
OVERLAPPED = owners.strategies_where(lambda strategy: "overlap" in strategy.own_options)
VARIANTS = {s: (s, {}) for s in owners.STRATEGIES}
VARIANTS.update({f"{s} --overlap {owners.OVERLAP_DEFAULT}": (s, dict(overlap=owners.OVERLAP_DEFAULT)) for s in OVERLAPPED})


def shapes(d, layers):
    """({matrix name: shape}, {vector name: shape}) of the model timed."""
    matrices = {f"layers.{i}.{n}": s for i in range(layers)
                for n, s in (("qkv", (3 * d, d)), ("proj", (d, d)), ("fc", (4 * d, d)), ("fc2", (d, 4 * d)))}
    return matrices, {f"vector.{i}": (d,) for i in range(VECTORS)}


def model_arguments(p, *, d=D, rounds=ROUNDS, rounds_help="steps of each variant"):
    """--d, --layers and --rounds: the model every benchmark of this one times, and how often."""
    p.add_argument("--d", type=int, default=d, help="model width (default %(default)s)")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers of 4 matrices (default %(default)s)")
    p.add_argument("--rounds", type=int, default=rounds, help=f"{rounds_help} (default %(default)s)")


def check_model(p, args, processes):
    """Refuse, in one line, a model that cannot run: a size below 1, or more than this machine's memory."""
    if args.d < 1 or args.layers < 1 or args.rounds < 1:
        p.error("--d, --layers and --rounds must be >= 1")
    why = memory_error(args.d, args.layers, processes)
    if why:
        p.error(why)


def memory_error(d, layers, processes):
    """"" when `processes` processes at once can hold the model here, else why not (one line): each keeps at
    least the matrices' weights, gradients and momentum in fp32, 3 x 4 bytes x 12 d^2 per layer (shapes())."""
    need = processes * 3 * 4 * 12 * d * d * layers
    if need <= muon_tools.host_memory():
        return ""
    return (f"--d {d} x --layers {layers} on {processes} processes needs at least {muon_tools.human_bytes(need)}, more than "
            f"this machine's {muon_tools.human_bytes(muon_tools.host_memory())} of memory")


def parameters(d, layers, device="cpu"):
    """Fresh copies of the same starting parameters and gradients: (params, grads), {name: tensor} each, made on
    `device` by its own generator (the same numbers on every CPU; a GPU's are its generator's)."""
    matrices, others = shapes(d, layers)
    params = {n: torch.randn(s, generator=torch.Generator(device).manual_seed(k), device=device) * 0.02
              for k, (n, s) in enumerate(matrices.items())}
    params.update({n: torch.zeros(s, device=device) for n, s in others.items()})
    g = torch.Generator(device).manual_seed(len(params))
    return params, {n: torch.randn(p.shape, generator=g, device=device) for n, p in params.items()}


def torch_reference(params):
    """torch.optim.Muon for the matrices and AdamW for the rest, with build()'s hyperparameters."""
    return [torch.optim.Muon([p for p in params.values() if p.ndim == 2], **HYPERPARAMETERS),
            torch.optim.AdamW([p for p in params.values() if p.ndim != 2], **HYPERPARAMETERS, foreach=False)]


def build(variant, params, grid, variants=VARIANTS, module=owners):
    """`variant`'s optimizer from `module`'s OPTIMIZERS (this distmuon.owners, or another commit's)."""
    strategy, options = variants[variant]
    groups = [dict(params=[(n, p) for n, p in params.items() if p.ndim == 2], algorithm="muon"),
              dict(params=[(n, p) for n, p in params.items() if p.ndim != 2], algorithm="adamw")]
    return module.OPTIMIZERS[strategy](groups, grid=grid, **HYPERPARAMETERS, **options)


def matmul_gflops(d, dtype):
    """One-thread GFLOP/s of a d x d matmul in `dtype` on this CPU (the median of 5)."""
    a, b = torch.randn(d, d, dtype=dtype), torch.randn(d, d, dtype=dtype)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * d**3 / statistics.median(times[1:]) / 1e9


TORCH_NEWTON_SCHULZ = "_zeropower_via_newtonschulz"  # torch.optim._muon's, a private name: checked before use


def without_newton_schulz():
    """Newton-Schulz, in torch.optim.Muon and in this project, replaced by the bf16 cast it begins
    with (--without-ns)."""
    import torch.optim._muon as torch_muon

    cast = lambda matrix, *args, **kwargs: matrix.bfloat16()  # noqa: E731
    setattr(torch_muon, TORCH_NEWTON_SCHULZ, cast)
    # the lesson's, the ones distmuon.owners (--batched-ns) and distmuon.large_runs (blocks, heads) imported, and the
    # one DTensorMuon's owners run over the matrices its gather made
    distributed_muon_cpu.newton_schulz = owners.newton_schulz = large_runs.newton_schulz = cast
    exchange.newton_schulz_overwriting = cast


def step_ms(steppers, rounds, barrier=lambda: None):
    """{name: the times of `rounds` calls of its step()}; steppers: {name: (step, params, grads)}.
    Each round calls every step() once, in turn, each with its gradients set afresh."""
    times = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, (step, params, grads) in steppers.items():
            for n, p in params.items():
                p.grad = grads[n]
            barrier()
            t0 = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def steppers(variants, grid, d, layers):
    """{variant: (its optimizer's step, its own fresh parameters, their gradients)}."""
    built = {}
    for variant in variants:
        params, grads = parameters(d, layers)
        built[variant] = (build(variant, params, grid, variants).step, params, grads)
    return built


def rank_main(rank, world, port, out_dir, d, layers, variants, rounds, without_ns):
    """One of N ranks: every variant, interleaved, its step times written to out_dir."""
    torch.set_num_threads(1)
    if without_ns:
        without_newton_schulz()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    times = step_ms(steppers(variants, distributed_muon_cpu.make_grid(world, 1, rank), d, layers), rounds, dist.barrier)
    muon_tools.write_atomically(os.path.join(out_dir, f"{rank}.pt"), lambda f: torch.save(times, f))
    dist.destroy_process_group()


def on_one_process(d, layers, rounds=ROUNDS):
    """{name: step times} for torch and every variant on one rank, all in this process, interleaved."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{muon_tools.free_port()}", rank=0, world_size=1)
    params, grads = parameters(d, layers)
    reference = torch_reference(params)
    built = {TORCH: (lambda: [o.step() for o in reference], params, grads)}
    built.update(steppers(VARIANTS, distributed_muon_cpu.make_grid(1, 1, 0), d, layers))
    times = step_ms(built, rounds)
    dist.destroy_process_group()
    return times


def on_ranks(world, d, layers, variants=VARIANTS, rounds=ROUNDS, without_ns=False):
    """{variant: per-step times of the slowest rank} on `world` ranks."""
    with tempfile.TemporaryDirectory() as out_dir:
        muon_tools.run_processes(rank_main, (world, muon_tools.free_port(), out_dir, d, layers, variants, rounds,
                                             without_ns), world,
                         folders=(out_dir,))
        per_rank = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]
    return {v: [max(r[v][i] for r in per_rank) for i in range(rounds)] for v in variants}


def goal(n, variant, without_ns=False):
    """What issue 13 asks of this variant on n ranks (step time; the spread is asked of every run).
    Without Newton-Schulz, the speed-ups on N ranks are no Muon step's: no goal is shown for them."""
    strategy = VARIANTS[variant][0]
    if n == 1:
        return "<= 1.02x torch's time"
    if without_ns:
        return "-"
    if n == 2 and owners.strategy_class(strategy).orthogonalizes_once:
        return ">= 1.7x faster"
    return f">= {0.85 * n:.2f}x faster" if strategy == "owner" and n <= (os.cpu_count() or 1) else "-"


def main(argv=None):
    p = muon_tools.OneLineParser(description="Step time of every strategy against torch's, over ranks.")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts (default: 1 2)")
    model_arguments(p)
    p.add_argument("--without-ns", action="store_true",
                   help="time everything but Newton-Schulz (replaced by its bf16 cast, in torch's Muon too)")
    p.add_argument("--json", metavar="PATH", help="write every step time")
    p.add_argument("--figure", metavar="PATH", help="write the speed-up against ranks as a PNG")
    args = p.parse_args(argv)
    if any(not 1 <= n <= muon_tools.MAX_WORLD for n in args.ranks):
        p.error(f"--ranks must be in [1, {muon_tools.MAX_WORLD}] (got {' '.join(map(str, args.ranks))})")
    check_model(p, args, max(args.ranks))
    try:
        muon_tools.check_outputs({"--json": args.json, "--figure": args.figure})
        for option, path in (("--json", args.json), ("--figure", args.figure)):
            if path:
                muon_tools.check_writable(path, option)
    except ValueError as e:
        p.error(str(e))
    if args.without_ns and not hasattr(torch.optim._muon, TORCH_NEWTON_SCHULZ):
        p.error(f"--without-ns: torch {torch.__version__} has no torch.optim._muon.{TORCH_NEWTON_SCHULZ} to replace")
    torch.set_num_threads(1)
    speed = {str(dt).replace("torch.", ""): matmul_gflops(args.d, dt) for dt in (torch.bfloat16, torch.float32)}
    if args.without_ns:
        without_newton_schulz()
    one = on_one_process(args.d, args.layers, args.rounds)
    torch_ms = statistics.median(one[TORCH])
    runs = {1: {v: one[v] for v in VARIANTS}}
    runs.update({n: on_ranks(n, args.d, args.layers, rounds=args.rounds, without_ns=args.without_ns)
                 for n in args.ranks if n > 1})
    print(f"This CPU, one thread, {args.d} x {args.d} matmul: "
          + ", ".join(f"{dt} {g:.1f} GFLOP/s" for dt, g in speed.items()))
    print(f"{args.layers} layers at d = {args.d}, step() only, 1 thread per rank, median of {args.rounds} "
          f"interleaved steps, {os.cpu_count()} cores here; torch {torch.__version__}")
    if args.without_ns:
        print("WITHOUT Newton-Schulz (--without-ns): it is replaced by its bf16 cast, in torch's Muon and here")
    print(f"{TORCH} in one process: median {torch_ms:.0f} ms (min {min(one[TORCH]):.0f})\n")
    rows = []
    for n in sorted(runs):
        for v in VARIANTS:
            median = statistics.median(runs[n][v])
            rows.append([n, v, f"{min(runs[n][v]):.0f}", f"{median:.0f}", f"{median / min(runs[n][v]) - 1:.0%}",
                         f"{median / torch_ms:.3f}", f"{torch_ms / median:.2f}x", goal(n, v, args.without_ns)])
    print(muon_tools.format_table(["ranks", "strategy", "min ms", "median ms", "median/min - 1", "time / torch's",
                           "speed-up", "goal"], rows, [">", "<", ">", ">", ">", ">", ">", "<"]))
    print("\nGoal for every run: median/min - 1 <= 10 % (steady step times).")
    if args.json:
        muon_tools.write_json(args.json, dict(torch=torch.__version__, d=args.d, layers=args.layers,
                                              matmul_gflops=speed,
                                      without_ns=args.without_ns, torch_ms=one[TORCH],
                                      runs={str(n): r for n, r in runs.items()}))
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ranks = sorted(runs)
        for v in VARIANTS:
            plt.plot(ranks, [torch_ms / statistics.median(runs[n][v]) for n in ranks], marker="o", label=v)
        plt.plot(ranks, ranks, color="gray", linestyle="--", label="N x (ideal)")
        plt.xlabel("ranks (DP = N, TP = 1)")
        plt.ylabel(f"speed-up over {TORCH}, one process")
        plt.title(f"{args.layers} layers at d = {args.d}; bf16 matmul {speed['bfloat16']:.0f} GFLOP/s here"
                  + (", without Newton-Schulz" if args.without_ns else ""))
        plt.legend()
        muon_tools.save_figure(plt.gcf(), args.figure, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
