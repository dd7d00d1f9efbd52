"""NorMuon (arXiv 2510.05491; distmuon/normuon.py): the lesson's owner and comm-free strategies and DTensorMuon, bit for
bit against an independent single-device reference written from the paper and its authors' code
(muon_tools.NorMuonReference, built on torch.optim.Muon's own momentum, Newton-Schulz and lr adjustment), on every
grid and mesh: uneven and empty shards, HSDP, expert stacks; its state resumed through a state_dict on the lesson's
grids (the runner's halfway resume) and resharded through torch's checkpoint helpers onto other meshes; the bytes it
adds; and what it refuses.

NorMuon's arithmetic after Newton-Schulz is float32 elementwise on every holder, with the row divisors and the
rescale an owner computed on the whole matrix: no reduction across ranks, so bit for bit is the bar, with no
tolerance."""

import math
from dataclasses import replace

import pytest
import torch

from conftest import GRIDS, grid_config, grid_run, suite_specs
import distributed_muon_cpu
from distmuon import owners
import muon_tools
from distmuon.dtensor import DistributedConfig, DTensorMuon
from dtensor_run import DemoConfig
from dtensor_scenarios import (GROUPS as MUON_GROUPS, Runs, placed_runs, placed_start, run_many_rank,
                               run_placed_reference)
from dtensor_verify import run_reference, verify

STRATEGIES = ("owner", "comm-free")
# every owner strategy on every grid, the 3 x 2 grid with one layer (more ranks than a row's matrices), and overlapped
GRID_RUNS = ([grid_config(dp, tp, strategy=s, normuon=True) for dp, tp in GRIDS for s in STRATEGIES]
             + [grid_config(3, 2, strategy=s, normuon=True, layers=1) for s in STRATEGIES]
             + [grid_config(4, 2, strategy=s, normuon=True, overlap=owners.OVERLAP_DEFAULT) for s in STRATEGIES])


@pytest.mark.parametrize("cfg", GRID_RUNS, ids=lambda c: f"{c.strategy}-{c.dp}x{c.tp}-{c.layers}l-k{c.overlap}")
def test_the_lessons_owner_strategies_are_the_references_bits(run_grid, cfg):
    result = grid_run(run_grid, cfg.dp, cfg.tp, **{k: getattr(cfg, k) for k in ("strategy", "normuon", "layers",
                                                                                 "overlap")})
    assert [c["name"] for c in result["checks"] if not c["identical"]] == []
    assert all(c["max_abs_diff"] == 0 and c["max_abs_update"] > 0 for c in result["checks"]) and result["passed"]


def test_normuon_is_not_muon(run_grid):
    """The check can fail: the NorMuon run's matrices are not torch.optim.Muon's (and its AdamW parameters are)."""
    cfg = grid_config(4, 2, strategy="owner", normuon=True)
    result = grid_run(run_grid, 4, 2, strategy="owner", normuon=True)
    specs = suite_specs()
    muon = muon_tools.reference_params(specs, replace(cfg, normuon=False))
    normuon = muon_tools.reference_params(specs, cfg)
    for s in specs:
        assert torch.equal(muon[s.name], normuon[s.name]) == (s.group != "muon"), s.name
    assert result["passed"]


def test_the_rows_it_sends_are_v_and_g_of_each_matrix(run_grid):
    """Bytes: the owner sends each other holder of a part rows + 1 float32 (v and g) per NorMuon matrix, per step
    ("NorMuon rows"); comm-free's owner row sends the same to the other DP rows ("NorMuon rows broadcast")."""
    for strategy in STRATEGIES:
        cfg = grid_config(4, 2, strategy=strategy, normuon=True)
        result = grid_run(run_grid, 4, 2, strategy=strategy, normuon=True)
        opt = muon_tools.plan_optimizer(cfg)
        specs = {s.name: s for s in suite_specs()}
        rows = {n: specs[n].global_shape[0] + 1 for n in opt.muon_names}
        planned = [0] * 8
        for r in range(8):
            plan = muon_tools.plan_optimizer(cfg, r)
            axis = plan.strategy.axis(plan)
            for route in plan.strategy.routes:
                if axis.ranks[route.owner] == r:
                    planned[r] += 4 * rows[route.name] * sum(p.rank != route.owner for p in route.holders)
        assert result["bytes_per_step"]["NorMuon rows"]["sent"] == planned, strategy
        if strategy == "comm-free":  # each owner row's TP rank to the 3 other DP ranks of its column
            sent = result["bytes_per_step"]["NorMuon rows broadcast"]["sent"]
            owned_rows = [sum(rows[n] for n, o in opt.owners.items() if o // 2 == r // 2) for r in range(8)]
            assert sent == [4 * 3 * owned for owned in owned_rows]


def test_the_reference_balances_the_rows_and_keeps_the_updates_norm():
    """The reference does what the paper says, from zero state: every row of the update the same RMS after the first
    step (v = (1 - beta2) mean_cols(O^2), each row divided by its own root), and the update's Frobenius norm that of
    Muon's O; on a tall, a wide and an odd matrix."""
    for shape in [(48, 16), (16, 48), (37, 11)]:
        g = torch.Generator().manual_seed(sum(shape))
        w = torch.nn.Parameter(torch.randn(shape, generator=g))
        grad = torch.randn(shape, generator=g)
        start = w.detach().clone()
        w.grad = grad
        muon_tools.NorMuonReference([w], lr=1.0, weight_decay=0.0, momentum=0.9,
                                    adjust_lr_fn="spectral_unclamped").step()
        update = (start - w.detach()) / math.sqrt(shape[0] / shape[1])
        o = torch.optim._muon._zeropower_via_newtonschulz(grad.lerp(torch.zeros(shape).lerp_(grad, 0.1), 0.9),
                                                          distributed_muon_cpu.NS_COEFFICIENTS, distributed_muon_cpu.NS_STEPS,
                                                          distributed_muon_cpu.NS_EPS).float()
        rms = update.square().mean(dim=1).sqrt()
        assert (rms.max() - rms.min()) / rms.mean() < 1e-5, shape
        assert math.isclose(update.norm().item(), o.norm().item(), rel_tol=1e-5), shape


# DTensorMuon: the param groups and meshes of tests/test_dtensor.py (every adjust_lr_fn, Nesterov off, another
# ns_steps, an empty shard of a group's only matrix, HSDP, expert stacks over ep with TP inside, 6 experts over 4
# ranks with one rank empty), their Muon groups NorMuon's, one with its own beta2 and normuon_eps; and the demo
# model's runs, a checkpoint saved on 2 x 2 and resumed on 4 x 1 and 1 x 2.
def normuon(groups):
    return tuple(tuple(("algorithm", "normuon") if k == "algorithm" and v == "muon" else (k, v) for k, v in g)
                 + ((("beta2", 0.8), ("normuon_eps", 1e-6)) if i == 1 else ()) for i, g in enumerate(groups))


GROUPS = normuon(MUON_GROUPS)
PLACED = placed_runs(GROUPS)


@pytest.fixture(scope="module")
def dtensor_runs(tmp_path_factory):
    """{label: every rank's result} of DTensorMuon with NorMuon groups: ONE spawn of 8 ranks."""
    saved = str(tmp_path_factory.mktemp("normuon_checkpoint"))
    runs = dict(PLACED)
    runs["demo 4x2"] = DemoConfig(dp=4, tp=2, normuon=True)
    runs["demo 3x2, uneven strided"] = DemoConfig(dp=3, tp=2, experts=7, normuon=True)
    runs["demo 2x2, saved"] = DemoConfig(dp=2, tp=2, normuon=True, checkpoint=saved, checkpoint_step=1)
    for dp, tp in [(4, 1), (1, 2)]:
        runs[f"resumed on {dp}x{tp}"] = DemoConfig(dp=dp, tp=tp, normuon=True, resume=saved, resume_step=1)
    results = muon_tools.spawn_ranks(Runs(tuple(runs.values()), timeout_s=60), run_many_rank)
    return {label: [r[i] for r in results if r[i] is not None] for i, label in enumerate(runs)}, runs


@pytest.mark.parametrize("label", list(PLACED))
def test_dtensor_muon_is_the_references_bits_on_every_mesh(dtensor_runs, label):
    results, runs = dtensor_runs
    run, ranks = runs[label], results[label]
    reference, start = run_placed_reference(run), placed_start(run)
    assert all(not torch.equal(reference[n], start[n]) for n in reference)
    for r in ranks:
        for name, local in r["params"].items():
            assert torch.equal(local.reshape(-1), reference[name].reshape(-1)[r["where"][name]]), (label, name)
    if label.startswith("ep 4"):  # one rank holds no expert: it is on the mesh, and it holds v, unused
        assert [r["params"]["w1"].shape[0] for r in ranks] == [2, 2, 2, 0]


@pytest.mark.parametrize("label", ["demo 4x2", "demo 3x2, uneven strided", "resumed on 4x1", "resumed on 1x2"])
def test_dtensor_muon_demo_runs_and_resumed_checkpoints_are_the_references_bits(dtensor_runs, label):
    """The demo model (FSDP2 x TP, expert stacks), and a checkpoint of NorMuon's state (momentum and v, DTensors
    like their parameters) saved on 2 x 2 after step 1, loaded through torch's helpers on 4 x 1 and 1 x 2, stepped
    on: every element the reference's, which runs all the steps in one process."""
    results, runs = dtensor_runs
    cfg = runs[label]
    checks = verify(cfg, results[label], run_reference(replace(cfg, resume="", resume_step=0)))
    assert [c["name"] for c in checks if not c["identical"]] == [], label


def test_refusals_in_one_line():
    """What NorMuon cannot take, refused before anything is built, naming why."""
    grid = distributed_muon_cpu.plan_grid(1, 1, 0)
    w = torch.nn.Parameter(torch.zeros(8, 4))
    cases = {
        "gather": (lambda: distributed_muon_cpu.DistributedMuon([dict(params=[("w", w)], algorithm="normuon")], grid=grid),
                   "NorMuon's param groups need strategy Owner() or CommFree()"),
        "beta2": (lambda: owners.OwnerMuon([dict(params=[("w", w)], algorithm="normuon", beta2=1.0)], grid=grid),
                  "param group 0 (normuon): beta2 must be in [0, 1) (got 1.0)"),
        "eps": (lambda: owners.OwnerMuon([dict(params=[("w", w)], algorithm="normuon", normuon_eps=0.0)], grid=grid),
                "param group 0 (normuon): normuon_eps must be > 0 (got 0.0)"),
        "an option of none": (lambda: owners.OwnerMuon([dict(params=[("w", w)], algorithm="normuon", betas=(0.9, 0.9))],
                                                   grid=grid),
                              "param group 0 (normuon): betas: not an option of NorMuon"),
        "explicit": (lambda: DTensorMuon([dict(params=[("w", w)], algorithm="normuon")], distributed_config=
                                         DistributedConfig(gather=lambda u, o: u, redistribute=lambda o, w: o,
                                                           global_shapes={"w": (8, 4)})),
                     "NorMuon's param groups need the automatic distributed_config"),
        "gram": (lambda: DTensorMuon([dict(params=[("w", w)], algorithm="normuon")], tp_newton_schulz="gram"),
                 "tp_newton_schulz='gram' applies to Muon's matrices"),
        "batched, lesson": (lambda: owners.CommFreeMuon([dict(params=[("w", w)], algorithm="normuon")], grid=grid,
                                                    batched_ns=True),
                            "batched_ns applies to Muon's matrices: NorMuon's (w) divide each row by its own RMS"),
        "batched, DTensor": (lambda: DTensorMuon([dict(params=[("w", w)], algorithm="normuon")], batched_ns=True),
                             "batched_ns applies to Muon's matrices: NorMuon's (w) divide each row by its own RMS"),
    }
    for case, (build, message) in cases.items():
        with pytest.raises(ValueError) as refused:
            build()
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value), (case, refused.value)
    with pytest.raises(ValueError, match="^--normuon applies to --strategy owner or comm-free"):
        muon_tools.validate(muon_tools.RunConfig(normuon=True), muon_tools.demo_specs(muon_tools.RunConfig()))
    with pytest.raises(ValueError, match="^--ns-blocks heads applies to Muon's matrices"):
        muon_tools.validate(muon_tools.RunConfig(normuon=True, strategy="owner", ns_blocks="heads"),
                            muon_tools.demo_specs(muon_tools.RunConfig()))
    with pytest.raises(ValueError, match="^--batched-ns applies to Muon's matrices: NorMuon divides each row"):
        muon_tools.validate(muon_tools.RunConfig(normuon=True, strategy="owner", batched_ns=True),
                            muon_tools.demo_specs(muon_tools.RunConfig()))


def test_a_refused_param_group_changes_nothing():
    """add_param_group of a NorMuon group that batched_ns refuses leaves the optimizer as it was, and it still steps."""
    grid = distributed_muon_cpu.plan_grid(1, 1, 0)
    w, extra = torch.nn.Parameter(torch.ones(8, 4)), torch.nn.Parameter(torch.ones(6, 4))
    opt = owners.OwnerMuon([dict(params=[("w", w)], algorithm="muon")], grid=grid, batched_ns=True)
    groups, owner_of = len(opt.param_groups), dict(opt.owners)
    with pytest.raises(ValueError, match="^batched_ns applies to Muon's matrices"):
        opt.add_param_group(dict(params=[("extra", extra)], algorithm="normuon"))
    assert (len(opt.param_groups), opt.owners, list(opt.param_by_name)) == (groups, owner_of, ["w"])
    w.grad = torch.full_like(w, 2.0**-3)
    opt.step()
    assert not torch.equal(w, torch.ones(8, 4)) and extra.grad is None
