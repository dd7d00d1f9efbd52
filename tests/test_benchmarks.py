"""benchmarks/compare.py: every strategy and the AdamW ZeRO-1 baseline on one grid, each checked
against torch, in one table whose figures are the JSON's."""

import json
import os
import subprocess
import sys

import torch

from conftest import ROOT, SUITE_D_MODEL
import distributed_muon_cpu
from distmuon import large_runs, owners
from distmuon.dtensor import exchange
import muon_tools

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import compare  # noqa: E402
import scaling  # noqa: E402

COMPARE = os.path.join(ROOT, "benchmarks", "compare.py")


def compare_summary(stdout):
    """{label: its row of compare.py's summary table}, checking that every run passed against torch; the
    targets' lines. What the notebook of runs printed is checked with this too (test_notebook.py)."""
    lines = stdout.splitlines()
    summary = lines[next(i for i, line in enumerate(lines) if line.startswith("strategy ")):]
    rows = {}
    for kind in compare.COMPARED:
        label = compare.LABELS[kind]
        assert f"{label:<13} PASS" in stdout  # the verification line
        rows[label] = next(line for line in summary if line.startswith(label + " ")).split()
    targets = stdout[stdout.index("[8] Targets"):]
    assert "redundancy 1.00 for owner and comm-free: met (1.00, 1.00)" in targets
    assert "comm-free extra bytes over AdamW ZeRO-1: " in targets and "fp32 all-gather" in targets
    assert "NOT met" not in targets  # step times are figures, never verdicts: a shared 2-core machine would flip them
    return rows, targets


def test_compare_prints_one_table_of_the_jsons_figures(tmp_path):
    """What `benchmarks/compare.py --json` printed and wrote: one table whose figures are the JSON's, every run
    checked against torch (one layer of the suite's width: 5 matrices on 8 ranks, the cheapest run that moves every
    phase's bytes)."""
    path = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, COMPARE, "--steps", "2", "--layers", "1", "--d-model", str(SUITE_D_MODEL),
                           "--json", str(path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(path.read_text())
    rows, targets = compare_summary(proc.stdout)
    assert list(results["runs"]) == list(compare.COMPARED) and results["passed"]
    for kind, run in results["runs"].items():
        assert muon_tools.run_kind(muon_tools.RunConfig(**run["config"])) == kind and run["passed"]
        row = " ".join(rows[compare.LABELS[kind]])
        assert muon_tools.human_bytes(run["bytes_sent_all_ranks"]) in row  # the summary shows the JSON's numbers
        assert f"{run['timings']['step_ms_median']:.0f}" == row.split()[-1]
    for strategy in owners.strategies_where(lambda c: c.orthogonalizes_once):  # each matrix once, by its owner
        assert results["runs"][strategy]["ns_flops"]["redundancy"] == 1.0
    assert results["realistic_balance"]["max_over_mean"] <= 1.10
    owner, gather = (results["runs"][s]["timings"]["step_ms_median"] for s in ("owner", "gather"))
    assert f"owner / gather = {owner / gather:.2f}" in targets


def test_realistic_parameter_set_balances_within_ten_percent():
    b = compare.realistic_balance(8)
    assert b["matrices"] == 60 and b["max_over_mean"] <= 1.10


def test_bad_input_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, COMPARE, "--tp", "3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "error: TP 3 does not divide embed.weight dim 0" in proc.stderr


def test_scaling_without_ns_replaces_newton_schulz_in_torch_and_here_alike(single_process_group, monkeypatch):
    """--without-ns times the rest of the step: both sides must lose Newton-Schulz, and only it."""
    import torch.optim._muon as torch_muon

    def step_both(params, grads):
        """One step of torch's optimizers and of the owner strategy, each on its own copy: (theirs, ours)."""
        theirs = {n: p.clone() for n, p in params.items()}
        reference = scaling.torch_reference(theirs)
        ours = {n: p.clone() for n, p in params.items()}
        optimizer = scaling.build("owner", ours, single_process_group)
        for copy in (theirs, ours):
            for n, p in copy.items():
                p.grad = grads[n]
        for o in reference + [optimizer]:
            o.step()
        return theirs, ours

    params, grads = scaling.parameters(16, 1)
    with_ns, _ = step_both(params, grads)
    monkeypatch.setattr(torch_muon, scaling.TORCH_NEWTON_SCHULZ, getattr(torch_muon, scaling.TORCH_NEWTON_SCHULZ))
    monkeypatch.setattr(distributed_muon_cpu, "newton_schulz",
                        distributed_muon_cpu.newton_schulz)  # all five restored after the test
    monkeypatch.setattr(owners, "newton_schulz", owners.newton_schulz)
    monkeypatch.setattr(large_runs, "newton_schulz", large_runs.newton_schulz)
    monkeypatch.setattr(exchange, "newton_schulz_overwriting", exchange.newton_schulz_overwriting)
    scaling.without_newton_schulz()
    theirs, ours = step_both(params, grads)
    assert all(torch.equal(theirs[n], ours[n]) for n in params)  # the same work on both sides
    changed = [n for n in params if not torch.equal(theirs[n], with_ns[n])]
    assert changed == [n for n in params if params[n].ndim == 2]  # Newton-Schulz gone, AdamW untouched


def test_two_ranks_splits_every_phase_and_each_rank_orthogonalizes_half(capsys):
    """benchmarks/two_ranks.py on 2 ranks, this commit against itself (--before): every variant timed twice,
    each traced step split into the phases of its strategy, and the two ranks' Newton-Schulz FLOPs adding up
    to torch's (each matrix orthogonalized once, on one rank)."""
    import two_ranks

    assert two_ranks.main(["--d", "64", "--layers", "2", "--rounds", "1", "--before", ROOT]) == 0
    out = capsys.readouterr().out
    total = float(out.split(" GFLOP;")[0].rsplit(", ", 1)[1])
    assert out.count("this commit's / before: ") == len(two_ranks.VARIANTS)
    tables = out.split("\n\n")[1:]
    assert len(tables) == 2 and "(before)" in tables[1].splitlines()[0]  # this commit's, then the one before
    for table in tables:
        rows = {" ".join(line.split()[:-8]): line.split()[-8:] for line in table.splitlines()[2:]}
        flops = [float(x) for x in rows["NS GFLOP"]]
        for i in range(0, 8, 2):  # each variant: rank 0 and rank 1, each about half
            assert abs(flops[i] + flops[i + 1] - total) <= 0.01 * total and min(flops[i:i + 2]) > 0.3 * total
        for phase in muon_tools.PHASES_OF["owner"] + muon_tools.PHASES_OF["comm-free"] + ("newton-schulz", "state update"):
            assert phase in rows, phase
        assert all(float(x) > 0 for x in rows["step (traced)"])


def test_heap_stress_runs_the_command_of_the_checkout_it_is_given(tmp_path):
    """--checkout DIR runs DIR's examples/train_gpt_dtensor.py (here one that fails at once, saying where it is),
    counts its failures and names no commit where DIR is not a git checkout."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "train_gpt_dtensor.py").write_text(
        "import sys\nprint('the other checkout got', sys.argv[1:], file=sys.stderr)\nsys.exit(3)\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "heap_stress.py"), "--runs", "2",
                           "--busy", "0", "--checkout", str(tmp_path), "--", "--steps", "1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == ("2 runs of examples/train_gpt_dtensor.py --steps 1 at commit (not a git checkout) beside "
                        f"0 busy loops on {os.cpu_count()} cores")
    for line in lines[1:3]:
        assert line.split()[2:4] == ["exit", "3"] and line.endswith("the other checkout got ['--steps', '1']"), line
    assert lines[3].startswith("Failed: 2 of 2; of which heap corruption or SIGABRT: 0 ")


def test_gloo_collectives_times_every_collective_on_two_ranks():
    """Its table has every collective's time at each size, each a positive number (a name that shadowed the
    collectives module left its first column failing on every rank)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gloo_collectives.py"), "--ranks", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().endswith(tuple("0123456789"))
            and ("KiB" in line or "MiB" in line)]
    assert len(rows) == 3 and all(len(r) == 9 and all(float(x) > 0 for x in r[4:]) for r in rows), proc.stdout
