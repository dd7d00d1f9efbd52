"""How fast is Newton-Schulz against the matmul it is made of? Torch's own bf16 Newton-Schulz (the lesson's
coefficients, steps and epsilon) of a float32 matrix of each shape, against one bf16 X @ X.T of that matrix
(its first product, X the wide way round), on one device: milliseconds (median of --repeats after one warm-up,
after torch.cuda.synchronize() on a GPU) and GFLOP/s, with newton_schulz_flops counting Newton-Schulz's.
A ratio near 1 says Newton-Schulz runs at the matmul's speed; below 1, its small products and elementwise
work cost more than their FLOPs.

    python benchmarks/newton_schulz_gflops.py 2304x768 768x768 3072x768 768x3072 8192x8192   # on a GPU
    python benchmarks/newton_schulz_gflops.py --device cpu 256x1024                           # this CPU, 1 thread

benchmarks/on_gpu.sh runs the first line (part 2): notes/measured/ns_gflops_<gpu>.txt.
"""

import argparse
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
import muon_tools  # noqa: E402


def shape_arg(text):
    """'ROWSxCOLS' -> (rows, cols), both positive; argparse's error otherwise."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxCOLS with two positive whole numbers")
    return int(parts[0]), int(parts[1])


def build_parser():
    p = muon_tools.OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="+", type=shape_arg, metavar="ROWSxCOLS", help="the matrices' shapes")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where to run (default %(default)s)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs of each (default %(default)s)")
    return p


def median_ms(work, repeats, sync):
    work()  # the warm-up: cuBLAS's handle and workspace, the CPU's first-touch pages
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA GPU here (torch.cuda.is_available() is False); --device cpu runs on this CPU")
    torch.set_num_threads(1)  # the lesson's ranks run one thread each
    on_gpu = args.device == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    where = torch.cuda.get_device_name(0) if on_gpu else "this CPU, 1 thread"
    print(f"{where}, torch {torch.__version__}; median of {args.repeats} after one warm-up")
    rows = []
    for rows_, cols in args.shapes:
        g = torch.randn(rows_, cols, generator=torch.Generator().manual_seed(0)).to(args.device)
        x = g.bfloat16() if rows_ <= cols else g.bfloat16().T.contiguous()  # wide: X @ X.T is the small Gram
        m, n = x.shape
        ns_ms = median_ms(lambda: torch_newton_schulz(g, distributed_muon_cpu.NS_COEFFICIENTS,
                                                      distributed_muon_cpu.NS_STEPS, distributed_muon_cpu.NS_EPS),
                          args.repeats, sync)
        mm_ms = median_ms(lambda: x @ x.T, args.repeats, sync)
        ns_rate = distributed_muon_cpu.newton_schulz_flops((rows_, cols)) / ns_ms / 1e6
        mm_rate = 2 * m * m * n / mm_ms / 1e6
        rows.append([f"{rows_}x{cols}", f"{ns_ms:.3f}", f"{ns_rate:.0f}", f"{mm_ms:.3f}", f"{mm_rate:.0f}",
                     f"{ns_rate / mm_rate:.2f}"])
    print(muon_tools.format_table(["shape", "NS ms", "NS GFLOP/s", "X@X.T ms", "matmul GFLOP/s", "NS / matmul"], rows,
                          [">"] * 6))
    return 0


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
