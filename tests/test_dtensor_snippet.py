"""The "Use it in your FSDP2 x TP training loop" snippet of notes/10-dtensor.md (the one page users find: the
README links to it), extracted and run as written under torchrun on 4 Gloo CPU ranks; and help(DTensorMuon)
documents every argument."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

import distributed_muon_dtensor as dd  # noqa: E402

MARKER = "<!-- dtensor-snippet: tests/test_dtensor_snippet.py runs this block -->"


PAGE = "notes/10-dtensor.md"
ANCHOR = "use-it-in-your-fsdp2--tp-training-loop"  # the heading the snippet sits under


def snippet():
    text = open(os.path.join(ROOT, PAGE)).read()
    assert text.count(MARKER) == 1
    heading, block = text.split(MARKER, 1)
    assert heading.rstrip().rsplit("\n## ", 1)[1].startswith("Use it in your FSDP2 × TP training loop")
    return re.match(r"\s*```python\n(.*?)```", block, re.S).group(1)


def test_the_readme_links_to_the_one_page_with_the_snippet():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"]({PAGE}#{ANCHOR})" in readme
    assert MARKER not in readme and "dcp.save(" not in readme  # one copy, on one page


def test_the_snippet_runs_as_written_under_torchrun(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(snippet())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = dict(re.findall(r"rank (\d): loss ([\d.]+), owners", proc.stdout))
    assert sorted(losses) == ["0", "1", "2", "3"]
    assert losses["0"] == losses["1"] and losses["2"] == losses["3"]  # the TP ranks of a dp row: one loss
    assert "{'up.weight': 0, 'down.weight': 0}" in proc.stdout  # the snippet's assign: the lowest holder
    assert (tmp_path / "checkpoint" / ".metadata").is_file()
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr


@pytest.mark.parametrize("argument", ["params", "options", "expert_stacks", "distributed_config", "batched_ns", "group",
                                      "row_layouts", "ns_blocks", "tp_newton_schulz", "qk_clip_tau"])
def test_help_documents_every_argument(argument):
    import inspect

    assert list(inspect.signature(dd.DTensorMuon.__init__).parameters)[1:] == [
        "params", "expert_stacks", "distributed_config", "batched_ns", "group", "row_layouts", "ns_blocks",
        "tp_newton_schulz", "qk_clip_tau", "options"]  # options: every keyword of torch.optim.Muon and AdamW
    assert re.search(rf"(^|[\s,]){argument}( \(keywords\))?[:,]", dd.DTensorMuon.__init__.__doc__, re.M), argument
    assert "p.grad is the TOTAL gradient" in dd.DTensorMuon.__doc__
    assert "assign: f(ns_flops, holders, world)" in dd.DistributedConfig.__doc__
