"""Does torch's Newton-Schulz give the same bits on a CPU and on a GPU? Torch's own
Newton-Schulz (5 steps) on the same float32 input, once on this CPU (1 thread) and twice on
the GPU: how many elements differ between CPU and GPU, the largest difference, and whether
the GPU repeats itself exactly. Needs a CUDA GPU; without one it exits with status 2.

    python benchmarks/cpu_vs_gpu_newton_schulz.py

benchmarks/on_gpu.sh runs it (part 2b): notes/measured/cpu_vs_gpu_newton_schulz_<gpu>.txt (chapter 6 of the notes).
"""

import os
import signal
import sys

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import torch  # noqa: E402
from torch.optim._muon import _zeropower_via_newtonschulz as ns  # noqa: E402


import muon_tools  # noqa: E402

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 5
EPS = 1e-7
SHAPES = [(384, 128), (128, 128), (512, 128), (128, 512), (8, 128), (4096, 1024)]


def main(argv=None):
    muon_tools.OneLineParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help; no options
    if not torch.cuda.is_available():
        print("error: no CUDA GPU (torch.cuda.is_available() is False); run this on a machine with one",
              file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    print(f"{'shape':>12}  {'elements differing':>18}  {'max |cpu - gpu|':>15}  {'gpu twice equal':>15}")
    for shape in SHAPES:
        g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        cpu = ns(g, COEFFICIENTS, STEPS, EPS)
        gpu = ns(g.cuda(), COEFFICIENTS, STEPS, EPS)
        gpu2 = ns(g.cuda(), COEFFICIENTS, STEPS, EPS)
        d = (cpu.float() - gpu.float().cpu()).abs()
        print(f"{str(shape):>12}  {int((d > 0).sum()):>10} / {d.numel():<7}  {d.max().item():>15.3e}  "
              f"{str(torch.equal(gpu, gpu2)):>15}")


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
