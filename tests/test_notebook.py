"""The notebook: runs top to bottom headless, and matches its jupytext pair."""

import os
import shutil
import subprocess
import sys

import jupytext
import nbformat

from conftest import ROOT

NOTEBOOK = os.path.join(ROOT, "distributed_muon_cpu.ipynb")
PAIR = os.path.join(ROOT, "distributed_muon_cpu.nb.py")


def cells(nb):
    return [(c.cell_type, c.source) for c in nb.cells]


def test_notebook_and_its_py_pair_are_in_sync():
    # Edit distributed_muon_cpu.nb.py, then: jupytext --sync distributed_muon_cpu.nb.py
    assert cells(nbformat.read(NOTEBOOK, as_version=4)) == cells(jupytext.read(PAIR))


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


def test_notebook_runs_top_to_bottom_as_the_readme_runs_it(tmp_path):
    """`jupyter nbconvert --to notebook --execute`, the README's command, in a folder holding only
    what a user's clone would: the notebook runs the script beside it."""
    for name in ("distributed_muon_cpu.py", "distributed_muon_cpu.ipynb", "requirements.txt"):
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    # `python -m jupyter` is the `jupyter` command of this very environment (a bare `jupyter` on
    # PATH could belong to another Python).
    proc = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                           "distributed_muon_cpu.ipynb", "--output", "executed.ipynb"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    nb = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "Result: PASS: 26/26 parameters bit-identical to torch" in text
    assert text.count("Result: PASS") == 5  # the 4x2 run and the four grids of the sweep
    for label in ("gather", "owner", "comm-free", "AdamW ZeRO-1"):  # the --compare run
        assert f"{label:<13} PASS: 26/26 parameters bit-identical to torch" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # checks, accounting, grids, strategies
