"""Every strategy on one rank (DP = TP = 1) against torch.optim.Muon + torch.optim.AdamW in the
same process, on the same parameters and gradients: does the distributed optimizer do anything at
world size 1 that one device would not? The parameter set is 4 transformer layers at d = 768
(qkv 2304x768, proj 768x768, fc 3072x768, fc2 768x3072 to Muon) and 32 vectors of 768 to AdamW.
Only step() is timed, gradients preset, one thread, rounds interleaved across the optimizers.

    python benchmarks/one_process.py          # about 2 minutes on 2 cores
"""

import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distributed_muon_cpu as dm  # noqa: E402

D, LAYERS, VECTORS, ROUNDS = 768, 4, 32, 7  # GPT-2 small's width; the median of 7 interleaved rounds
MATRICES = {f"layers.{i}.{n}": s for i in range(LAYERS)
            for n, s in (("qkv", (3 * D, D)), ("proj", (D, D)), ("fc", (4 * D, D)), ("fc2", (D, 4 * D)))}
OTHERS = {f"vector.{i}": (D,) for i in range(VECTORS)}


def parameters():
    """Fresh copies of the same starting parameters: ({matrix name: tensor}, {vector name: tensor})."""
    mats = {n: torch.randn(s, generator=torch.Generator().manual_seed(k)) * 0.02
            for k, (n, s) in enumerate(MATRICES.items())}
    return mats, {n: torch.zeros(s) for n, s in OTHERS.items()}


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dm.free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    grid = dm.make_grid(1, 1, 0)
    g = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(s, generator=g) for n, s in {**MATRICES, **OTHERS}.items()}
    steps = {}
    mats, others = parameters()
    reference = [torch.optim.Muon(list(mats.values()), lr=0.02, weight_decay=0.1),
                 torch.optim.AdamW(list(others.values()), lr=0.02, weight_decay=0.1, foreach=False)]
    steps["torch.optim.Muon + AdamW"] = ({**mats, **others}, lambda: [o.step() for o in reference])
    for name, optimizer in dm.OPTIMIZERS.items():
        mats, others = parameters()
        opt = optimizer([dict(params=list(mats.items()), algorithm="muon"),
                         dict(params=list(others.items()), algorithm="adamw")], grid=grid, lr=0.02, weight_decay=0.1)
        steps[name] = ({**mats, **others}, opt.step)
    times = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, (params, step) in steps.items():
            for n, p in params.items():
                p.grad = grads[n]
            t0 = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - t0) * 1e3)
    dist.destroy_process_group()
    torch_ms = statistics.median(times["torch.optim.Muon + AdamW"])
    print(f"One process, {LAYERS} layers at d = {D}, step() only, 1 thread, {ROUNDS} interleaved rounds; "
          f"torch {torch.__version__}\n")
    rows = [[name, f"{min(t):.0f}", f"{statistics.median(t):.0f}", f"{statistics.median(t) / torch_ms:.3f}"]
            for name, t in times.items()]
    print(dm.format_table(["optimizer", "min ms", "median ms", "median / torch"], rows, ["<", ">", ">", ">"]))
    same = all(torch.equal(steps["torch.optim.Muon + AdamW"][0][n], params[n])
               for name, (params, _) in steps.items() for n in params)
    print(f"\nafter {ROUNDS} steps every strategy's parameters equal torch's: {same}")


if __name__ == "__main__":
    main()
