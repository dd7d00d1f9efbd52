"""examples/train_gpt_dtensor.py: the GPT of examples/ trained with fully_shard x parallelize_module and
DTensorMuon on the standard library's text, checked against one process of torch.optim.Muon + AdamW as
dtensor_demo.verify_training checks (its bounds: the replay of the ranks' own gradients
bit for bit at every step; gradients and losses within GRAD_RTOL / STEP_LOSS_RTOL, fp32 sums in another order;
free-running losses within TRAINED_LOSS_RTOL); saved on one mesh with torch's checkpoint recipe and resumed on
another, the loss curve continuing; Ctrl-C clean; bad flags refused."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from conftest import ROOT
from test_interrupts import assert_ctrl_c_stops_every_rank

sys.path.insert(0, os.path.join(ROOT, "examples"))
import train_gpt_dtensor as tgd  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "train_gpt_dtensor.py")
SMALL = dict(batch=8, context=32, d_model=32, layers=2, heads=4, log_every=2, val_windows=8, progress=False)


@pytest.fixture(scope="module")
def trainings(tmp_path_factory):
    """One spawn of 4 ranks: 2x2 for 4 steps (kept for --verify's checks), saving after step 2; the same run
    resumed from that checkpoint on 4x1 and on 1x4 (steps 3 and 4)."""
    folder = str(tmp_path_factory.mktemp("gpt_dcp") / "after_step_2")
    base = tgd.Config(dp=2, tp=2, steps=4, keep=True, **SMALL)
    configs = [replace(base, save=folder, save_step=2)] + [
        replace(base, dp=dp, tp=tp, resume=folder, resume_step=2) for dp, tp in ((4, 1), (1, 4))]
    return configs, tgd.train_many(configs, world=4)


def test_fsdp2_tp_training_replays_bit_for_bit_and_matches_one_process(trainings):
    configs, results = trainings
    out = tgd.verify(configs[0], results[0])
    assert out["replay_differs"] == [] and out["replica_max_diff"] == 0
    assert out["grad_max_rel_diff"] <= out["bounds"]["grad"] == 2.0**-12
    assert out["step_loss_max_rel_diff"] <= out["bounds"]["step_loss"] == 2.0**-16
    assert out["trained_loss_max_rel_diff"] <= out["bounds"]["trained_loss"] and out["passed"]
    # it trained, on real text: the loss fell, and the Muon matrices are TP- and FSDP2-sharded DTensors
    losses = [r["losses"] for r in results[0] if r["rank"] == 0][0]
    assert losses[-1] < losses[0] - 0.5, losses
    assert results[0][0]["placements"]["blocks.0.mlp.fc.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert results[0][0]["placements"]["blocks.0.attn.proj.weight"] == "(Shard(dim=0), Shard(dim=1))"


@pytest.mark.parametrize("index", [1, 2])
def test_saved_on_2x2_resumed_on_another_mesh_continues_the_loss_curve(trainings, index):
    """The resumed run starts from the saved weights bit for bit (assembled from every rank, against the
    uninterrupted run's weights before step 3), and its losses of steps 3 and 4 continue the uninterrupted
    curve within TRAINED_LOSS_RTOL (another mesh sums in another order: not bit for bit)."""
    configs, results = trainings
    whole, resumed = results[0], results[index]
    shapes = {n: tuple(p.shape) for n, p in tgd.plain_gpt(configs[0]).named_parameters()}
    before_3 = lambda ranks, s: tgd.demo.assemble([dict(r, params=r["weights"][s]) for r in ranks], shapes)
    saved, loaded = before_3(whole, 2), before_3(resumed, 0)
    assert all(torch.equal(saved[n], loaded[n]) for n in shapes)
    assert all(r["first"] == 3 and len(r["losses"]) == 2 for r in resumed)
    cfg = configs[index]
    mean = lambda ranks, dp, tp: [sum(r["losses"][s] for r in ranks if r["rank"] % tp == 0) / dp for s in (-2, -1)]
    continued, uninterrupted = mean(resumed, cfg.dp, cfg.tp), mean(whole, 2, 2)
    for a, b in zip(continued, uninterrupted):
        assert abs(a - b) / b <= tgd.demo.TRAINED_LOSS_RTOL, (continued, uninterrupted)


def test_command_line_trains_prints_losses_and_verifies(tmp_path):
    argv = ["--dp", "2", "--tp", "2", "--steps", "4", "--batch", "8", "--context", "32", "--d-model", "32",
            "--layers", "2", "--log-every", "2", "--verify"]
    proc = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"] and "train" in lines[0] and "val" in lines[0]
    assert "every rank bit-identical at every step" in proc.stdout
    assert proc.stdout.rstrip().endswith("Result: PASS") and proc.stderr == ""


@pytest.mark.parametrize("argv,message", [
    (["--dp", "3", "--tp", "2"], "DP 3 does not divide --batch 16"),
    (["--tp", "3", "--dp", "1"], "TP 3 does not divide --heads 4"),
    (["--resume", "/nonexistent"], "--resume /nonexistent: no torch.distributed.checkpoint there"),
    (["--save", "x", "--save-step", "0"], "--save-step must be in [1, --steps 40] (got 0)"),
    (["--lr", "-1"], "--lr must be >= 0"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    assert tgd.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_ctrl_c_stops_every_rank_and_leaves_nothing(tmp_path):
    assert "Result:" not in assert_ctrl_c_stops_every_rank(tmp_path, "--dp", "2", "--tp", "2", "--steps", "2000",
                                                           script=SCRIPT)
