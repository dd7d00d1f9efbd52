"""The library installs bare: `pip install <checkout>` into a fresh virtual environment that holds torch and what the
checkout declares, and nothing else; then, from another directory, DTensorMuon (under fully_shard) and OwnerMuon
are imported from it and stepped on two Gloo ranks, bit for bit torch.optim.Muon / AdamW.

What the environment holds, and why it proves a bare install: it is made without the system's site-packages (so
neither the base interpreter of a virtual environment the tests run in, nor the user's site, nor the editable
install that requirements.txt makes is seen). Into it go links, not copies, to the distributions this interpreter
has installed: first the installer (pip) and the build backend pyproject.toml names (setuptools), then, after
`pip install --no-deps --no-index --no-build-isolation` built and installed the checkout, every distribution its
installed metadata requires, closed over their own requirements (torch's included) as pip would resolve them.
So the environment sees exactly what `pip install .` would give beside torch, without downloading torch again; a
dependency the library needs and the checkout does not declare (numpy: torch.distributed's object collectives
unpickle through tensor.numpy(), and torch does not require numpy) is absent, and the step fails. The environment
is the same whichever interpreter runs the tests (a system one or one inside a virtual environment): only the
running interpreter's installed distributions are read, never its base's.
"""

import importlib.metadata
import os
import subprocess
import shutil
import sys
import venv

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import ROOT

# Run by the environment's interpreter in an empty folder, once per rank (rank, world, store file on the command
# line): a small model, each optimizer two steps against torch.optim.Muon / AdamW on the same total gradient; rank 0
# then says where every module of the library came from and which distributions the environment holds.
PROBE = r"""
import datetime, importlib.metadata, os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from distmuon import DTensorMuon, OwnerMuon, make_grid, muon_param_groups

torch.set_num_threads(1)
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=120))


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 6))


def gradient(p, step):  # multiples of 2**-10: any order of summing them over ranks is exact
    return 2.0**-10 * (step + 1) * torch.arange(p.numel()).view(p.shape).remainder(7).float()


class TorchOptimizers:
    def __init__(self, net):
        matrices = [p for p in net.parameters() if p.ndim == 2]
        others = [p for p in net.parameters() if p.ndim != 2]
        self.opts = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=0.02, foreach=False)]

    def step(self):
        for o in self.opts:
            o.step()


def stepped(net, opt, grad):
    for step in range(2):
        for p in net.parameters():
            p.grad = grad(p, step)
        opt.step()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in net.parameters()]


net = model()
reference = stepped(net, TorchOptimizers(net), gradient)
start = [p.detach().clone() for p in model().parameters()]
ours = {}
net = fully_shard(model(), mesh=init_device_mesh("cpu", (world,)))  # each parameter a DTensor, Shard(0)
ours["DTensorMuon"] = stepped(net, DTensorMuon(muon_param_groups(net), lr=0.02),
                              lambda p, step: distribute_tensor(gradient(p, step), p.device_mesh, p.placements))
net = model()  # DP = world: rank 0 holds the gradient, the others zeros, summed over DP by the step
ours["OwnerMuon"] = stepped(net, OwnerMuon(muon_param_groups(net), grid=make_grid(world, 1, rank), lr=0.02),
                            lambda p, step: gradient(p, step) * (rank == 0))
if rank == 0:
    for name, params in ours.items():
        print(name, all(torch.equal(a, b) for a, b in zip(params, reference)),
              all(not torch.equal(a, b) for a, b in zip(params, start)))
    library = [m.__file__ for n, m in sys.modules.items()
               if n in ("distmuon", "distributed_muon_cpu") or n.startswith("distmuon.")]
    print("from", sorted({f.split("/distmuon/")[0] if "/distmuon/" in f else os.path.dirname(f) for f in library}))
    print("runner", sorted(n for n in ("muon_tools", "muon_forkserver", "dtensor_demo") if n in sys.modules))
    print("distributions", sorted({d.metadata["Name"].lower().replace("_", "-")
                                   for d in importlib.metadata.distributions()}))
dist.destroy_process_group()
"""
WORLD = 2
TOOLS = ("pip", "setuptools")  # the installer and pyproject.toml's build backend: what `pip install .` runs with


def distribution_files():
    """The files pyproject.toml declares, and itself: what `pip install <checkout>` builds from."""
    return ["pyproject.toml", "README.md", "distributed_muon_cpu.py"] + sorted(
        os.path.relpath(os.path.join(folder, name), ROOT) for folder, _, names in os.walk(os.path.join(ROOT, "distmuon"))
        for name in names if name.endswith(".py"))


def closure(requirements):
    """{name: distribution} of every distribution this interpreter has installed that `requirements` (strings, as
    in a distribution's metadata) need, with their own requirements, markers and extras evaluated as pip does. A
    requirement of a requirement that is not installed here is left out (torch's CUDA libraries, on a CPU build
    installed without them); one of `requirements` itself must be installed."""
    found, todo = {}, [(Requirement(r), True) for r in requirements]
    while todo:
        req, direct = todo.pop()
        name = canonicalize_name(req.name)
        if name in found:
            continue
        try:
            found[name] = dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            assert not direct, f"{req.name} is required but not installed here: pip install -r requirements.txt"
            continue
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in req.extras or {""}):
                todo.append((sub, False))
    return found


def link(distributions, folder):
    """Link each distribution's top-level files and folders (its RECORD's) into `folder`, a path entry."""
    for dist in distributions.values():
        assert dist.files, f"{dist.metadata['Name']}: installed without a RECORD, cannot tell its files"
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            target = folder / top
            if not os.path.lexists(target):
                os.symlink(dist.locate_file(top), target)


def environment():
    """This process's environment variables without those that would put another interpreter's modules first."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def run(python, *args):
    return subprocess.run([python, *args], capture_output=True, text=True, timeout=300, env=environment())


def test_bare_install_steps_two_ranks_from_another_directory(tmp_path):
    source, env_dir, linked, elsewhere = (tmp_path / n for n in ("checkout", "env", "linked", "elsewhere"))
    for name in distribution_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), source / name)
    for folder in (linked, elsewhere):
        folder.mkdir()
    venv.create(env_dir, system_site_packages=False, symlinks=True)
    python = str(env_dir / "bin" / "python")
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    with open(os.path.join(site, "linked.pth"), "w") as f:  # the links' folder on the environment's path
        f.write(f"{linked}\n")
    link(closure(TOOLS), linked)
    install = run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
                  str(source))
    assert install.returncode == 0, install.stderr[-2000:]
    declared = run(python, "-c", "import importlib.metadata as m; print('\\n'.join(m.requires('distmuon') or []))")
    needed = closure(declared.stdout.split("\n")[:-1])
    assert "torch" in needed
    link(needed, linked)
    (elsewhere / "probe.py").write_text(PROBE)
    ranks = [subprocess.Popen([python, "probe.py", str(rank), str(WORLD), str(tmp_path / "store")], cwd=elsewhere,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=environment())
             for rank in range(WORLD)]
    outs = [p.communicate(timeout=300) for p in ranks]
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0, err[-3000:]
    lines = outs[0][0].splitlines()
    assert lines[:2] == ["DTensorMuon True True", "OwnerMuon True True"]  # torch's bits; every parameter moved
    assert lines[2] == f"from {[site]}"  # the installed copy, not the checkout
    assert lines[3] == "runner []"  # the library imports nothing of the runner
    # torch, the checkout and what it declares (with their requirements), the installer and build backend: no more
    assert lines[4] == f"distributions {sorted({'distmuon', *needed, *closure(TOOLS)})}"


def test_the_shell_scripts_run_the_tests_own_interpreter(tmp_path):
    """A `python` first on PATH that is not this interpreter (a virtual environment not activated, a system one
    without torch) is not what the scripts the tests run start: conftest.py hands them $PYTHON."""
    (tmp_path / "python").write_text("#!/bin/sh\necho 'the wrong python' >&2\nexit 97\n")
    (tmp_path / "python").chmod(0o755)
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    refresh = ["bash", os.path.join(ROOT, "benchmarks", "refresh.sh"), "--list"]
    ours = subprocess.run(refresh, capture_output=True, text=True, timeout=60, env=dict(os.environ, PATH=path))
    assert (ours.returncode, ours.stderr) == (0, "") and "default_4x2: default_4x2.txt" in ours.stdout
    plain = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    wrong = subprocess.run(refresh, capture_output=True, text=True, timeout=60, env=dict(plain, PATH=path))
    assert (wrong.returncode, wrong.stderr) == (97, "the wrong python\n")  # without it: PATH's
