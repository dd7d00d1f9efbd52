"""examples/: the GPT trained under DP x TP against the same GPT trained in one process by
torch.optim.Muon + torch.optim.AdamW, for every strategy and the AdamW baseline, on grids
1x1, 2x1, 1x2 and 2x2; the command line's errors, progress lines, bytes and traces.

The tolerance policy is train_gpt.py's (section 3): bit for bit wherever the order of every
fp32 sum is the one process's (TP = 1, DP <= 2), and the replay of the ranks' own gradients
through torch's optimizers is bit for bit on every grid here (DP <= 2); with TP = 2 each
step's loss and gradients are held to the bounds of a reordered fp32 sum."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, dm, mt
from test_interrupts import assert_ctrl_c_stops_every_rank

EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import gpt  # noqa: E402
import train_gpt as tg  # noqa: E402

TRAIN = os.path.join(EXAMPLES, "train_gpt.py")
# A GPT small enough for a test, with every kind of parameter: 2 layers, 2 heads (TP = 2 keeps one each).
SMALL = dict(d_model=32, layers=2, heads=2, context=32, batch=8, val_windows=4, log_every=1000, timeout_s=60)
SMALL_FLAGS = ["--d-model", "32", "--layers", "2", "--heads", "2", "--context", "32", "--batch", "8",
               "--val-windows", "4"]
STEPS = 3
KINDS = [dict(strategy=s) for s in dm.STRATEGIES] + [dict(optimizer="adamw", strategy="gather")]
GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def trained():
    """{(dp, tp): [(config, results of every rank)] for every KIND}: one spawn per grid."""
    return {(dp, tp): tg.train_many([tg.TrainConfig(dp=dp, tp=tp, steps=STEPS, keep=True, **SMALL, **kind)
                                     for kind in KINDS]) for dp, tp in GRIDS}


@pytest.mark.parametrize("dp,tp", GRIDS)
def test_every_strategy_trains_as_one_process_does(trained, dp, tp):
    for cfg, results in trained[dp, tp]:
        checks = tg.verify(cfg, results)
        what = f"{tg.run_kind(cfg)} on {dp}x{tp}"
        assert checks["passed"], what
        # DP <= 2 everywhere here: the optimizer is exact, given the ranks' gradients
        assert all(c["identical"] for c in checks["replay"]), what
        assert checks["replica_max_diff"] == 0, what
        if tp == 1:  # the same sums in the same order as one process: every bit the same
            assert checks["exact"] and all(c["identical"] for c in checks["trained"]), what
            assert checks["grad_max_rel_diff"] == checks["step_loss_max_rel_diff"] == 0, what
            assert checks["trained_loss_max_rel_diff"] == 0, what
        else:  # TP reorders fp32 sums: not bit for bit, but within the bounds, and not by chance
            assert not checks["exact"], what
            assert 0 < checks["grad_max_rel_diff"] <= tg.GRAD_RTOL, what
            assert checks["step_loss_max_rel_diff"] <= tg.STEP_LOSS_RTOL, what
            assert checks["trained_loss_max_rel_diff"] <= tg.TRAINED_LOSS_RTOL, what


def test_the_losses_fall_and_muon_moves_every_matrix(trained):
    for cfg, results in trained[2, 2]:
        losses = tg.summarize(cfg, results)["losses"]
        assert losses[-1] < losses[0] - 0.2, (tg.run_kind(cfg), losses)  # from about ln 256 = 5.5
    cfg, results = trained[2, 2][0]
    start = gpt.initial_weights(cfg.gpt())
    final = tg.full_tensors(cfg, lambda t: results[t]["params"], tg.param_specs(cfg))
    assert all(not torch.equal(final[n], start[n]) for n in gpt.muon_params(gpt.GPT(cfg.gpt())))


def test_the_checks_catch_a_wrong_weight_and_a_wrong_gradient(trained):
    cfg, results = trained[2, 2][1]
    name = "blocks.0.mlp.fc.weight"
    broken = copy.deepcopy(results)
    broken[3]["params"][name].view(-1)[0] += 1e-6  # one entry of one rank's piece, off by a few ulps
    assert not tg.verify(cfg, broken)["passed"]
    broken = copy.deepcopy(results)
    broken[1]["grads"][0][name].mul_(0.5)  # as if f's backward had lost half the sum
    checks = tg.verify(cfg, broken)
    assert not checks["passed"] and checks["grad_max_rel_diff"] > tg.GRAD_RTOL


def test_bytes_per_step_are_what_f_g_and_zero1_move(trained):
    """A ring all-reduce of n fp32 elements over 2 ranks sends 2 * (2 - 1) / 2 * n * 4 bytes."""
    cfg, results = trained[2, 2][3]  # the AdamW baseline: f and g, then ZeRO-1's two collectives
    table = tg.summarize(cfg, results)["bytes_per_step"]
    activation = cfg.batch // cfg.dp * cfg.context * cfg.d_model  # one micro-batch of the residual stream
    per_layer = 2  # attention-out and MLP-out each end with g; QKV and MLP-in each start with f
    assert max(table["TP all-reduce (forward)"]["sent"]) == cfg.layers * per_layer * activation * 4
    assert max(table["TP all-reduce (backward)"]["sent"]) == cfg.layers * per_layer * activation * 4
    local = sum(p.numel() for p in results[0]["params"].values())  # one TP rank's pieces
    bucketed = sum(t["sent"][0] for p, t in table.items() if p in ("grad reduce-scatter", "param all-gather"))
    assert local * 4 <= bucketed < (local + 2 * 8 * 2) * 4  # each (DP - 1) / DP of a padded bucket


def test_the_command_line_trains_prints_progress_and_writes_traces(tmp_path):
    out, traces = tmp_path / "run.json", tmp_path / "traces"
    proc = subprocess.run([sys.executable, TRAIN, "--dp", "2", "--tp", "2", "--steps", "6", "--log-every", "3",
                           *SMALL_FLAGS, "--profile", str(traces), "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["3/6", "6/6"]
    assert all("train" in line and "val" in line and "tokens/s" in line and "ms/step" in line for line in progress)
    results = json.loads(out.read_text())
    assert len(results["losses"]) == 6 and [s for s, _ in results["val"]] == [3, 6]
    assert sorted(os.listdir(traces)) == [f"rank{r}.json" for r in range(4)]
    for split in results["time_split_ms"]:
        for label in ("forward", "backward", "optimizer step", "grad reduce-scatter", "gather at owner",
                      "newton-schulz", "param all-gather", "TP all-reduce (forward)"):
            assert split[label] > 0, label
        assert split["newton-schulz"] < split["optimizer step"]


@pytest.mark.parametrize("argv,message", [
    (["--optimizer", "adamw", "--steps", "0"], "error: --steps must be >= 1 (got 0)"),  # adamw takes the default
    (["--dp", "3"], "error: DP 3 does not divide --batch 16: every DP rank takes the same share"),
    (["--tp", "3"], "error: TP 3 does not divide --heads 4: each TP rank keeps whole heads"),
    (["--optimizer", "adamw", "--strategy", "comm-free"],
     "error: --optimizer adamw takes no --strategy (got comm-free): strategies are Muon's"),
    (["--lr", "-1"], "error: --lr must be >= 0 and finite (got -1.0)"),
    (["--steps", "4", "--profile", "x"], "error: --profile traces steps 4 to 6: --steps must be >= 6 (got 4)"),
    (["--json", "/nonexistent/run.json"], "error: --json /nonexistent/run.json: the folder /nonexistent does not exist"),
])
def test_bad_flags_are_refused_before_any_rank_starts(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(mt, "spawn_ranks", lambda *a: pytest.fail("a rank was started"))
    assert tg.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err


def test_ctrl_c_ends_the_run_as_the_lesson_does(tmp_path):
    """The lesson's launcher runs the ranks (its failures are tested in test_cli and test_interrupts)."""
    assert_ctrl_c_stops_every_rank(tmp_path, "--dp", "2", "--tp", "2", "--steps", "100000", *SMALL_FLAGS, script=TRAIN)


def test_under_torchrun_the_same_training_runs_and_verifies(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           TRAIN, "--backend", "gloo", "--device", "cpu", "--dp", "1", "--tp", "2", "--steps", "3",
                           *SMALL_FLAGS, "--verify", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["checks"]["passed"] and results["backend"] == "gloo"
    assert all(c["identical"] for c in results["checks"]["replay"])
    assert "Result: PASS" in proc.stdout
