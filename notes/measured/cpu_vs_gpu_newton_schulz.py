"""Does torch's Newton-Schulz give the same bits on a CPU and on a GPU? (Run on a machine with a GPU.)

    python3 notes/measured/cpu_vs_gpu_newton_schulz.py
"""
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as ns
torch.set_num_threads(1)
c = (3.4445, -4.7750, 2.0315)
print(f"{'shape':>12}  {'elements differing':>18}  {'max |cpu - gpu|':>15}  {'gpu twice equal':>15}")
for shape in [(384, 128), (128, 128), (512, 128), (128, 512), (8, 128), (4096, 1024)]:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    cpu = ns(g, c, 5, 1e-7)
    gpu = ns(g.cuda(), c, 5, 1e-7)
    gpu2 = ns(g.cuda(), c, 5, 1e-7)
    d = (cpu.float() - gpu.float().cpu()).abs()
    print(f"{str(shape):>12}  {int((d > 0).sum()):>10} / {d.numel():<7}  {d.max().item():>15.3e}  {str(torch.equal(gpu, gpu2)):>15}")
