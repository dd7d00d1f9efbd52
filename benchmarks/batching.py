"""Batched Newton-Schulz (--batched-ns): one baddbmm call for a stack of same-shape matrices,
against one addmm call per matrix (the default, torch.optim.Muon's own path), on this CPU
(1 thread, as every rank runs). For each case: the time of both, and how far the batched
results are from torch's single-matrix Newton-Schulz (they are not always bit-identical:
bf16 baddbmm and addmm round some near-ties differently; section 1 of the script).

    python benchmarks/batching.py
"""

import os
import signal
import statistics
import sys
import time

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import torch  # noqa: E402
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz  # noqa: E402


import distributed_muon_cpu  # noqa: E402
from distmuon import owners  # noqa: E402
import muon_tools  # noqa: E402

REPEATS = 7  # median of 7 timings of each variant
# (shape, matrices): small ones, where batching pays; GPT-2-small-sized ones (d = 768); small-side ones
CASES = [((32, 64), 12), ((64, 64), 64), ((128, 128), 16), ((8, 128), 8), ((384, 128), 4), ((512, 128), 4),
         ((768, 768), 4), ((2304, 768), 2), ((3072, 768), 2), ((600, 6), 16), ((97, 5), 16)]


def median_ms(fn):
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    muon_tools.OneLineParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help; no options
    torch.set_num_threads(1)
    print(f"Newton-Schulz, {distributed_muon_cpu.NS_STEPS} steps, bf16, 1 thread, median of {REPEATS}; torch {torch.__version__}\n")
    rows = []
    for shape, count in CASES:
        stack = torch.randn(count, *shape, generator=torch.Generator().manual_seed(count))
        one_by_one = lambda: [distributed_muon_cpu.newton_schulz(m) for m in stack]
        batched = lambda: owners.batched_newton_schulz(stack)
        expected = [torch_newton_schulz(m.clone(), distributed_muon_cpu.NS_COEFFICIENTS, distributed_muon_cpu.NS_STEPS,
                                        distributed_muon_cpu.NS_EPS) for m in stack]
        got = batched()
        differing = sum(not torch.equal(b, e) for b, e in zip(got, expected))
        relative = max(((b.float() - e.float()).abs().max() / e.float().abs().max()).item()
                       for b, e in zip(got, expected))
        loop_ms, batch_ms = median_ms(one_by_one), median_ms(batched)
        gflop = count * distributed_muon_cpu.newton_schulz_flops(shape) / 1e9
        rows.append([f"{shape[0]}x{shape[1]}", count, f"{gflop:.3f}", f"{loop_ms:.2f}", f"{batch_ms:.2f}",
                     f"{loop_ms / batch_ms:.2f}x", f"{differing}/{count}", f"{relative:.1e}" if relative else "0"])
    print(muon_tools.format_table(["shape", "matrices", "GFLOP", "one call each, ms", "one batched call, ms",
                                   "speed-up",
                           "differ from torch", "max |d| / max |O|"], rows, ["<"] + [">"] * 7))


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
