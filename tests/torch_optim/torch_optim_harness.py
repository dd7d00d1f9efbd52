"""PyTorch's own optimizer tests (test/test_optim.py: TestOptimRenewed over optim_db) run in this process, on CPU,
with a chosen class in optim_db's Muon entry: torch.optim.Muon itself (the set to match) or DTensorMuon on a
one-rank Gloo group. README.md beside this file says where the test file comes from and why it is not in git.

    python tests/torch_optim/torch_optim_harness.py      # the table: each Muon test under torch's Muon, DTensorMuon,
                                                         # and DTensorMuon without the Tensor-lr input (one cause apart)
"""

import copy
import datetime
import hashlib
import importlib.util
import os
import sys
import types
import unittest

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The file the tests are read from: never fetched at test time; README.md says how to put it there. Its name is
# not test_*.py, so that pytest never collects it as it is (it would run every optimizer's tests).
UPSTREAM = os.environ.get("DISTMUON_TORCH_TEST_OPTIM", os.path.join(HERE, "upstream", "pytorch_test_optim.py"))
# The copy README.md's lists were made with (its origin and commit are stated there).
UPSTREAM_SHA256 = "023432cde3236f3321eeadaa399f3b86add75494ac84ffa437922831459ec459"
TENSOR_LR = "Tensor lr"  # the desc of optim_inputs_func_muon's input whose lr is a tensor


def upstream_problem():
    """Why the upstream file cannot be run here (one line), or None."""
    if not os.path.isfile(UPSTREAM):
        return (f"{UPSTREAM} is absent: it is PyTorch's test/test_optim.py, kept out of git; "
                f"tests/torch_optim/README.md says how to put it there")
    try:
        import expecttest  # noqa: F401  (torch.testing._internal.common_utils imports it)
    except ImportError:
        return "torch's test helpers need the package expecttest: pip install expecttest"
    return None


def upstream_sha256():
    with open(UPSTREAM, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def dtensor_muon_class():
    """DTensorMuon under the name Muon: the upstream tests give an optimizer whose __name__ is "Muon" only its 2-D
    weight (torch's Muon takes nothing else), so the class must carry that name to get the inputs torch's gets."""
    from distmuon import DTensorMuon
    return type("Muon", (DTensorMuon,), {"__module__": __name__, "__qualname__": "Muon"})


def _optim_package_stand_in():
    """test_optim.py imports three classes from its sibling package test/optim/ (not in the wheel) and only
    re-exports them; the harness runs TestOptimRenewed alone, so each stands in as an empty TestCase."""
    from torch.testing._internal.common_utils import TestCase
    package = types.ModuleType("optim")
    package.__path__ = []
    modules = {"optim": package}
    for module, cls in [("test_lrscheduler", "TestLRScheduler"), ("test_optim", "TestDifferentiableOptimizer"),
                        ("test_swa_utils", "TestSWAUtils")]:
        m = types.ModuleType(f"optim.{module}")
        setattr(m, cls, type(cls, (TestCase,), {}))
        setattr(package, module, m)
        modules[m.__name__] = m
    return modules


def load(optim_cls, label, without_inputs=()):
    """The upstream module executed with optim_db's Muon entry holding optim_cls (and its optim inputs less those
    whose desc is in without_inputs); returns its CPU test class. optim_db is restored afterwards."""
    from torch.testing._internal import common_optimizers
    index = next(i for i, info in enumerate(common_optimizers.optim_db) if info.name == "Muon")
    original = common_optimizers.optim_db[index]
    entry = copy.copy(original)
    entry.optim_cls = optim_cls
    if without_inputs:
        inputs = original.optim_inputs_func
        entry.optim_inputs_func = lambda device, dtype=None: [
            i for i in inputs(device, dtype) if i.desc not in without_inputs]
    stand_ins = _optim_package_stand_in()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    common_optimizers.optim_db[index] = entry
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location(f"torch_test_optim_{label}", UPSTREAM)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        common_optimizers.optim_db[index] = original
        for name, was in saved.items():
            if was is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = was
    return module.TestOptimRenewedCPU


def muon_test_names(cls):
    """Every test of the CPU class that runs the Muon entry (its name carries the entry's name)."""
    return sorted(n for n in dir(cls) if n.startswith("test_") and "_Muon_" in n)


def run_test(cls, name):
    """(outcome, detail): "passed" / "failed" / "skipped", and the error's last line (or the skip's reason)."""
    result = unittest.TestResult()
    cls(name).run(result)
    for _, text in result.errors + result.failures:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return "failed", (lines[-1] if lines else text), text
    if result.skipped:
        return "skipped", result.skipped[0][1], ""
    if result.expectedFailures or result.unexpectedSuccesses:
        return "failed", "an expected-failure decorator on the upstream test", ""
    return "passed", "", ""


def main():
    torch.set_num_threads(1)
    problem = upstream_problem()
    if problem:
        sys.exit(problem)
    sys.path.insert(0, ROOT)
    import muon_tools

    # DTensorMuon's one-rank Gloo world, made as the suite's is (tests/conftest.py, single_process_group)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{muon_tools.free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    columns = {
        "torch.optim.Muon": load(torch.optim.Muon, "torch"),
        "DTensorMuon": load(dtensor_muon_class(), "dtensor"),
        "DTensorMuon, no Tensor lr": load(dtensor_muon_class(), "dtensor_no_tensor_lr", (TENSOR_LR,)),
    }
    names = muon_test_names(columns["torch.optim.Muon"])
    sha = upstream_sha256()
    which = "README.md's copy" if sha == UPSTREAM_SHA256 else "NOT README.md's copy: its lists may differ"
    print(f"{UPSTREAM} (sha256 {sha}: {which}), torch {torch.__version__}: {len(names)} Muon tests on CPU\n")
    width = max(len(n) for n in names)
    print(f"{'test':<{width}}  " + "  ".join(f"{c:<26}" for c in columns) + "  DTensorMuon's error")
    totals = {c: 0 for c in columns}
    for name in names:
        results = {c: run_test(cls, name) for c, cls in columns.items()}
        for c, (outcome, _, _) in results.items():
            totals[c] += outcome == "passed"
        row = "  ".join(f"{results[c][0]:<26}" for c in columns)
        print(f"{name:<{width}}  {row}  {results['DTensorMuon'][1][:160]}")
    print(f"\n{'passed':<{width}}  " + "  ".join(f"{totals[c]:<26}" for c in columns))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
