"""examples/gpt_moe.py and examples/train_gpt_moe.py: a routed mixture-of-experts GPT (top-2 of softmax, 3-D expert
stacks, a shared expert, Switch Transformer's load-balance loss, dropless) under expert parallel x FSDP2 x TP on
Gloo ranks, trained with DTensorMuon on the standard library's text and checked against one process of
torch.optim.Muon (each expert its own matrix) + AdamW as dtensor_demo.verify_training checks (the policy of
muon_tools/training_checks.py): the replay of the ranks' own gradients bit for bit at every step; each step's
gradients and loss against float64 within the derived bound (FSDP2's, TP's and the all-to-all's sums run in
other orders), the one process taking the ranks' routing; every routing decision against the one process's own
at the ranks' weights (identical, or a near-tie the probabilities' difference explains); the free-running gap
reported. One spawn of 8 ranks (DP 4 of which EP 2, x TP 2, 7 experts: EP ranks of 4 and 3) saves after step 2;
4 of them resume under EP 4 (2, 2, 2 and 1 experts); then, in the same spawn, --optimizer adamw-experts (AdamW on
the expert stacks) and adamw (on every parameter), each replayed through torch.optim.AdamW on the whole 3-D stacks.
The command line on 4 ranks (EP ranks of 2 and 1 experts), bad flags, a checkpoint of another model or optimizer,
torchrun refused, Ctrl-C."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as nnf
from torch.distributed.tensor import Shard

from conftest import ROOT
import distributed_muon_cpu
import muon_tools
from test_interrupts import assert_ctrl_c_stops_every_rank

import dtensor_verify  # noqa: E402
from examples import gpt_moe  # noqa: E402
from examples import train_gpt_moe  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "train_gpt_moe.py")
SMALL = dict(batch=8, context=32, d_model=32, layers=2, heads=4, expert_hidden=32, log_every=2, val_windows=8,
             progress=False)
STEPS = 3


@pytest.fixture(scope="module")
def trainings(tmp_path_factory):
    """One spawn of 8 ranks: DP 4 (EP 2) x TP 2 with 7 experts and a shared expert, 3 steps kept for --verify's
    checks, saving after step 2; then, on 4 of the ranks, the same run resumed under DP 4 (EP 4) x TP 1; then 2 steps
    of the first with --optimizer adamw-experts (the experts at lr 0.003, the rest at 0.01), and 2 of DP 4 (EP 4) x
    TP 1 with adamw. With the first one's verification (computed once: several tests read it)."""
    folder = str(tmp_path_factory.mktemp("moe_dcp") / "after_step_2")
    base = train_gpt_moe.Config(dp=4, ep=2, tp=2, experts=7, shared_expert=True, steps=STEPS, keep=True, **SMALL)
    configs = [replace(base, save=folder, save_step=2), replace(base, ep=4, tp=1, resume=folder, resume_step=2),
               replace(base, optimizer="adamw-experts", experts_lr=0.003, steps=2),
               replace(base, optimizer="adamw", ep=4, tp=1, steps=2)]
    results = train_gpt_moe.train_many(configs, world=8)
    return configs, results, train_gpt_moe.verify(configs[0], results[0])


def test_eight_ranks_replay_bit_for_bit_route_as_one_process_and_stay_within_the_bound(trainings):
    configs, results, out = trainings
    assert out["n_params"] == 34 and out["replay_differs"] == [] and out["replica_max_diff"] == 0
    # FSDP2, TP and the all-to-all sum in other orders: not the one process's gradients, but within the bound
    assert out["grad_max_rel_diff"] > 0 and 0 < out["ranks_grad_err"] and 0 < out["bound_ratio"] <= 1
    # every token's top-2 of every layer and step is the one process's own at the ranks' weights
    assert out["routing_decisions"] == STEPS * 2 * 8 * 32 and out["routing_differ"] == []
    assert out["routing_replicas_agree"] and out["routing_prob_max_diff"] < 1e-6 and out["passed"]
    ranks = {r["rank"]: r for r in results[0]}
    losses = ranks[0]["losses"]
    assert losses[-1] < losses[0] - 0.5, losses  # it trained, on real text
    # EP ranks of 4 and 3 experts; the stacks Shard(0) over "ep", Replicate over "tp", FSDP2 over "edp" on dim 1
    assert {r["coordinate"][1]: r["experts_held"] for r in ranks.values()} == {0: (0, 4), 1: (4, 7)}
    assert ranks[0]["placements"]["blocks.0.mlp.experts.w1"] == "(Shard(dim=1), Shard(dim=0), Replicate())"
    assert ranks[0]["placements"]["blocks.0.attn.qkv.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert ranks[0]["placements"]["blocks.0.mlp.shared.fc.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"


def test_each_expert_is_orthogonalized_once_in_the_world_and_the_ledgers_count_both_exchanges(trainings):
    configs, results, _ = trainings
    cfg, s = configs[0], train_gpt_moe.summarize(configs[0], results[0])
    assert s["each_once"] and s["expert_matrices"] == 2 * 2 * 7
    assert s["expert_ns_flops"] == distributed_muon_cpu.newton_schulz_flops((32, 32))
    for p in s["per_rank"]:  # the plan's bytes are what DTensorMuon's all-to-alls sent (its ledger)
        assert p["optimizer_sent_ledger"] == p["exchange"]["experts"][0] + p["exchange"]["other"][0]
    assert all(p["exchange"]["experts"][0] > 0 for p in s["per_rank"])  # FSDP2 cuts each expert over edp = 2
    pairs = cfg.batch // cfg.dp * cfg.context * cfg.top_k
    for r in results[0]:
        last = lambda phase, way: sum(c[way] for c in r["model_ledger"]["comm"] if (c["step"], c["phase"]) ==
                                      (STEPS, f"expert {phase}"))
        # each row dispatched comes back combined; backward sends the gradients the other way
        assert last("dispatch (forward)", "received") == last("combine (forward)", "sent") > 0
        assert last("dispatch (backward)", "sent") == last("dispatch (forward)", "received")
        assert last("combine (backward)", "received") == last("combine (forward)", "sent")
    for edp in range(2):  # dropless: every pair of an EP group lands on one of its EP ranks, every layer and step
        group = [r for r in results[0] if r["coordinate"][0] == edp and r["coordinate"][2] == 0]
        assert {sum(sum(r["received"][step][layer]) for r in group)
                for step in range(STEPS) for layer in range(cfg.layers)} == {cfg.ep * pairs}


def test_a_weight_one_ulp_off_a_wrong_expert_gradient_or_a_wrong_route_fails(trainings):
    """The replay is torch.equal: an expert weight one ulp off after step 1, or torch fed an expert's gradient of
    step 2 other than the one the ranks took, names that step and parameter, and the gradient bound fails by far;
    a token of step 1 sent to an expert its router did not choose (on TP rank 0 alone) is no near-tie, and the TP
    replicas no longer agree."""
    configs, results, _ = trainings
    bad = [dict(r, grads=list(r["grads"]), weights=list(r["weights"])) for r in results[0]]
    name, stack = "blocks.1.mlp.experts.w2", "blocks.0.mlp.experts.w1"
    holder = next(r for r in bad if r["weights"][1][name].numel())
    w = holder["weights"][1][name].clone()
    muon_tools.one_ulp_up(w)
    holder["weights"][1] = dict(holder["weights"][1], **{name: w})
    per_expert = (max(r["where"][stack].max().item() for r in bad if r["where"][stack].numel()) + 1) \
        // configs[0].experts  # elements of one expert of the stack
    for r in bad:  # expert 0 halved in every rank's part that holds it, its copies alike
        g = r["grads"][1][stack].clone()
        g.view(-1)[r["where"][stack] < per_expert] *= 0.5
        r["grads"][1] = dict(r["grads"][1], **{stack: g})
    out = train_gpt_moe.verify(configs[0], bad)
    assert (1, name) in out["replay_differs"] and (2, stack) in out["replay_differs"] and not out["passed"]
    assert out["bound_ratio"] > 1000 and out["bound_worst"] == (2, stack)

    routed = [dict(r, routing=[list(step) for step in r["routing"]]) for r in results[0]]
    rank0 = next(r for r in routed if r["rank"] == 0)
    record = rank0["routing"][0][0]
    top = record["probs"].sort(-1, descending=True).values[:, :3]
    token = (top[:, :-1] - top[:, 1:]).amin(-1).argmax().item()  # the clearest decision of all
    chosen = record["chosen"].clone()
    chosen[token, 1] = record["probs"][token].argmin()
    rank0["routing"][0][0] = dict(record, chosen=chosen)
    check = train_gpt_moe.routing_check(configs[0], routed)
    assert [(d["step"], d["layer"], d["token"],
             d["near_tie"]) for d in check["routing_differ"]] == [(1, 0, token, False)]
    assert not check["routing_replicas_agree"] and not check["routing_ok"]


def test_saved_under_ep_2_resumed_under_ep_4_replays_bit_for_bit_through_the_checkpoint(trainings):
    """torch's optimizers fed the uninterrupted run's gradients of steps 1 and 2, then the resumed run's of step 3
    (EP 4: experts 2, 2, 2, 1 per EP rank), give every rank's weights bit for bit at every step: the
    checkpoint restored the weights and the optimizer's state exactly, resharded across EP sizes. Step 3 runs at
    the saved weights on another mesh: its loss and gradients within the bound; the curve continues."""
    configs, results, _ = trainings
    whole, resumed, cfg = results[0], results[1], configs[1]
    assert all(r["first"] == 3 and len(r["losses"]) == 1 for r in resumed)
    assert sorted(r["experts_held"] for r in resumed) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    ref = train_gpt_moe.Reference(cfg, routing=train_gpt_moe.ranks_routing(cfg, resumed))
    assert dtensor_verify.replay_differs(ref, whole, steps=2) == []
    assert dtensor_verify.replay_differs(ref, resumed, steps=1, first=3) == []
    shapes = {n: tuple(t.shape) for n, t in ref.weights().items()}
    at_3 = dtensor_verify.assemble([dict(r, params=r["weights"][0]) for r in resumed], shapes)
    loss_3 = sum(r["losses"][0] for r in resumed) / cfg.dp
    errors = dtensor_verify.step_errors(ref, at_3, 3, loss_3, dtensor_verify.total_grads(resumed, 0, shapes))
    assert 0 < errors["bound_ratio"] <= 1, errors
    heads = lambda rs: [r for r in rs if r["coordinate"][2] == 0]
    mean = lambda rs, s: sum(r["losses"][s] for r in heads(rs)) / cfg.dp
    assert abs(mean(resumed, 0) - mean(whole, 2)) < 1e-4


def test_adamw_on_the_experts_or_everywhere_replays_torch_adamw_on_the_whole_stacks_bit_for_bit(trainings):
    """--optimizer adamw-experts: the stacks (FSDP2 over edp = 2 on dim 1, EP 2, TP replicas) in an AdamW group of
    their own at --experts-lr, stepped elementwise on each rank's shard, Muon on the attention and shared-expert
    matrices only;
    adamw: no Muon at all (EP 4, TP 1). torch.optim.AdamW on each whole 3-D stack (and Muon on the rest where they take
    it) replays every rank's weights bit for bit, the gradients within the bound, every routing decision the one
    process's own. The replay can fail: the same ranks' weights against --optimizer muon's torch.optim.Muon differ at
    every step on exactly the matrices that took AdamW (the four stacks; with adamw, the other matrices too)."""
    configs, results, _ = trainings
    stacks = {f"blocks.{i}.mlp.experts.{w}" for i in range(2) for w in ("w1", "w2")}
    owned = {"adamw-experts": {f"blocks.{i}.{m}.weight" for i in range(2)
                               for m in ("attn.qkv", "attn.proj", "mlp.shared.fc", "mlp.shared.proj")},
             "adamw": set()}
    for cfg, ranks in zip(configs[2:], results[2:]):
        out = train_gpt_moe.verify(cfg, ranks)
        assert out["n_params"] == 34 and out["replay_differs"] == [] and out["replica_max_diff"] == 0, cfg.optimizer
        assert 0 < out["bound_ratio"] <= 1 and out["routing_differ"] == [] and out["passed"], cfg.optimizer
        assert out["routing_decisions"] == 2 * 2 * 8 * 32
        assert all(r["expert_matrices"] == [] and set(r["owners"]) == owned[cfg.optimizer] for r in ranks)
        assert all(r["exchange"]["experts"] == [0, 0] for r in ranks)  # AdamW moves nothing between ranks
        heads = [r for r in ranks if r["coordinate"][2] == 0]
        assert sum(r["losses"][-1] for r in heads) < sum(r["losses"][0] for r in heads)  # it trained
        as_muon = train_gpt_moe.verify(replace(cfg, optimizer="muon"), ranks)
        adamw_not_muon = stacks | (owned["adamw-experts"] if cfg.optimizer == "adamw" else set())
        assert set(as_muon["replay_differs"]) == {(step, n) for step in (1, 2) for n in adamw_not_muon}, cfg.optimizer
        assert not as_muon["passed"]
    moe = train_gpt_moe.moe_gpt(configs[2])
    for cfg in configs[2:]:  # the one process's optimizers: AdamW takes the stacks whole, Muon the other matrices
        ref, kinds = train_gpt_moe.Reference(cfg), {}
        for o in ref.optimizers:  # the dimensions of the tensors each kind of torch optimizer steps
            kinds.setdefault(type(o).__name__, set()).update(p.ndim for g in o.param_groups for p in g["params"])
        muon = {"Muon": {2}} if cfg.optimizer == "adamw-experts" else {}
        assert kinds == dict(muon, AdamW={1, 2, 3})
        assert ref.stacks == set() and ref.weights().keys() == dict(moe.named_parameters()).keys()
        lrs = {(type(o).__name__, p.ndim, g["lr"]) for o in ref.optimizers for g in o.param_groups for p in g["params"]}
        assert {lr for kind, ndim, lr in lrs if ndim == 3} == {0.003 if cfg.optimizer == "adamw-experts" else 0.01}
        assert {lr for kind, ndim, lr in lrs if ndim < 3} == {0.01}


def test_a_checkpoint_of_another_expert_count_or_optimizer_is_refused_before_any_rank(trainings, capsys, monkeypatch):
    """--resume reads the checkpoint's metadata before any rank starts: another --experts, sizes or --optimizer than
    it was saved with is one line, exit 2; the sizes and optimizer it was saved with pass (they resumed above)."""
    configs, _, _ = trainings
    folder = configs[0].save
    monkeypatch.setattr(train_gpt_moe.muon_tools, "spawn_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    argv = ["--dp", "4", "--ep", "2", "--tp", "2", "--shared-expert", "--steps", "3", "--batch", "8", "--context", "32",
            "--d-model", "32", "--layers", "2", "--heads", "4", "--expert-hidden", "32", "--val-windows", "8",
            "--resume", folder, "--resume-step", "2"]
    for extra, message in [
        (["--experts", "4"], f"--resume {folder}: its checkpoint has 7 experts a layer (blocks.0.mlp.experts.w1 "
                             f"(7, 32, 32)), this run --experts 4: resume with --experts 7"),
        (["--experts", "7", "--expert-hidden", "16"], "its checkpoint's blocks.0.mlp.experts.w1 is (7, 32, 32), this "
                                                      "run's (7, 16, 32): resume with the sizes it was saved with"),
        (["--experts", "7", "--layers", "3"], "its checkpoint has no blocks.2.ln1.weight: it was saved from another "
                                              "model"),
        (["--experts", "7", "--optimizer", "adamw-experts"],
         "its checkpoint holds Muon's momentum for blocks.0.mlp.experts.w1, which this run steps with AdamW "
         "(--optimizer adamw-experts): resume with the --optimizer it was saved with"),
        (["--experts", "7", "--optimizer", "adamw"], "holds Muon's momentum for blocks.0.attn.qkv.weight, which this "
                                                     "run steps with AdamW (--optimizer adamw)")]:
        code = train_gpt_moe.main(argv + extra)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, (extra, err)
    train_gpt_moe.validate(configs[1])  # what it was saved with, under another EP: no refusal
    not_dcp = os.path.join(os.path.dirname(folder), "not_dcp")
    os.makedirs(not_dcp)
    with open(os.path.join(not_dcp, ".metadata"), "w") as f:
        f.write("not a checkpoint")
    with pytest.raises(ValueError, match=r"^--resume .*not_dcp: its .metadata cannot be read \("):
        train_gpt_moe.validate(replace(configs[1], resume=not_dcp))


def test_command_line_on_4_ranks_with_an_ep_rank_of_fewer_experts(tmp_path):
    """--verify, --json and --figure (the ledger's picture, which the notebook of runs shows for the same command)."""
    argv = ["--dp", "2", "--ep", "2", "--tp", "2", "--experts", "3", "--steps", "2", "--batch", "8", "--context",
            "32", "--d-model", "32", "--layers", "2", "--expert-hidden", "32", "--log-every", "2", "--val-windows", "8",
            "--verify", "--json", str(tmp_path / "run.json"), "--figure", str(tmp_path / "ledger.png")]
    proc = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert "DP 2 (EP 2) x TP 2 = 4 Gloo ranks, experts per EP rank 2, 1" in text
    assert [line.split()[1] for line in text.splitlines() if line.startswith("step ")] == ["2/2"]
    assert "12 expert matrices (2 layers x 2 stacks x 3), each orthogonalized once in the world" in text
    assert "router: each token's top-k of every layer and step (1,024 decisions)" in text
    assert "1,024 identical" in text and "TP replicas agree  PASS" in text
    assert "26/26 parameters identical after each of 2 steps" in text and text.rstrip().endswith("Result: PASS")
    with open(tmp_path / "run.json") as f:
        run = json.load(f)
    held = [p["experts_held"] for p in run["ledger"]["per_rank"]]
    assert held == [[0, 2], [0, 2], [2, 3], [2, 3]] and run["passed"] and len(run["losses"]) == 2
    with open(tmp_path / "ledger.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert proc.stderr == ""


@pytest.mark.parametrize("argv,message", [
    (["--dp", "4", "--ep", "3"], "EP 3 does not divide DP 4: an EP group is EP of the DP ranks"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3 exceeds --experts 2"),
    (["--dp", "4", "--ep", "4", "--experts", "6"], "--experts 6 over EP 4: torch.chunk (Shard(0)) gives 2, 2, 2, 0, "
                                                   "so EP rank 3 would hold none"),
    (["--experts", "1", "--ep", "1", "--top-k", "1"], "--experts must be >= 2 (got 1): one expert routes nothing"),
    (["--aux-loss-weight", "-1"], "--aux-loss-weight must be >= 0 and finite (got -1.0)"),
    (["--verify", "--resume", "{checkpoint}"],
     "--verify replays the run from its initial weights: it takes no --resume"),
    (["--ep", "two"], "argument --ep: invalid int value: 'two'"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, tmp_path, capsys):
    (tmp_path / ".metadata").write_bytes(b"")  # what --resume looks for before any rank starts
    argv = [a.replace("{checkpoint}", str(tmp_path)) for a in argv]
    try:
        code = train_gpt_moe.main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_under_torchrun_rank_0_says_in_one_line_there_is_no_torchrun_mode_and_no_rank_starts(tmp_path):
    """Each process torchrun starts would spawn ranks of its own (two launchers, whose ranks would wait on one
    store): it exits 2 before any rank or forkserver starts, rank 0 alone saying why, in one line. What else
    the command prints is torchrun's own (its banner and its report of the exit codes), none of it this command's."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           SCRIPT, "--steps", "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)))
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and proc.stdout == "" and len(ours) == 1, proc.stderr[-3000:]
    assert ours[0].startswith("error: train_gpt_moe.py runs with python, not under torchrun"), ours
    assert "exitcode  : 2 " in proc.stderr  # torchrun's report: rank 0's exit code
    # no temporary folder of a launcher, no forkserver's (multiprocessing's): only torchrun's own
    assert [name for name in os.listdir(tmp_path) if not name.startswith("torchelastic_")] == []


def test_ctrl_c_stops_every_rank_and_leaves_nothing(tmp_path):
    assert "Result:" not in assert_ctrl_c_stops_every_rank(tmp_path, "--dp", "2", "--ep", "2", "--tp", "2",
                                                           "--steps", "2000", script=SCRIPT)


# -- the one-process MoE against its definition, written out token by token ------------------------------
def test_experts_per_rank_is_dtensors_shard_0():
    for experts, ep in ((7, 4), (3, 2), (6, 4), (8, 8), (4, 1)):
        pieces = Shard(0)._split_tensor(torch.arange(experts), ep, with_padding=False)[0]
        assert gpt_moe.experts_per_rank(experts, ep) == [p.numel() for p in pieces]


def test_one_process_moe_is_each_tokens_gated_top_k_experts_and_switch_transformers_aux_loss():
    """In float64 (the dispatch sorts rows and runs each expert on all of its rows at once, this loop one row at a
    time: another summation order, so the comparison allows 1e-12 of the output's scale)."""
    torch.manual_seed(0)
    moe_config = gpt_moe.MoEConfig(experts=5, top_k=2, expert_hidden=6)
    moe = gpt_moe.MoE(8, moe_config, micro_batches=2).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    h = torch.randn(2, 6, 8, dtype=torch.float64)
    out = moe(h)
    x = h.reshape(-1, 8)
    expected = torch.zeros_like(x)
    share, mean_prob = torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = (x[t] @ moe.router.weight.T).softmax(-1)
        top = sorted(range(5), key=lambda e: -probs[e].item())[:2]
        for e in top:
            y = nnf.gelu(x[t] @ moe.experts.w1[e].T) @ moe.experts.w2[e].T
            expected[t] += probs[e] / (probs[top[0]] + probs[top[1]]) * y
            share[t // 6, e] += 1 / (6 * 2)
        mean_prob[t // 6] += probs / 6
    assert (out.reshape(-1, 8) - expected).abs().max() <= 1e-12 * expected.abs().max()
    aux = sum(5 * sum(share[b, e] * mean_prob[b, e] for e in range(5)) for b in range(2)) / 2
    assert abs(moe.aux_loss.item() - aux.item()) <= 1e-12
