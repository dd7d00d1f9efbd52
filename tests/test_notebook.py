"""The notebook: its sections are the script's, it matches its jupytext pair, and it runs top to
bottom headless, the way the README tells a user to run it."""

import json
import os
import re
import shutil
import subprocess
import sys

import jupytext
import nbformat

from conftest import ROOT, SCRIPT
from test_benchmarks import check_compare_output
from test_cli import check_default_run

NOTEBOOK = os.path.join(ROOT, "distributed_muon_cpu.ipynb")
PAIR = os.path.join(ROOT, "distributed_muon_cpu.nb.py")
TOOLS = os.path.join(ROOT, "muon_tools.py")


def cells(nb):
    return [(c.cell_type, c.source) for c in nb.cells]


def test_notebook_and_its_py_pair_are_in_sync():
    # Edit distributed_muon_cpu.nb.py, then: jupytext --sync distributed_muon_cpu.nb.py
    assert cells(nbformat.read(NOTEBOOK, as_version=4)) == cells(jupytext.read(PAIR))


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


def test_notebook_sections_are_the_scripts_in_order():
    script = []
    for path in (SCRIPT, TOOLS):  # the lesson's sections 1-7, then its tooling's 8 and 9
        with open(path) as f:
            script += re.findall(r"^# (\d)\. (.+)$", f.read(), flags=re.M)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    headings = [m for c in nb.cells if c.cell_type == "markdown"
                for m in re.findall(r"^## (\d+)\. (.+)$", c.source, flags=re.M)]
    assert [int(n) for n, _ in script] == list(range(1, 10))
    # 0 sets up, 1-9 follow the script, 10 trains examples/'s GPT with it
    assert headings == [("0", "Setup")] + script + [("10", "Train for real: a tensor-parallel GPT on real text")]


def test_notebook_runs_top_to_bottom_as_the_readme_runs_it(tmp_path):
    """`jupyter nbconvert --to notebook --execute`, the README's command, in a folder holding only
    what a user's clone has that the notebook needs."""
    for name in ("distributed_muon_cpu.py", "muon_tools.py", "distributed_muon_cpu.ipynb", "requirements.txt",
                 os.path.join("benchmarks", "compare.py"), os.path.join("examples", "gpt.py"),
                 os.path.join("examples", "stdlib_text.py"), os.path.join("examples", "train_gpt.py")):
        os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
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
    assert "torch.equal with torch's Newton-Schulz: True" in text  # section 1, in the kernel
    assert "momentum on two halves equals momentum on the whole: True" in text
    assert "rank 5: DP rank 2 of DP group (1, 3, 5, 7), TP rank 1 of TP group (4, 5)" in text  # section 2
    assert "bucket (0, 0)" in text and "(padding)" in text  # section 4: the planned layout
    assert "def gather_newton_schulz_shard(" in text  # section 5: the flow's own source
    assert "max / mean = 1.00" in text and "class OwnerMuon(DistributedMuon):" in text  # section 6
    assert "Result: PASS: 26/26 parameters bit-identical to torch" in text
    default_run = text[text.index("Distributed Muon: 8 CPU ranks"):]  # section 7: the default run, --explain
    with open(tmp_path / "runs" / "notebook_4x2.json") as f:
        check_default_run(default_run[:default_run.index("Result: PASS") + 60], json.load(f))
    assert text.count("Result: PASS") == 5  # the 4x2 run, the other three grids of the sweep, the GPT's --verify
    for label in ("gather", "owner", "comm-free", "AdamW ZeRO-1"):  # benchmarks/compare.py
        assert f"{label:<13} PASS: 26/26 parameters bit-identical to torch" in text
    with open(tmp_path / "runs" / "notebook_compare.json") as f:
        check_compare_output(text[text.index("Comparing strategies:"):], json.load(f))
    # checks, accounting, grids, strategies, the GPT's loss curves
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 5
    assert text.count("step 20/20  train") == 1  # section 10: the GPT trained
    assert "replay:    torch's optimizers fed the ranks' summed gradients: 52/52 parameters identical" in text
    assert "usage: distributed_muon_cpu.py" in text and "--strategy" in text  # section 9: the command line
