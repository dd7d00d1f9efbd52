"""The notebooks: the read-along's sections are the script's, each pair matches its jupytext twin, both are
committed with the outputs of today's code (tools/make_notebook.py, which runs them top to bottom headless, as
`jupyter nbconvert --execute` does, in a folder holding only what they need), and those saved outputs show what
each section computed and every run checked against torch."""

import os
import re
import sys

import jupytext
import nbformat
import pytest

from conftest import ROOT, SCRIPT
from test_benchmarks import compare_summary
from test_cli import check_default_run_printed

sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_notebook  # noqa: E402

NOTEBOOK = os.path.join(ROOT, "distributed_muon_cpu.ipynb")  # the lesson, section by section
RUNS_NOTEBOOK = os.path.join(ROOT, "distributed_muon_runs.ipynb")  # grids, strategies, the GPT
PAIRS = {NOTEBOOK: os.path.join(ROOT, "distributed_muon_cpu.nb.py"),
         RUNS_NOTEBOOK: os.path.join(ROOT, "distributed_muon_runs.nb.py")}
OWNERS = os.path.join(ROOT, "distmuon/owners.py")
LARGE_RUNS = os.path.join(ROOT, "distmuon/large_runs.py")


def cells(nb):
    return [(c.cell_type, c.source) for c in nb.cells]


def headings(path):
    nb = nbformat.read(path, as_version=4)
    return [m for c in nb.cells if c.cell_type == "markdown" for m in re.findall(r"^## (\d+)\. (.+)$", c.source, flags=re.M)]


@pytest.mark.parametrize("notebook", list(PAIRS))
def test_notebook_and_its_py_pair_are_in_sync(notebook):
    # Edit the .nb.py, then: jupytext --sync distributed_muon_cpu.nb.py (or distributed_muon_runs.nb.py)
    assert cells(nbformat.read(notebook, as_version=4)) == cells(jupytext.read(PAIRS[notebook]))


@pytest.mark.parametrize("notebook", list(PAIRS), ids=os.path.basename)
def test_each_notebook_is_committed_with_the_outputs_of_todays_code(tmp_path, notebook):
    """Every code cell has its output, none an error, and the hash tools/make_notebook.py recorded is that of
    today's cells and code; a cell changed since, and the check fails."""
    name = os.path.basename(notebook)
    assert make_notebook.check(name) is None
    nb = nbformat.read(notebook, as_version=4)
    nb.cells[-1].source += " "
    nbformat.write(nb, tmp_path / "edited.ipynb")
    assert "other cells or other code" in make_notebook.check(name, tmp_path / "edited.ipynb")


def test_the_hash_reads_every_program_the_runs_notebook_runs():
    """A program the runs notebook starts, left out of what make_notebook hashes, would let its saved outputs
    go stale unnoticed."""
    with open(PAIRS[RUNS_NOTEBOOK]) as f:
        programs = set(re.findall(r'muon_tools\.run_program\("([^"]+)"', f.read()))
    assert programs == {"distributed_muon_cpu.py", "benchmarks/compare.py", "examples/train_gpt.py",
                        "examples/train_gpt_moe.py"}
    assert programs <= set(make_notebook.NOTEBOOKS[os.path.basename(RUNS_NOTEBOOK)][1])


def test_notebook_sections_are_the_scripts_in_order():
    script = []
    for path in (SCRIPT, OWNERS, LARGE_RUNS):  # the lesson's sections 1-6, owners' 7, large runs' 8
        with open(path) as f:
            script += re.findall(r"^# (\d+)\. (.+)$", f.read(), flags=re.M)
    assert [int(n) for n, _ in script] == list(range(1, 9))
    assert headings(NOTEBOOK) == [("0", "Setup")] + script  # 0 sets up, 1-8 follow the script
    assert [int(n) for n, _ in headings(RUNS_NOTEBOOK)] == list(range(5))


def test_each_section_shows_the_scripts_own_source_before_it_runs_it():
    """Sections 1-8 each print the source of what they run (muon_tools.show_source), not a paraphrase of it."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    shown, section = {}, None
    for c in nb.cells:
        if c.cell_type == "markdown" and re.match(r"^## (\d+)\.", c.source):
            section = int(re.match(r"^## (\d+)\.", c.source).group(1))
        elif c.cell_type == "code" and "muon_tools.show_source(" in c.source:
            shown.setdefault(section, []).append(c.source)
    assert sorted(shown) == list(range(1, 9))
    assert any("distributed_muon_cpu.gather_newton_schulz_shard" in src for src in shown[4])  # the flow itself
    assert any("distributed_muon_cpu.run_rank" in src for src in shown[6])


def printed(path):
    """A notebook's outputs and their printed text."""
    nb = nbformat.read(path, as_version=4)
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    return outputs, "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


def check_large_runs(text):
    """Section 8's four additions, each checked on the numbers it printed."""
    spread = dict(re.findall(r"^(jordan|polar_express) .*singular values after 5 iterations ([\d.]+) to", text, re.M))
    assert float(spread["polar_express"]) > float(spread["jordan"]) + 0.1  # closer to 1 in the same 5 iterations
    for name in "qkv":  # each block is newton_schulz of its rows alone, and not the whole matrix's rows
        line = re.search(rf"^{name}: rows .*torch.equal with its block alone: (\w+); max \|whole - blocks\| ([\d.]+)$",
                         text, re.M)
        assert line.group(1) == "True" and float(line.group(2)) > 0.05
    heads = re.findall(r"^head (\d): max logit +([\d.]+), multiplier ([\d.]+) -> +([\d.]+)$", text, re.M)
    assert len(heads) == 4
    for _, before, multiplier, after in heads:  # tau = 3: a clipped head's largest logit becomes tau
        before, multiplier, after = float(before), float(multiplier), float(after)
        assert (multiplier < 1 and after == 3.0) if before > 3.0 else (multiplier == 1 and after == before)
    assert sum(float(m) < 1 for _, _, m, _ in heads) == 2 and sum(float(m) == 1 for _, _, m, _ in heads) == 2
    gram = re.search(r"8 matrices of 64x1024: torch.equal on (\d) of 8; max \|d\| (\d+) bf16 steps", text)
    assert int(gram.group(1)) < 8 and 0 < int(gram.group(2)) <= 16  # not torch's bits, within a few bf16 steps


def test_the_read_alongs_saved_outputs_show_each_section_at_work():
    """The read-along as committed (made by tools/make_notebook.py from today's code:
    test_each_notebook_is_committed_with_the_outputs_of_todays_code); its default run, run as a command, is
    test_cli.py's too."""
    outputs, text = printed(NOTEBOOK)
    assert "torch.equal with torch's Newton-Schulz: True" in text  # section 1, in the kernel
    assert "def newton_schulz(matrix" in text and "# distributed_muon_cpu.py, lines " in text  # its own source
    assert "momentum on two halves equals momentum on the whole: True" in text
    assert "rank 5: DP rank 2 of DP group (1, 3, 5, 7), TP rank 1 of TP group (4, 5)" in text  # section 2
    assert "bucket (0, 0)" in text and "(padding)" in text  # section 3: the planned layout
    # section 4: gather_newton_schulz_shard itself, on 8 thread ranks with real Gloo groups
    assert "def gather_newton_schulz_shard(" in text
    table = re.findall(r"^ +(\d) +\(8448,\) +49\.5 KiB +([\d.]+) KiB ", text, re.M)
    assert [int(r) for r, _ in table] == list(range(8))  # every rank: its shard in, the DP gather's 3 x 16.5 KiB
    assert [float(t) for _, t in table] == [48.0] * 4 + [64.0] * 2 + [16.0] * 2  # what its TP gathers brought
    for name, split in (("layers.0.attn.qkv.weight", "split on dim 0, 384x128"),
                        ("layers.0.attn.proj.weight", "split on dim 1, 128x128"), ("layers.0.router.weight", "not split, 8x128")):
        assert (f"{name} ({split}): every rank's part put together, torch.equal with torch's Newton-Schulz on the "
                "whole matrix: True") in text
    assert "phases of one step, in order: grad presence -> grad reduce-scatter -> DP gather" in text  # section 5
    assert "def run_rank(cfg, specs, build_optimizer, torch_reference, after_step=None):" in text  # section 6: its source, then
    default_run = text[text.index("Distributed Muon: 8 CPU ranks"):]  # the default run, --explain
    check_default_run_printed(default_run[:default_run.index("Result: PASS") + 60])
    assert text.count("Result: PASS") == 1
    # the virtual buffer (section 3) and the gather flow (section 4) drawn by tools/figures.py; checks, accounting
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4
    assert "max / mean = 1.00" in text and "def assign_owners(" in text  # section 7
    check_large_runs(text)  # section 8
    assert "usage:" not in text and "bound_ratio" not in text  # the tooling's sections left the read-along


def test_the_runs_notebooks_saved_outputs_show_every_run_checked_against_torch():
    """The runs notebook as committed (made by tools/make_notebook.py, which ran it top to bottom headless; its
    outputs are today's code's: test_each_notebook_is_committed_with_the_outputs_of_todays_code)."""
    outputs, text = printed(RUNS_NOTEBOOK)
    assert text.count("Result: PASS: 26/26 parameters bit-identical to torch") == 4  # every grid of 8 ranks
    assert text.count("Result: PASS") == 6  # and the GPT's --verify, and the MoE GPT's
    for label in ("gather", "owner", "comm-free", "AdamW ZeRO-1"):  # benchmarks/compare.py
        assert f"{label:<13} PASS: 26/26 parameters bit-identical to torch" in text
    compare_summary(text[text.index("Comparing strategies:"):])
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # grids, strategies, the GPT's loss, the MoE's
    assert text.count("step 20/20  train") == 1  # the GPT trained
    assert "experts per EP rank 2, 1" in text and "each orthogonalized once in the world" in text  # the MoE GPT
    assert "(6,144 decisions) against the one process's own at the ranks' weights: 6,144 identical" in text
    assert "replay:    torch's optimizers fed the ranks' summed gradients: 52/52 parameters identical" in text
