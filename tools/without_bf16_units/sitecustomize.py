"""Runs Python as on a CPU without bf16 matrix units, for measuring the suite's time there on any machine.

    PYTHONPATH=tools/without_bf16_units python -m pytest -q tests    # notes/measured/timings.md, seventh round

Python imports a sitecustomize module found on its path at start-up, so every interpreter the suite starts
(its commands, their forkservers, and the ranks forked from them) runs this. Once torch is imported it turns off
torch's use of oneDNN, which is where a bf16 matmul on the CPU runs fast (its rate with and without oneDNN:
notes/measured/timings.md, seventh round). float32 matmuls do not use oneDNN.
A process started with its own PYTHONPATH (not extended) escapes it and computes its bf16 matmuls with oneDNN:
its bits then differ from this process's.
"""

import importlib.abc
import importlib.machinery
import sys


class TorchWithoutOneDNN(importlib.abc.MetaPathFinder):
    """Finds torch as Python would, then turns oneDNN off right after torch's own import has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.backends.mkldnn.enabled = False

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, TorchWithoutOneDNN())
