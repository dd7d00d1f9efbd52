"""The library installs: `pip install <checkout>` into a fresh virtual environment, then, from another directory,
DTensorMuon and OwnerMuon are imported from it and stepped on a one-rank Gloo group, bit for bit torch's.

The environment sees this interpreter's packages (torch, without a second copy of it), among them the editable
install of this checkout that requirements.txt makes; so the test checks where every module of the library was
loaded from: the environment's own site-packages, never the checkout. What is installed is a copy of the files the
distribution declares (pyproject.toml), so that pip's build writes nothing into the checkout.
"""

import os
import shutil
import subprocess
import sys
import venv

from conftest import ROOT

# Run by the environment's interpreter, in an empty folder: one Gloo rank, a small model, each optimizer one step
# against torch.optim.Muon / AdamW on the same gradients; then where every module of the library came from.
PROBE = r"""
import datetime, os, socket, sys
import torch, torch.distributed as dist

from distmuon import DTensorMuon, OwnerMuon, make_grid, muon_param_groups

torch.set_num_threads(1)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))


class TorchOptimizers:
    def __init__(self, net):
        matrices = [p for p in net.parameters() if p.ndim == 2]
        others = [p for p in net.parameters() if p.ndim != 2]
        self.opts = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=0.02, foreach=False)]

    def step(self):
        for o in self.opts:
            o.step()


def stepped(build):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 6))
    opt = build(net)
    for step in range(2):
        for p in net.parameters():
            p.grad = 2.0**-10 * (step + 1) * torch.arange(p.numel()).view(p.shape).remainder(7).float()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


reference = stepped(TorchOptimizers)
ours = {
    "DTensorMuon": stepped(lambda net: DTensorMuon(muon_param_groups(net), lr=0.02)),
    "OwnerMuon": stepped(lambda net: OwnerMuon(muon_param_groups(net), grid=make_grid(1, 1, 0), lr=0.02)),
}
start = stepped(lambda net: type("Nothing", (), {"step": lambda self: None})())
for name, params in ours.items():
    print(name, all(torch.equal(a, b) for a, b in zip(params, reference)),
          all(not torch.equal(a, b) for a, b in zip(params, start)))
library = [m.__file__ for n, m in sys.modules.items()
           if n in ("distmuon", "distributed_muon_cpu") or n.startswith("distmuon.")]
print("from", sorted({f.split("/distmuon/")[0] if "/distmuon/" in f else os.path.dirname(f) for f in library}))
print("runner", sorted(n for n in ("muon_tools", "muon_forkserver", "dtensor_demo") if n in sys.modules))
dist.destroy_process_group()
"""


def distribution_files():
    """The files pyproject.toml declares, and itself: what `pip install <checkout>` builds from."""
    return ["pyproject.toml", "README.md", "distributed_muon_cpu.py"] + sorted(
        os.path.relpath(os.path.join(folder, name), ROOT) for folder, _, names in os.walk(os.path.join(ROOT, "distmuon"))
        for name in names if name.endswith(".py"))


def test_pip_install_then_import_and_step_from_another_directory(tmp_path):
    source, env_dir, elsewhere = tmp_path / "checkout", tmp_path / "env", tmp_path / "elsewhere"
    for name in distribution_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), source / name)
    elsewhere.mkdir()
    venv.create(env_dir, system_site_packages=True)  # its pip and setuptools: this interpreter's
    python = str(env_dir / "bin" / "python")
    # no network needed: torch and setuptools come from this interpreter's packages
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              str(source)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    probe = subprocess.run([python, "-c", PROBE],
                           cwd=elsewhere, capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert probe.returncode == 0, probe.stderr[-3000:]
    lines = probe.stdout.splitlines()
    assert lines[:2] == ["DTensorMuon True True", "OwnerMuon True True"]  # torch's bits; every parameter moved
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert lines[2] == f"from {[site]}"  # the installed copy, not the checkout
    assert lines[3] == "runner []"  # the library imports nothing of the runner
