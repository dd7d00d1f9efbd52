"""DTensorMuon (distmuon/dtensor/): bit for bit against torch.optim.Muon / AdamW on every mesh,
expert stacks, uneven FSDP2 shards, missing gradients, clear errors, DCP checkpoints across meshes, the CLI
(spawned and under torchrun), batched Newton-Schulz within the lesson's bound, the lesson's strategies run on
the same matrices, and FSDP2's and the TP layers' bytes of a training step, measured, against the shapes.

One spawn of 8 Gloo ranks runs every distributed scenario one after another (each on its own (sub-)mesh of the
first dp x tp ranks; tests/dtensor_scenarios.py): starting ranks costs more than a scenario.
Every comparison is torch.equal except two. The real FSDP2 x TP training run is checked by
dtensor_verify.verify_training with the policy every real training here shares (muon_tools/training_checks.py): the
replay of the ranks' own gradients through torch's optimizers is torch.equal at every step, while each step's
gradients and loss at the ranks' weights are held, against float64, to the bound derived from the arithmetic (4 x
the one process's own fp32 error plus n u: FSDP2's and TP's sums run in another order); the free-running losses'
gap is reported beside a one-ulp chaos floor, never checked. And the Muon matrices of the --batched-ns run are
held to the lesson's derived bound (muon_tools.batched_ns_tolerance).
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
import distributed_muon_cpu
from distmuon import owners
import muon_tools

from distmuon import dtensor  # noqa: E402
from distmuon.dtensor import placements  # noqa: E402
import dtensor_demo  # noqa: E402
from collective_counter import FORWARD_BACKWARD, measured_sent, measured_table  # noqa: E402
from dtensor_accounting import (COMPARISON_HEADER, DP_IN_STEP, DTENSOR_PHASES, LessonRuns, account,  # noqa: E402
                                comparison_rows, lesson_accounts, lesson_config, lesson_specs, phase_bytes)
from dtensor_run import (BATCH, SEQ, DemoConfig, DemoModel, build_optimizer, expert_stack_names,  # noqa: E402
                         give_grads, param_groups)
from dtensor_scenarios import (EXPLICIT_SHAPES, GROUPED, GROUPS, ExplicitRun, PlacedRun, RefusedRun,  # noqa: E402
                               Runs, placed_runs, placed_start, rows_of, run_explicit_reference, run_many_rank,
                               run_placed_reference)
from dtensor_verify import run_reference, verify, verify_training  # noqa: E402

SCRIPT = os.path.join(ROOT, "dtensor_demo.py")  # the demo's command
MESHES = [(8, 1), (4, 2), (2, 4), (1, 8), (2, 2), (3, 2)]
MISSING = (("layers.0.fc1.weight", 2), ("layers.0.moe.w1", 1), ("embed.weight", 1), ("layers.1.norm.bias", 3))


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp") / "after_step_2")


@pytest.fixture(scope="session")
def checkpoint_2x2(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp") / "2x2_after_step_1")


RESUMED_ON = [(4, 1), (1, 4), (3, 2), (1, 1)]
# 7 experts: TP cuts the stacks 4 | 3, then FSDP2 cuts each TP piece over dp = 3 (as w2's dim 1, 40 rows, is not a
# multiple of 3): experts 0-1, 2-3, none | 4, 5, 6. torch's own _StridedShard split (distribute_tensor's) puts
# expert 6 on (dp 2, tp 0) and nothing on (dp 2, tp 1): the case where the optimizer must follow FSDP2
# (distmuon/dtensor/, section 2).
UNEVEN_STRIDED = DemoConfig(dp=3, tp=2, experts=7)
PLACED = {
    **placed_runs(GROUPS),
    "refused 4x1": PlacedRun((4, 1), ("dp", "tp"), GROUPED, GROUPS, bad="option"),
    "refused 4x1, rank 3 alone": PlacedRun((4, 1), ("dp", "tp"), GROUPED, GROUPS, bad="option@3"),
}


@pytest.fixture(scope="session")
def scenarios(checkpoint_dir, checkpoint_2x2):
    """{label: [each rank's result]} for every scenario, from ONE spawn of 8 ranks."""
    runs = {f"{dp}x{tp}": DemoConfig(dp=dp, tp=tp) for dp, tp in MESHES}
    runs["2x2"] = DemoConfig(dp=2, tp=2, checkpoint=checkpoint_2x2, checkpoint_step=1)  # torch's recipe
    # the same runs; 4x2 saves a checkpoint, and both measure a training step's collectives (--compare's figures)
    runs["4x2"] = DemoConfig(dp=4, tp=2, checkpoint=checkpoint_dir, checkpoint_step=2, count_comm=True)
    runs["3x2"] = DemoConfig(dp=3, tp=2, count_comm=True)
    runs["resume 4x2 -> 8x1"] = DemoConfig(dp=8, tp=1, resume=checkpoint_dir, resume_step=2)
    runs.update({f"resume 2x2 -> {dp}x{tp}": DemoConfig(dp=dp, tp=tp, resume=checkpoint_2x2, resume_step=1)
                 for dp, tp in RESUMED_ON})
    runs["hsdp 2x2x2"] = DemoConfig(replicate=2, dp=2, tp=2)  # real fully_shard on mesh["replicate", "dp"]
    runs["uneven strided 3x2"] = UNEVEN_STRIDED
    runs.update(PLACED)
    runs["missing"] = DemoConfig(dp=4, tp=2, missing_grads=MISSING)
    runs["train"] = DemoConfig(dp=4, tp=2, train=True)
    runs["partial"] = RefusedRun(DemoConfig(dp=2, tp=2), "partial")
    runs["assign"] = RefusedRun(DemoConfig(dp=4, tp=2), "assign")
    runs["explicit"] = ExplicitRun()  # on all 8 ranks
    runs["explicit refused"] = ExplicitRun(short_gather=True)
    runs["batched"] = DemoConfig(dp=4, tp=2, batched_ns=True)  # the default run, with batched Newton-Schulz
    runs["lesson 4x2"] = LessonRuns(DemoConfig(dp=4, tp=2))  # the lesson's owner / comm-free, these matrices
    results = muon_tools.spawn_ranks(Runs(tuple(runs.values()), timeout_s=60), run_many_rank)
    return {label: [r[i] for r in results if r[i] is not None] for i, label in enumerate(runs)}, runs


@pytest.fixture(scope="session")
def reference():
    return run_reference(DemoConfig())


@pytest.mark.parametrize("dp,tp", MESHES)
def test_every_parameter_on_every_rank_equals_torch(scenarios, reference, dp, tp):
    results, runs = scenarios
    ranks = results[f"{dp}x{tp}"]
    assert len(ranks) == dp * tp
    start = dict(DemoModel(DemoConfig()).named_parameters())
    for name, ref in reference.items():
        assert not torch.equal(ref, start[name].detach()), f"{name} did not move: the check would prove nothing"
    assert_identical(ranks, reference, f"{dp}x{tp}")


def assert_identical(ranks, reference, label):
    """Every element of every rank equals torch's at its place, and every element is held somewhere."""
    checks = verify(None, ranks, reference)
    assert [c["name"] for c in checks if not c["identical"]] == [], label
    assert all(c["max_abs_diff"] == 0 for c in checks)


def test_meshes_exercise_strided_uneven_and_expert_parallel_shards(scenarios):
    results, _ = scenarios
    p = results["3x2"][0]["placements"]
    assert p["layers.0.fc1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # colwise TP, then FSDP2
    assert p["layers.0.fc2.weight"] == "(Shard(dim=0), Shard(dim=1))"  # rowwise TP, FSDP2 on 40 rows / 3: uneven
    assert p["layers.0.moe.w1"] == "(Shard(dim=1), Shard(dim=0))"  # each expert's 36 rows cut over dp = 3
    assert p["layers.0.moe.w2"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # 40 % 3 != 0: expert dim cut
    assert results["4x2"][0]["placements"]["layers.0.moe.w1"] == "(Shard(dim=1), Shard(dim=0))"


def test_uneven_strided_shards_are_where_fsdp2_puts_them_and_equal_torch(scenarios):
    """Where the optimizer's local_indices puts each local element is where TP and FSDP2 put it (element_places:
    a model of index values through the same wrappers), on every mesh of the spawn, and the uneven strided case
    steps bit for bit as torch does."""
    results, _ = scenarios
    ranks = results["uneven strided 3x2"]
    assert ranks[0]["placements"]["layers.0.moe.w2"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    held = {r["rank"]: r["where"]["layers.0.moe.w2"].numel() // (40 * 36) for r in ranks}
    assert held == {0: 2, 1: 1, 2: 2, 3: 1, 4: 0, 5: 1}  # experts per rank: 0-1 | 4, 2-3 | 5, none | 6
    checked = 0
    for label, runs in results.items():
        for r in runs:
            for name, index in (r.get("optimizer_places", {}) if isinstance(r, dict) else {}).items():
                assert torch.equal(index, r["where"][name]), (label, r["rank"], name)
                checked += 1
    assert checked > 500
    assert_identical(ranks, run_reference(UNEVEN_STRIDED), "uneven strided 3x2")


def test_placements_the_optimizer_does_not_know_are_refused_in_one_line():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert placements.placements_problem("w", (_StridedShard(0, split_factor=2), Shard(0)), (3, 2)) is None
    why = placements.placements_problem("w", (_StridedShard(0, split_factor=4), Shard(0)), (3, 2))
    assert why.startswith("w: placement _StridedShard(dim=0, sf=4) on mesh dim 0: its split factor is not the "
                          "product of the later mesh dims cutting tensor dim 0 (2)")


def test_each_matrix_orthogonalized_once_and_one_exchange_each_way_per_step(scenarios):
    results, runs = scenarios
    ranks = results["4x2"]
    owners = ranks[0]["owners"]
    for r in ranks:
        assert r["owners"] == owners  # every rank made the same plan
    model = DemoModel(runs["4x2"])
    stacks = expert_stack_names(model)
    # every expert is its own matrix; the router has one copy per TP column (two 1-D dp meshes)
    expected = sum(p.shape[0] if n in stacks else 2 if "router" in n else 1
                   for n, p in model.named_parameters() if p.ndim >= 2 and not n.startswith(("embed", "head")))
    assert len(owners) == expected == 2 * (4 + 4 + 1 + 1 + 2)
    for step in (1, 2, 3):
        calls = [c for r in ranks for c in r["ledger"]["compute"] if c["step"] == step]
        assert sorted(c["name"] for c in calls) == sorted(owners)  # once each, on one rank
        for r in ranks:
            assert all(owners[c["name"]] == r["rank"] for c in r["ledger"]["compute"])
            ops = [c["phase"] for c in r["ledger"]["comm"] if c["step"] == step]
            assert ops == ["grad presence", "gather at owner", "scatter from owner"]
    flops = [sum(c["flops"] for c in r["ledger"]["compute"] if c["step"] == 3) for r in ranks]
    assert max(flops) / (sum(flops) / len(flops)) < 1.5  # balanced by LPT over FLOPs


def test_an_owner_always_holds_part_of_its_matrix(scenarios):
    results, _ = scenarios
    for label in ("3x2", "1x8", "8x1"):
        for r in results[label]:
            for c in r["ledger"]["compute"]:
                # on 1x8 the 4 experts of an expert-parallel stack live on tp ranks 0-3 only
                if label == "1x8" and "moe.w" in c["name"]:
                    assert r["rank"] < 4, c


def test_missing_gradients_are_skipped_as_torch_skips_them(scenarios):
    results, runs = scenarios
    reference = run_reference(runs["missing"])
    assert_identical(results["missing"], reference, "missing")
    # and they really were skipped: without the missing gradients the result differs
    full = run_reference(DemoConfig())
    for name, _ in MISSING:
        assert not torch.equal(reference[name], full[name])


def test_batched_newton_schulz_within_the_lessons_bound_and_everything_else_bit_identical(scenarios, reference):
    results, runs = scenarios
    cfg, ranks = runs["batched"], results["batched"]
    assert len(ranks) == 8 and all(r["batched_ns"] for r in ranks)
    # there was something to batch: some owner orthogonalized several matrices of one shape in a step
    shapes = [[c["shape"] for c in r["ledger"]["compute"] if c["step"] == cfg.steps] for r in ranks]
    assert any(len(s) > len(set(s)) for s in shapes), shapes
    checks = verify(cfg, ranks, reference)
    assert {c["optimizer"] for c in checks} == {"Muon", "AdamW"}
    for c in checks:
        if c["optimizer"] == "Muon":  # the lesson's bound: steps x adjusted lr x 1.5 x BATCHED_NS_BOUND
            rows, cols = c["shape"][-2:]
            bound = cfg.steps * cfg.lr * max(1, rows / cols) ** 0.5 * 1.5 * owners.BATCHED_NS_BOUND
            assert c["tolerance"] == pytest.approx(bound) and c["tolerance"] > 0, c
            assert c["max_abs_diff"] <= c["tolerance"] and c["ok"], c
        else:  # AdamW is untouched by batching: bit for bit
            assert c["identical"] and c["max_abs_diff"] == 0 and c["tolerance"] == 0, c
    passed, line = muon_tools.verdict(checks)
    assert passed and line.startswith("PASS: "), line

    # and the check bites: a Muon element past its bound, or an AdamW element one ulp off, fails
    def nudged(name, by):
        bad = [dict(r, params=dict(r["params"])) for r in ranks]
        holder = next(r for r in bad if r["params"][name].numel())
        flat = holder["params"][name].clone().reshape(-1)
        flat[0] += by(flat[0])
        holder["params"][name] = flat.view(holder["params"][name].shape)
        return {c["name"]: c for c in verify(cfg, bad, reference)}[name]

    bound = muon_tools.batched_ns_tolerance(cfg.steps, cfg.lr, cfg.adjust_lr_fn, (160, 40))
    muon = nudged("layers.0.fc1.weight", lambda x: 2 * bound)
    assert not muon["ok"] and muon["max_abs_diff"] > muon["tolerance"] > 0
    adamw = nudged("embed.weight", lambda x: torch.nextafter(x, torch.tensor(float("inf"))) - x)
    assert not adamw["ok"] and 0 < adamw["max_abs_diff"] < 1e-6 and adamw["tolerance"] == 0
    assert not muon_tools.verdict(verify(cfg, [dict(r, params=dict(r["params"], **{"layers.0.fc1.weight":
                                                                            r["params"]["layers.0.fc1.weight"] + 1}))
                                        for r in ranks], reference))[0]


def test_lesson_strategies_run_on_the_same_matrices_and_their_bytes_match_their_plan(scenarios):
    """--compare's like-for-like table: the lesson's OwnerMuon / CommFreeMuon on this demo's matrices (each
    expert its own 2-D matrix), same 4 x 2 grid, checked against torch; their ledgers against their plans."""
    results, runs = scenarios
    lesson, ranks = runs["lesson 4x2"], results["lesson 4x2"]
    specs = lesson_specs(lesson.demo)
    muon = [s.name for s in specs if s.group == "muon"]
    assert len(muon) == 2 * (1 + 1 + 1 + 4 + 4) and "layers.1.moe.w2[3]" in muon
    assert len(specs) == 20 - 4 + 4 * 4  # the demo's 20 parameters, each of the 4 expert stacks as 4 matrices
    accounts = lesson_accounts(lesson, ranks)
    dp, tp = lesson.dp, lesson.tp
    for strategy, acc in accounts.items():
        assert all(c["identical"] for c in acc["checks"]) and len(acc["checks"]) == len(specs), strategy
        assert acc["flops"]["redundancy"] == 1.0  # each matrix orthogonalized once
        # the ledger's bytes are what the lesson's plan says, computed here without process groups
        plans = [muon_tools.plan_optimizer(lesson_config(lesson.demo, strategy), r, specs) for r in range(dp * tp)]
        table = acc["table"]
        ring = [sum((dp - 1) * (b.numel // dp) * 4 for b in plans[0].layout.buckets)] * (dp * tp)
        assert table["grad reduce-scatter"]["sent"] == ring == table["param all-gather"]["sent"], strategy
        for phase, parts in (("gather at owner", "senders"), ("scatter from owner", "holders")):
            planned = [0] * (dp * tp)
            for r, plan in enumerate(plans):
                axis = plan.strategy.axis(plan)
                for route in plan.strategy.routes:
                    for part in getattr(route, parts):
                        if part.rank != route.owner:
                            who = part.rank if phase == "gather at owner" else route.owner
                            if axis.ranks[who] == r:
                                planned[r] += 2 * (part.stop - part.start)  # bf16
            assert table[phase]["sent"] == planned, (strategy, phase)
    rows, per_rank = comparison_rows(runs["4x2"], results["4x2"], accounts)
    assert [r[0] for r in rows] == ["DTensorMuon", "lesson owner", "lesson comm-free"]
    column = dict(zip(COMPARISON_HEADER, zip(*rows)))
    fsdp2 = measured_sent(results["4x2"], FORWARD_BACKWARD, "dp")
    assert column["DP in step"] == ("0 B", muon_tools.human_bytes(max(table_of(accounts, "owner"))),
                                    muon_tools.human_bytes(max(table_of(accounts, "comm-free"))))
    assert column["DP in fwd/bwd"] == (muon_tools.human_bytes(max(fsdp2)), "0 B", "0 B")  # ZeRO-1 gathers nothing there
    assert column["TP in fwd/bwd"][1:] == ("not run", "not run")
    own_step = phase_bytes(account(runs["4x2"], results["4x2"])[0], DTENSOR_PHASES)
    assert per_rank["DTensorMuon"][0] == [a + b for a, b in zip(own_step, fsdp2)]
    assert [len(sent) for sent, _ in per_rank.values()] == [8, 8, 8]


def table_of(accounts, strategy):
    """The lesson's DP bytes in its step, per rank."""
    return phase_bytes(accounts[strategy]["table"], DP_IN_STEP)


@pytest.fixture(scope="session")
def training(scenarios):
    """The real FSDP2 x TP run (4x2, 3 steps) and its three comparisons with one process (verify_training)."""
    results, runs = scenarios
    return runs["train"], results["train"], verify_training(runs["train"], results["train"])


def test_real_fsdp2_tp_training_replays_bit_for_bit_and_its_gradients_are_within_the_derived_bound(training):
    """Real forward / backward through fully_shard x parallelize_module, 3 steps on 4x2, checked by the
    bound muon_tools/training_checks.py derives for sums in torch's own order (examples/train_gpt.py needs it only
    as NCCL with TP > 2 would; this model's sums: dtensor_verify.py):
      * replay: torch.optim.Muon + AdamW fed the ranks' own total gradients (full_tensor() of every .grad)
        from the same start give every rank's weights torch.equal, at every step: the optimizer is exact;
      * at the ranks' own weights before each step, the plain model on the whole batch of 64 tokens, in fp32
        and float64: the ranks' gradients and loss within 4 x the one process's own error against float64
        plus n u (FSDP2's reduce-scatter, RowwiseParallel's all-reduce and ColwiseParallel's backward
        all-reduce sum in other orders than the reference's one matmul);
      * free-running: the losses' gap reported beside the chaos floor (one ulp on layers.0.fc1.weight).
    """
    cfg, ranks, out = training
    assert cfg.train and (cfg.dp, cfg.tp, cfg.steps) == (4, 2, 3) and len(ranks) == 8
    assert out["replay_differs"] == [] and out["n_params"] == 20
    assert out["replica_max_diff"] == 0  # the router's two copies (one per TP column) got the same gradients
    assert out["tokens_per_step"] == BATCH * SEQ * 4 and out["grad_max_rel_diff"] > 0
    assert 0 < out["ranks_grad_err"] and 0 < out["one_process_grad_err"] and 0 < out["bound_ratio"] <= 1
    floor = out["chaos_floor_loss_max_rel_diff"]
    assert out["chaos_param"] == "layers.0.fc1.weight"
    assert out["chaos_ratio"] == (out["trained_loss_max_rel_diff"] / floor if floor else None) and out["passed"]
    # the run trained: every rank's weights moved at every step, so the replay's torch.equal proves something
    for s in range(1, cfg.steps):
        for name, w in ranks[0]["weights"][s].items():
            assert w.numel() == 0 or not torch.equal(w, ranks[0]["weights"][s - 1][name]), (s, name)


def test_training_checks_fail_on_a_wrong_gradient_weight_or_loss(training):
    """The checks bite: one weight one ulp off after step 1 and one gradient entry off by a tenth of its tensor's
    largest entry at step 2 fail the replay (named by step and parameter), the gradient also the bound; one DP
    row's loss off by 2**-13 (relative) at step 1 fails the bound alone."""
    cfg, ranks, good = training
    bad = [dict(r, grads=list(r["grads"]), weights=list(r["weights"]), losses=list(r["losses"])) for r in ranks]
    grads = dict(bad[0]["grads"][1])
    g = grads["layers.0.fc1.weight"].clone()
    g.view(-1)[0] += 0.1 * g.abs().max()
    bad[0]["grads"][1] = dict(grads, **{"layers.0.fc1.weight": g})
    holder = next(r for r in bad if r["weights"][1]["embed.weight"].numel())
    w = holder["weights"][1]["embed.weight"].clone()
    muon_tools.one_ulp_up(w)
    holder["weights"][1] = dict(holder["weights"][1], **{"embed.weight": w})
    out = verify_training(cfg, bad)
    assert not out["passed"]
    assert (1, "embed.weight") in out["replay_differs"]  # the weight: not what torch gave after step 1
    assert (2, "layers.0.fc1.weight") in out["replay_differs"]  # torch fed the wrong gradient: not the ranks' weights
    assert out["bound_ratio"] > 1 and out["bound_worst"] == (2, "layers.0.fc1.weight")
    assert out["chaos_floor_loss_max_rel_diff"] == good["chaos_floor_loss_max_rel_diff"]  # still reported
    lossy = [dict(r, losses=list(r["losses"])) for r in ranks]
    lossy[0]["losses"][0] *= 1 + 2.0**-13
    out = verify_training(cfg, lossy)
    assert out["replay_differs"] == [] and out["bound_ratio"] > 1 and out["bound_worst"] == (1, "loss")
    assert not out["passed"]


def test_a_real_training_is_reported_in_a_table_with_its_chaos_floor(training):
    """--train's report (what `python dtensor_demo.py --train` prints): the training's checks as a table, the
    free-running gap beside the chaos floor as a ratio, and the verdict of what is checked."""
    cfg, ranks, out = training
    lines = []
    printed = dtensor_demo.report(cfg, ranks, out, lines.append)
    text = "\n".join(lines)
    assert printed["passed"] and printed["checks"] is out
    assert "20/20 parameters identical after each of 3 steps" in text and "n = 64 tokens" in text
    trained = next(line for line in text.splitlines() if line.startswith("trained "))
    floor = out["chaos_floor_loss_max_rel_diff"]
    assert f"{out['trained_loss_max_rel_diff']:.1e}" in trained and trained.rstrip().endswith("reported")
    assert (f"chaos floor {floor:.1e}: {out['chaos_ratio']:.2g}x" if floor else "chaos floor 0") in trained
    assert lines[-1] == ("Result: PASS: the replay bit for bit, the gradients within the derived bound (the "
                         "free-running gap reported, not checked)")


def fsdp2_tp_bytes(cfg, padded=True):
    """{(phase, collective, mesh dim): bytes} each rank sends in one training step of the demo, from the shapes:
    FSDP2 all-gathers each unit's flat buffer of padded shards in forward and, but for the root unit (embedding,
    head), again in backward, and reduce-scatters its gradients; TP all-reduces fc2's output in forward and fc1's
    input gradient in backward, and all-gathers the experts (full_tensor()) in forward. Ring counts, fp32."""
    dp, tp, f32 = cfg.dp, cfg.tp, 4
    shapes = {n: tuple(p.shape) for n, p in DemoModel(cfg).named_parameters()}

    def tp_local(name, shape):  # ColwiseParallel: rows; RowwiseParallel: columns; expert parallel: experts
        cut = 1 if name.endswith("fc2.weight") else 0 if name.endswith(("fc1.weight", "fc1.bias", "moe.w1",
                                                                          "moe.w2")) else None
        return shape if cut is None else shape[:cut] + (shape[cut] // tp,) + shape[cut + 1:]

    def shard(shape):  # FSDP2 cuts an expert stack's dim 1 when dp divides it, else dim 0 padded to ceil(size / dp)
        dim = 1 if len(shape) == 3 and shape[1] % dp == 0 else 0
        rows = math.ceil(shape[dim] / dp) if padded else shape[dim] / dp
        return rows * math.prod(shape) // shape[dim]

    units = {u: sum(shard(tp_local(n, s)) for n, s in shapes.items() if n.startswith(u))
             for u in [f"layers.{i}." for i in range(cfg.layers)] + ["embed.", "head."]}
    layers = sum(v for u, v in units.items() if u.startswith("layers."))
    activations = 2 * (tp - 1) * math.ceil(BATCH * SEQ * cfg.d / tp) * f32 * cfg.layers
    experts = 2 * (tp - 1) * (cfg.experts // tp) * cfg.expert_hidden * cfg.d * f32 * cfg.layers  # w1 and w2
    return {("forward", "all-gather", "dp"): (dp - 1) * sum(units.values()) * f32,
            ("forward", "all-reduce", "tp"): activations,
            ("forward", "all-gather", "tp"): experts,
            ("backward", "all-gather", "dp"): (dp - 1) * layers * f32,
            ("backward", "all-reduce", "tp"): activations,
            ("backward", "reduce-scatter", "dp"): (dp - 1) * sum(units.values()) * f32}


@pytest.mark.parametrize("label", ["4x2", "3x2"])
def test_measured_fsdp2_and_tp_bytes_of_a_training_step_match_the_shapes(scenarios, label):
    """CollectiveCounter (--compare): every collective a rank dispatched in one forward / backward, against
    fsdp2_tp_bytes from the shapes alone, on every rank; on 3x2 FSDP2 pads its shards, and the padding is sent;
    the optimizer step, measured the same way, sends what its Ledger says."""
    results, runs = scenarios
    cfg, ranks = runs[label], results[label]
    table = measured_table(ranks)
    assert [key for key in table if key[1].startswith("not counted")] == []
    measured = {(phase, op, axis): t["sent"] for (phase, op, axis, dtype), t in table.items()
                if phase in FORWARD_BACKWARD}
    assert {dtype for (phase, *_, dtype) in table if phase in FORWARD_BACKWARD} == {"float32"}
    expected = fsdp2_tp_bytes(cfg)
    assert measured == {key: [b] * len(ranks) for key, b in expected.items()}, label
    calls = {key[:3]: max(t["calls"]) for key, t in table.items()}
    assert calls[("forward", "all-gather", "dp")] == cfg.layers + 1  # one per layer, one for the root
    assert calls[("backward", "all-gather", "dp")] == cfg.layers  # the root keeps its parameters for backward
    gathered = ("forward", "all-gather", "dp")
    if cfg.dp == 3:  # e.g. 40 rows over 3 ranks: shards of 14, the last holding 12; FSDP2 sends the padding
        assert fsdp2_tp_bytes(cfg, padded=False)[gathered] < expected[gathered]
    ledger = phase_bytes(account(cfg, ranks)[0], DTENSOR_PHASES)
    assert measured_sent(ranks, ("optimizer step",)) == ledger and min(ledger) > 0
    ops = {(op, axis, dtype): max(t["calls"]) for (phase, op, axis, dtype), t in table.items()
           if phase == "optimizer step"}
    assert ops == {("all-reduce", "world", "uint8"): 1, ("all-to-all", "world", "bfloat16"): 2}


@pytest.mark.parametrize("dp,tp", RESUMED_ON)
def test_torch_checkpoint_recipe_saved_on_2x2_resumes_on_another_mesh_bit_identical(scenarios, reference, dp, tp):
    """Saved on 2x2 after step 1 with torch's own recipe (dcp.save of get_model_state_dict and
    get_optimizer_state_dict), loaded on another mesh with dcp.load, set_model_state_dict and
    set_optimizer_state_dict (no init_state, no copy-back), 2 more steps: torch.equal to one uninterrupted
    process of torch.optim.Muon / AdamW."""
    results, _ = scenarios
    label = f"resume 2x2 -> {dp}x{tp}"
    assert len(results[label]) == dp * tp
    for r in results[label]:
        assert len(r["step_ms"]) == 2  # steps 2 and 3 ran after the load
    assert_identical(results[label], reference, label)


def test_torch_checkpoint_recipe_is_what_the_helpers_run(checkpoint_2x2, scenarios):
    """The checkpoint holds torch's layout: the state keyed by fully qualified name, the groups' options."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(checkpoint_2x2).read_metadata().state_dict_metadata
    assert "optim.state.layers.0.moe.w1.momentum_buffer" in metadata
    assert "optim.state.embed.weight.exp_avg_sq" in metadata and "model.layers.1.fc2.weight" in metadata
    assert {f"optim.param_groups.{i}.{k}" for i in range(3) for k in ("params", "lr")} <= set(metadata)
    assert {"optim.param_groups.0.adjust_lr_fn", "optim.param_groups.1.betas"} <= set(metadata)  # each torch's own


def test_checkpoint_resharded_to_other_meshes_continues_bit_identical(scenarios, reference):
    results, _ = scenarios
    label = "resume 4x2 -> 8x1"
    for r in results[label]:
        assert len(r["step_ms"]) == 1  # only step 3 ran after the load
    assert_identical(results[label], reference, label)


def test_checkpoint_of_8_ranks_loads_into_one_process_and_continues_bit_identical(scenarios, checkpoint_dir,
                                                                                  reference):
    cfg = DemoConfig()
    torch.set_num_threads(1)
    model = DemoModel(cfg)  # plain tensors, no process group: every matrix is local
    opt = dtensor.DTensorMuon(param_groups(model, cfg), expert_stacks=expert_stack_names(model))
    named = list(model.named_parameters())
    dtensor.load_checkpoint(checkpoint_dir, model, opt)
    state = opt.state[opt.param_by_name["embed.weight"]]
    assert state["step"].item() == 2 and state["exp_avg"].abs().max() > 0
    assert opt.state[opt.param_by_name["layers.0.moe.w1"]]["momentum_buffer"].abs().max() > 0
    give_grads(model, cfg, 3)
    opt.step()
    for name, p in named:
        assert torch.equal(p.detach(), reference[name]), name


def test_partial_gradient_is_a_clear_error_on_every_rank(scenarios):
    results, _ = scenarios
    errors = {r["rank"]: r["error"] for r in results["partial"]}
    assert len(errors) == 4
    for rank, error in errors.items():
        assert "placement P(sum) on mesh dim 0 is a pending reduction (Partial)" in error or \
            error.endswith(" refused the step (it raised why); nothing changed"), error
    assert any("the gradient of layers.0.fc2.weight" in e for e in errors.values())


def test_a_bad_owner_assignment_is_refused_naming_the_matrices(scenarios):
    results, _ = scenarios
    for r in results["assign"]:
        assert r["error"].startswith("bad owner assignment: layers.0.fc1.weight has no owner; ")
        assert "layers.1.moe.w2[3] has no owner" in r["error"]


def test_explicit_config_on_plain_row_chunks_equals_torch(scenarios):
    results, runs = scenarios
    reference = run_explicit_reference(runs["explicit"])
    world = 8
    for r in results["explicit"]:
        assert sorted(r["owners"]) == sorted(EXPLICIT_SHAPES)
        for name, ref in reference.items():
            assert torch.equal(r["params"][name], rows_of(ref, r["rank"], world)), (name, r["rank"])


def plain_model_optimizer(**options):
    torch.set_num_threads(1)
    model = DemoModel(DemoConfig())
    groups = param_groups(model, DemoConfig())
    return model, groups, options


@pytest.mark.parametrize("stacks,message", [
    (set(), "Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([4, 36, 40]). Muon "
            "needs 2-D parameters; layers.0.moe.w1 has shape (4, 36, 40): put it in a group of algorithm 'adamw' "
            "(muon_param_groups splits a model the way Muon users do), or name it in expert_stacks"),
    ({"layers.0.moe.w1", "layers.0.moe.w2", "layers.1.moe.w1", "layers.1.moe.w2", "nope"},
     "expert_stacks names no Muon parameter: nope"),
])
def test_construction_errors_name_the_parameter(stacks, message):
    model = DemoModel(DemoConfig())
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        dtensor.DTensorMuon(param_groups(model, DemoConfig()), expert_stacks=stacks)


@pytest.mark.parametrize("owned,message", [
    ({0: ["a.weight", "b.weight", "c.weight", "a.weight"]}, "a.weight is owned twice (ranks 0 and 0)"),
    ({0: ["a.weight", "b.weight"]}, "c.weight has no owner"),
    ({0: ["a.weight", "b.weight", "c.weight", "d.weight"]}, "d.weight is not a Muon matrix"),
])
def test_explicit_assignment_is_validated_at_construction(owned, message):
    params = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in EXPLICIT_SHAPES.items()]
    config = dtensor.DistributedConfig(assign=lambda flops, holders, world: owned, gather=lambda u, o: u,
                                  redistribute=lambda o, w: o, global_shapes=EXPLICIT_SHAPES)
    with pytest.raises(ValueError, match="bad owner assignment: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        dtensor.DTensorMuon([dict(params=params, algorithm="muon")], distributed_config=config)


def test_explicit_config_needs_all_three_parts():
    params = [("a.weight", torch.nn.Parameter(torch.zeros(3, 2)))]
    with pytest.raises(ValueError, match="needs gather, redistribute and global_shapes together"):
        dtensor.DTensorMuon([dict(params=params)], distributed_config=dtensor.DistributedConfig(gather=lambda u, o: u))


def test_owners_are_the_lessons_lpt_restricted_to_each_matrixs_holders():
    g = torch.Generator().manual_seed(0)
    flops = {f"m{i}": int(f) for i, f in enumerate(torch.randint(1, 50, (23,), generator=g).tolist())}
    everyone = {n: tuple(range(6)) for n in flops}
    assert owners.assign_owners(flops, 6, holders=everyone) == owners.assign_owners(flops, 6)  # holding all: the lesson's
    shapes = {n: (f % 3, 1) for n, f in flops.items()}  # equal FLOPs in different shapes, too
    assert owners.assign_owners(flops, 6, shapes, holders=everyone) == owners.assign_owners(flops, 6, shapes)
    # two holder sets, as the expert stacks of one TP column each, beside matrices everyone holds
    holders = {n: (tuple(range(6)) if i < 3 else (0, 2, 4) if i % 2 else (1, 3, 5)) for i, n in enumerate(flops)}
    owner_of = owners.assign_owners(flops, 6, holders=holders)
    assert all(owner_of[n] in holders[n] for n in flops)
    per_rank = owners.load_balance(flops, owner_of, 6)[0]
    assert max(per_rank) - min(per_rank) <= max(flops.values())  # here: no rank a whole matrix ahead of another


def test_local_indices_match_torch_chunk_for_uneven_and_empty_shards():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # (10, 8) on mesh (3, 2): TP cuts rows 5 | 5, then FSDP2 cuts each half 2, 2, 1 (the picture in section 2)
    where = (_StridedShard(0, split_factor=2), Shard(0))
    rows = {c: (dtensor.local_indices((10, 8), (3, 2), where, c) // 8).unique().tolist()
            for c in [(d, t) for d in range(3) for t in range(2)]}
    assert rows == {(0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [4], (0, 1): [5, 6], (1, 1): [7, 8], (2, 1): [9]}
    assert dtensor.local_indices((2, 8), (4,), (Shard(0),), (3,)).numel() == 0  # 2 rows over 4 ranks: rank 3 empty
    # (160, 40) ColwiseParallel over tp = 3 (rows 0-53 | 54-107 | 108-159), FSDP2 over dp = 4 (section 2's example):
    # (dp 3, tp 1) keeps rows 96-107 (torch's _StridedShard split gives 13 rows there, not these)
    where = (_StridedShard(0, split_factor=3), Shard(0))
    rows = (dtensor.local_indices((160, 40), (4, 3), where, (3, 1)) // 40).unique().tolist()
    assert rows == list(range(96, 108))
    assert placements.local_shape((160, 40), (4, 3), where, (3, 1)) == (12, 40)
    assert placements.local_shape((160, 40), (4, 3), where, (3, 2)) == (13, 40)


BAD_INPUT = [
    (["--dp", "0"], "DP and TP must be >= 1 (got DP=0, TP=2)"),
    (["--dp", "16", "--tp", "8"], "DP 16 x TP 8 = 128 ranks is more than 64"),
    (["--steps", "0"], "--steps must be >= 1 (got 0)"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--momentum", "1"], "--momentum must be in [0, 1)"),
    (["--experts", "0"], "--layers and --experts must be >= 1 (got 2, 0)"),
    (["--timeout", "nan"], "--timeout must be > 0 seconds and finite"),
    (["--json", "/nonexistent-folder/run.json"], "--json /nonexistent-folder/run.json: the folder /nonexistent-folder"),
    (["--train", "--dp", "2", "--tp", "3"], "--train with TP 3: torch's ColwiseParallel -> RowwiseParallel forward "
                                            "needs TP to divide the hidden size 160"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUT)
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert dtensor_demo.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    assert message in captured.err


def test_cli_run_passes_and_writes_json(tmp_path, scenarios, capsys):
    """main() as the command line runs it (in this process: the ranks come from the forkserver the shared spawn
    started, which saves a fresh interpreter's seconds), against the same mesh run in the shared spawn."""
    path = tmp_path / "run.json"
    assert dtensor_demo.main(["--dp", "2", "--tp", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Result: PASS: 20/20 parameters bit-identical to torch" in out
    assert_same_run_as_spawned(json.loads(path.read_text()), scenarios, "2x2")
    # the timing line adds up, in the tenths it prints: the ranks' time is their optimizer steps and the rest
    ranks, steps, rest = (round(float(x) * 10) for x in re.search(
        r"^Timing: ranks (\d+\.\d) s = 3 optimizer steps (\d+\.\d) s .* \+ the rest (\d+\.\d) s ", out, re.M).groups())
    timings = json.loads(path.read_text())["timings"]
    assert ranks == steps + rest == round(timings["ranks_s"] * 10) and 0 < timings["optimizer_steps_s"]
    assert steps >= 0 and rest > 0


def assert_same_run_as_spawned(out, scenarios, label):
    """A run's --json: passed, every parameter bit-identical, and the owners, bytes and FLOPs of the same mesh run
    in the shared spawn (the same algorithm, whatever launched it)."""
    results, runs = scenarios
    assert out["passed"] and len(out["checks"]) == 20
    assert all(c["identical"] and c["max_abs_diff"] == 0 for c in out["checks"])
    table, same, flops = account(runs[label], results[label])
    assert out["owners"] == results[label][0]["owners"] and out["ns_flops_per_rank"] == flops
    assert out["bytes_per_step"] == json.loads(json.dumps(table)) and out["bytes_same_every_step"] == same
    sent = out["bytes_per_step"]["gather at owner"]["sent"]
    assert len(sent) == 4 and sum(sent) > 0
    assert out["bytes_per_step"]["gather at owner"]["sent"] == out["bytes_per_step"]["scatter from owner"]["received"]


def torchrun(tmp_path, *argv):
    """The demo on 4 Gloo CPU ranks under torchrun (which finds its own free port: --standalone); torchrun's log
    folders go to tmp_path."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           SCRIPT, "--backend", "gloo", "--device", "cpu", *argv],
                          capture_output=True, text=True, timeout=180, env=dict(os.environ, TMPDIR=str(tmp_path)))


def test_under_torchrun_each_process_is_a_rank_and_rank_0_verifies(tmp_path, scenarios):
    path = tmp_path / "run.json"
    proc = torchrun(tmp_path, "--dp", "2", "--tp", "2", "--json", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("DTensorMuon: 4 ranks under torchrun over Gloo (cpu), mesh dp=2 x tp=2 ")
    assert proc.stdout.count("Result: PASS: 20/20 parameters bit-identical to torch\n") == 1  # rank 0 alone
    out = json.loads(path.read_text())
    assert out["launcher"] == dict(launcher="torchrun", backend="gloo", device="cpu")
    assert_same_run_as_spawned(out, scenarios, "2x2")


TORCHRUN_REFUSALS = [
    (["--dp", "4", "--tp", "2", "--backend", "gloo", "--device", "cpu"], "world size 4 != DP 4 x TP 2 = 8"),
    (["--dp", "2", "--tp", "2", "--backend", "nccl", "--device", "cpu"], "NCCL needs --device cuda"),
    (["--dp", "2", "--tp", "2", "--device", "cuda", "--backend", "gloo"], "no CUDA device for LOCAL_RANK 0 here"),
    (["--dp", "2", "--tp", "2", "--backend", "gloo", "--device", "cpu", "--steps", "0"], "--steps must be >= 1"),
    (["--dp", "2", "--tp", "2", "--backend", "gloo", "--device", "cpu", "--compare"], "--compare spawns the lesson"),
]


@pytest.mark.parametrize("argv,message", TORCHRUN_REFUSALS)
@pytest.mark.parametrize("rank", [0, 3])
def test_under_torchrun_bad_flags_or_world_size_are_refused_before_joining(monkeypatch, capsys, argv, message,
                                                                           rank):
    """What each torchrun process does with a bad launch (RANK, WORLD_SIZE=4, LOCAL_RANK as torchrun sets them):
    exit 2 before joining the world; rank 0 prints one line, the others nothing."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # as on this machine, GPU or not
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(muon_tools.torchrun, "join_world", lambda *a: pytest.fail("joined the world"))
    assert dtensor_demo.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    if rank == 0:
        assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and message in captured.err
    else:
        assert captured.err == ""


@pytest.mark.parametrize("label", [label for label, run in PLACED.items() if not run.bad])
def test_any_param_groups_hsdp_and_expert_parallel_meshes_equal_torch(scenarios, label):
    """Param groups of different options (equal-size groups too) on 1x1, 2x2, 4x1; HSDP's (replicate, shard,
    tp) placements; expert stacks over ep with TP inside the expert, 6 experts over 4 ranks: every element
    torch.equal to torch.optim.Muon / AdamW with the same groups, each Newton-Schulz once across the world."""
    results, runs = scenarios
    run, ranks = runs[label], results[label]
    reference = run_placed_reference(run)
    start = placed_start(run)
    assert all(not torch.equal(reference[n], start[n]) for n in reference)  # everything moved
    assert_identical(ranks, reference, label)
    owners = ranks[0]["owners"]
    assert all(r["owners"] == owners for r in ranks)
    for step in range(1, run.steps + 1):  # each matrix orthogonalized once, on one rank of the whole world
        calls = sorted(c["name"] for r in ranks for c in r["ledger"]["compute"] if c["step"] == step)
        assert calls == sorted(owners), (label, step)
    if label.startswith("ep 4"):  # 6 experts over 4 ranks as torch.chunk cuts: 2, 2, 2 and none
        assert [r["params"]["w1"].shape[0] for r in ranks] == [2, 2, 2, 0]
        assert len(owners) == 12 and all(owners[f"w1[{e}]"] == e // 2 for e in range(6))


@pytest.mark.parametrize("label", [label for label, run in PLACED.items() if run.bad])
def test_a_refused_step_changes_nothing_on_any_rank(scenarios, label):
    """A bad adjust_lr_fn set in group 1 after step 1 (on every rank; or on rank 3 alone, whose shard of that
    group's only matrix is empty): the next step raises on every rank, and every parameter and state tensor is
    bit-identical to what it was before the step, on every rank."""
    results, _ = scenarios
    ranks = results[label]
    assert len(ranks) == 4 and all(r["unchanged"] is True for r in ranks)
    assert all(r["error"] for r in ranks)
    said = ("Adjust learning rate function bogus is not supported: param group 1 (muon): adjust_lr_fn must be None or "
            "one of original, match_rms_adamw, spectral_unclamped (got 'bogus')")
    culprits = range(4) if label == "refused 4x1" else [3]
    told = f"rank {max(culprits)} refused the step (it raised why); nothing changed"  # the highest refusing rank
    assert [r["error"] for r in ranks] == [f"rank {r['rank']}: {said}" if r["rank"] in culprits else told
                                           for r in ranks]
    assert muon_tools.is_secondhand(told) and not muon_tools.is_secondhand(said)  # the launcher names a culprit (culprit_failure)
    assert ranks[3]["params"]["b"].numel() == 0  # rank 3 holds nothing of group 1's matrix


def test_hsdp_replicas_get_identical_updates_and_newton_schulz_runs_once_per_matrix(scenarios, reference):
    """Real fully_shard(mesh=mesh["replicate", "dp"]) x TP on a 2x2x2 mesh: bit-identical to torch on every rank
    (so both replicas of every shard hold the same bits), and every matrix orthogonalized by one rank of 8."""
    results, runs = scenarios
    ranks = results["hsdp 2x2x2"]
    assert len(ranks) == 8
    assert ranks[0]["placements"]["layers.0.fc2.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"
    assert_identical(ranks, reference, "hsdp")
    for a, b in zip(ranks[:4], ranks[4:]):  # rank r and r + 4: the same shard on the two replicas
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    owners = ranks[0]["owners"]
    calls = sorted(c["name"] for r in ranks for c in r["ledger"]["compute"] if c["step"] == 3)
    assert calls == sorted(owners) and len(owners) == len(results["4x2"][0]["owners"])


def test_equal_size_groups_in_one_process_and_every_group_checked_at_construction():
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))
    dtensor.DTensorMuon([dict(params=[("a", a)]), dict(params=[("b", b)], algorithm="adamw")])  # == on tensors: gone
    for group, message in [(dict(adjust_lr_fn="bogus"), "param group 1 (muon): adjust_lr_fn must be None or one of"),
                           (dict(lr=-1.0), "param group 1 (muon): lr must be >= 0"),
                           (dict(momentum=1.0), "param group 1 (muon): momentum must be in [0, 1)"),
                           (dict(ns_steps=100), "param group 1 (muon): ns_steps must be in [1, 100)"),
                           (dict(algorithm="adamw", betas=(0.9, 1.0)),
                            "param group 1 (adamw): betas must be in [0, 1)"),
                           (dict(algorithm="adamw", eps=-1e-8), "param group 1 (adamw): eps must be >= 0"),
                           (dict(algorithm="adamw", weight_decay=float("inf")), "param group 1 (adamw): weight_decay")]:
        c = torch.nn.Parameter(torch.randn(3, 3) if group.get("algorithm") != "adamw" else torch.randn(3))
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            dtensor.DTensorMuon([dict(params=[("a", a)]), dict(group, params=[("c", c)])])
    dtensor.DTensorMuon([dict(params=[("a", a)], adjust_lr_fn="spectral_unclamped")])  # torch's third choice


def test_explicit_gather_that_gives_a_wrong_shape_is_refused_on_every_rank_with_nothing_changed(scenarios):
    """Rank 0's gather gives the matrices it owns a row short at step 2: the check after the gather is voted
    on, so every rank raises before redistributing, and the momentum (kept aside until the checks pass) and
    every parameter keep their bits on every rank."""
    results, _ = scenarios
    ranks = results["explicit refused"]
    assert len(ranks) == 8 and all(r["unchanged"] is True for r in ranks)
    owned = sorted(n for n, o in ranks[0]["owners"].items() if o == 0)
    assert owned and ranks[0]["error"].startswith(f"rank 0: gather gave {owned[0]} as (")
    told = "rank 0 refused the step (it raised why); nothing changed"
    assert [r["error"] for r in ranks[1:]] == [told] * 7


def test_torchs_flattened_optimizer_state_dict_round_trips_in_one_process(tmp_path, reference):
    """StateDictOptions(flatten_optimizer_state_dict=True), torchtitan's setting: saved after step 2, loaded into a
    fresh model and optimizer, step 3 gives torch's parameters (plain tensors, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    options, cfg = StateDictOptions(flatten_optimizer_state_dict=True), DemoConfig()
    torch.set_num_threads(1)
    built = [(model, build_optimizer(model, cfg)) for model in (DemoModel(cfg), DemoModel(cfg))]
    saved, fresh = built
    for step in (1, 2):
        give_grads(saved[0], cfg, step)
        saved[1].step()
    state = lambda m, o: {"model": m.state_dict(), "optim": get_optimizer_state_dict(m, o, options=options)}
    assert "state.embed.weight.exp_avg" in state(*saved)["optim"]
    dcp.save(state(*saved), checkpoint_id=str(tmp_path), no_dist=True)
    loaded = state(*fresh)
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    fresh[0].load_state_dict(loaded["model"])
    set_optimizer_state_dict(fresh[0], fresh[1], loaded["optim"], options=options)
    give_grads(fresh[0], cfg, 3)
    fresh[1].step()
    for name, p in fresh[0].named_parameters():
        assert torch.equal(p.detach(), reference[name]), name


def test_the_optimizer_stands_on_the_lesson_alone():
    """distmuon/dtensor/ is the optimizer: importing it loads the lesson, not examples/ (no sys.path
    edit) and not its demo (dtensor_run.py, dtensor_verify.py, dtensor_demo.py: the command)."""
    probe = ("import sys, distmuon.dtensor; "
             "print(sorted(m for m in ('examples.train_gpt', 'dtensor_demo', 'dtensor_run', 'dtensor_verify', "
             "'distributed_muon_cpu', 'muon_tools') "
             "if m in sys.modules), "
             "any(p.rstrip('/').endswith('examples') for p in sys.path))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['distributed_muon_cpu']", "False"], out.stdout
    assert not hasattr(dtensor, "DemoConfig") and not hasattr(dtensor, "verdict") and hasattr(dtensor_demo, "main")
