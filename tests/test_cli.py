"""The command line: bad input, a failing rank, and the default run as a user starts it."""

import json
import subprocess
import sys

import pytest

from conftest import SCRIPT
import distributed_muon_cpu
import muon_tools

BAD_INPUT = [
    (["--dp", "0"], "DP and TP must be >= 1 (got DP=0, TP=2)"),
    (["--tp", "0"], "DP and TP must be >= 1 (got DP=4, TP=0)"),
    (["--tp", "3"], "TP 3 does not divide embed.weight dim 0"),
    (["--dp", "1", "--tp", "256"], "DP 1 x TP 256 = 256 ranks is more than 64"),
    (["--dp", "16", "--tp", "8"], "DP 16 x TP 8 = 128 ranks is more than 64"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--bucket-size", "0"], "--bucket-size must be >= 1 and finite (got 0)"),
    (["--lr", "0"], "--lr must be > 0: with lr 0 no weight moves"),
    (["--lr", "-0.1"], "--lr must be >= 0 and finite (got -0.1)"),
    (["--lr", "nan"], "--lr must be >= 0 and finite"),
    (["--lr", "inf"], "--lr must be >= 0 and finite"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--weight-decay", "nan"], "--weight-decay must be >= 0"),
    (["--ns-steps", "0"], "--ns-steps must be >= 1"),
    (["--momentum", "1"], "--momentum must be in [0, 1)"),
    (["--momentum", "-0.5"], "--momentum must be in [0, 1)"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    (["--adjust-lr-fn", "spectral"], "--adjust-lr-fn must be None or one of original, match_rms_adamw"),
    (["--layers", "0"], "--layers must be in [1, 24]"),
    (["--d-model", "100"], "--d-model must be a positive multiple of the demo's 8 heads (got 100)"),
    (["--d-model", "1024", "--layers", "2"], "--d-model 1024 x --layers 2: 26,254,337 parameters, more than the "),
    (["--overlap"], "--overlap applies to --strategy owner or comm-free (got gather)"),
    (["--overlap", "-1", "--strategy", "owner"], "--overlap must be an integer >= 0 (got -1)"),
    (["--model", "lopsided", "--tp", "3"], "TP 3 does not divide huge.weight"),
    (["--model", "thin", "--tp", "8"], "TP 8 does not divide thin.0.60x6.weight dim 0"),
    (["--batched-ns"], "--batched-ns applies to --strategy owner or comm-free (got gather)"),
    (["--baseline", "--strategy", "owner"], "--baseline runs AdamW for every parameter: it takes no --strategy"),
    (["--timeout", "0"], "--timeout must be > 0 seconds"),
    (["--timeout", "nan"], "--timeout must be > 0 seconds and finite"),
    (["--json", "/nonexistent-folder/run.json"], "--json /nonexistent-folder/run.json: the folder /nonexistent-folder"),
    (["--json", "/"], "--json / is a directory"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert muon_tools.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {err[len('error: '):]}" and err.count("\n") == 1
    assert message in err


def test_tp_that_divides_some_but_not_all_parameters_names_the_first():
    specs = distributed_muon_cpu.transformer_specs()
    with pytest.raises(ValueError, match=r"TP 5 does not divide embed.weight dim 0 \(size 512"):
        muon_tools.check_tp_divides(specs, 5)
    specs = [distributed_muon_cpu.ParamSpec("a", (6, 4), 0, "muon"),
             distributed_muon_cpu.ParamSpec("b", (4, 6), 1, "muon"),
             distributed_muon_cpu.ParamSpec("c", (6, 5), 1, "muon")]
    with pytest.raises(ValueError, match=r"TP 2 does not divide c dim 1 \(size 5"):
        muon_tools.check_tp_divides(specs, 2)


def run_script(*argv, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=timeout)


def test_cli_bad_input_in_a_real_process():
    proc = run_script("--tp", "3")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert "TP 3 does not divide embed.weight" in proc.stderr


@pytest.mark.parametrize("flags", [[], ["--traceback"]])
def test_a_failing_rank_ends_the_run_with_one_line_naming_it(flags):
    # subprocess.run's timeout turns a hang into a test failure
    proc = run_script("--dp", "2", "--tp", "2", "--fail-rank", "3", *flags, timeout=90)
    assert proc.returncode == 1
    first, *rest = proc.stderr.splitlines()
    assert first.startswith("error: rank 3 failed: RuntimeError: injected failure on rank 3 at step 1 (--fail-rank)")
    if flags:  # the rank's own traceback, for whoever debugs it
        assert rest[0] == "Traceback (most recent call last):" and "in run_steps" in proc.stderr
    else:
        assert rest == []
    assert "Result:" not in proc.stdout


def test_the_launcher_names_the_rank_that_says_why_not_one_that_heard_of_it(tmp_path):
    """After a vote every rank raises at once, in any order: `python dtensor_demo.py --tp 3` (DP 4 x TP 3) had
    rank 11 say what was wrong and the 11 others that rank 11 refused; the launcher named whichever wrote first.
    Here the secondhand error is written first, as it was then."""
    said = "ValueError: rank 11: the gradient of layers.0.fc1.weight has shape (160, 40), the parameter (160, 40)"
    told = "ValueError: rank 11 refused the step (it raised why); nothing changed"
    for rank, when, error in [(0, 1.0, told), (11, 2.0, said), (5, 3.0, told)]:
        (tmp_path / f"rank{rank}.error").write_text(f"{when!r}\n{error}\nTraceback of rank {rank}\n")
    failure = muon_tools.culprit_failure([(0, 1), (11, 1), (5, 1)], str(tmp_path))
    assert str(failure) == f"rank 11 failed: {said} (then ranks 0, 5 failed too)"
    assert failure.traceback == "Traceback of rank 11\n"
    (tmp_path / "rank11.error").unlink()  # only secondhand errors: the first of it, as before
    assert str(muon_tools.culprit_failure([(0, 1), (5, 1)],
                                          str(tmp_path))) == f"rank 0 failed: {told} (then rank 5 failed too)"


def check_default_run_printed(out):
    """What the default run with --explain printed: the read-along notebook runs it too (test_notebook.py reads
    its saved outputs with this)."""
    assert "DP=4 x TP=2" in out
    assert "(padding)" in out and "bucket (0, 0)" in out  # --explain's map
    n = len(distributed_muon_cpu.transformer_specs())
    assert f"Result: PASS: {n}/{n} parameters bit-identical to torch" in out


def test_the_default_run_as_a_user_runs_it_passes_and_its_json_is_what_it_printed(tmp_path):
    """`python distributed_muon_cpu.py`, the README's command, with --explain and --json."""
    proc = run_script("--explain", "--json", str(tmp_path / "run.json"), timeout=240)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    out = proc.stdout
    check_default_run_printed(out)
    with open(tmp_path / "run.json") as f:
        results = json.load(f)
    n = len(distributed_muon_cpu.transformer_specs())
    assert results["passed"] and all(c["identical"] for c in results["checks"]) and len(results["checks"]) == n
    default = muon_tools.RunConfig()
    assert {k: results["config"][k] for k in ("dp", "tp", "steps", "d_model", "layers", "strategy")} == \
        dict(dp=4, tp=2, steps=default.steps, d_model=default.d_model, layers=default.layers, strategy="gather")
    assert set(results["bytes_per_step"]) == set(muon_tools.PHASES)
    assert len(results["ns_flops"]["per_rank"]) == 8 and len(results["ledgers"]) == 8
    assert len(results["timings"]["step_ms_slowest_rank"]) == results["config"]["steps"]
    for phase, row in results["bytes_per_step"].items():  # the printed table shows the JSON's numbers
        line = next(line for line in out.splitlines() if line.startswith(phase))
        assert muon_tools.human_bytes(max(row["sent"])) in line


def test_help():
    proc = run_script("--help")
    assert proc.returncode == 0
    for flag in ["--dp", "--tp", "--steps", "--seed", "--bucket-size", "--lr", "--momentum", "--weight-decay",
                 "--ns-steps", "--adjust-lr-fn", "--explain", "--json", "--strategy", "--baseline", "--model",
                 "--layers", "--d-model", "--overlap", "--batched-ns", "--timeout", "--traceback"]:
        assert flag in proc.stdout


def test_explain_lists_the_owners():
    """--explain prints from the plan, before any rank starts: the launcher's own call, without the ranks."""
    printed = []
    cfg = muon_tools.RunConfig(strategy="owner", dp=2, tp=1)
    muon_tools.print_header(cfg, muon_tools.plan_optimizer(cfg), "CPU", "Gloo", True, printed.append)
    out = "\n".join(printed)
    assert "[7] Owners: 10 matrices on 2 ranks" in out
    owns = [line for line in out.splitlines() if line.split()[:1] in (["0"], ["1"]) and "weight" in line]
    assert len(owns) == 2 and sum(line.count(".weight") for line in owns) == 10
