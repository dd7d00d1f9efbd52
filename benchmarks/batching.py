"""Batched Newton-Schulz: one baddbmm call for a stack of same-shape matrices, against one
call per matrix, on this CPU (1 thread, as every rank runs). Each result is checked bit for
bit against torch's own single-matrix Newton-Schulz.

    python benchmarks/batching.py         # about 20 s on 2 cores

The owner strategy stacks the same-shape matrices a rank owns (section 6 of the script).
"""

import os
import statistics
import sys
import time

import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distributed_muon_cpu as dm  # noqa: E402

REPEATS = 7  # median of 7 timings of each variant
CASES = [((32, 64), 12), ((64, 64), 64), ((128, 128), 16), ((8, 128), 8), ((384, 128), 4), ((512, 128), 4)]


def median_ms(fn):
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    torch.set_num_threads(1)
    print(f"Newton-Schulz, {dm.NS_STEPS} steps, bf16, 1 thread, median of {REPEATS}; torch {torch.__version__}\n")
    rows = []
    for shape, count in CASES:
        stack = torch.randn(count, *shape, generator=torch.Generator().manual_seed(count))
        one_by_one = lambda: [dm.newton_schulz(m) for m in stack]
        batched = lambda: dm.newton_schulz(stack)
        identical = all(torch.equal(b, torch_newton_schulz(m.clone(), dm.NS_COEFFICIENTS, dm.NS_STEPS, dm.NS_EPS))
                        for b, m in zip(batched(), stack))
        loop_ms, batch_ms = median_ms(one_by_one), median_ms(batched)
        gflop = count * dm.newton_schulz_flops(shape) / 1e9
        rows.append([f"{shape[0]}x{shape[1]}", count, f"{gflop:.3f}", f"{loop_ms:.2f}", f"{batch_ms:.2f}",
                     f"{loop_ms / batch_ms:.2f}x", f"{gflop / batch_ms * 1e3:.1f}", "yes" if identical else "NO"])
    print(dm.format_table(["shape", "matrices", "GFLOP", "one call each, ms", "one batched call, ms", "speed-up",
                           "batched GFLOP/s", "identical to torch"], rows, ["<"] + [">"] * 7))


if __name__ == "__main__":
    main()
