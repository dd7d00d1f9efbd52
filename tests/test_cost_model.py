"""benchmarks/cost_model.py: its bytes, FLOPs and state are what real runs' Ledgers record, exactly, on every
grid the tests run (the lesson's strategies and AdamW ZeRO-1 from the suite's own spawns, run_grid; DTensorMuon
from one spawn of 8 ranks here: FSDP2 x TP meshes, HSDP, expert parallelism); its sizes-only DTensor plan is
DTensorMuon's own plan_matrices (its routes are every rank's transfers); and its alpha-beta prices are the stated
formulas.
Its times are never checked against a clock: --check-here prints their error."""

import collections
from dataclasses import replace
import itertools
import os
import sys

import pytest
import torch

from conftest import BUCKET, GRIDS, ROOT, grid_config, grid_run, suite_config
import distributed_muon_cpu
from distmuon import owners
import muon_tools

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import cost_model  # noqa: E402
from distmuon import dtensor  # noqa: E402
from distmuon.dtensor import placements  # noqa: E402
from distmuon.dtensor import plan  # noqa: E402
from dtensor_run import DemoConfig, DemoModel, is_muon  # noqa: E402
from dtensor_scenarios import PLACEMENT, PlacedRun, Runs, run_many_rank  # noqa: E402

# the strategies' runs, checked here too
from test_strategies import BASELINE_GRIDS, LESSON_RUNS, OVERLAPPED, UNEVEN  # noqa: E402

ONE_NODE = lambda rank: 0  # noqa: E731
GRAM_TPS = [2, 4]
# NorMuon (notes/14-normuon.md) on the grids where its rows move over TP, over DP and over both, and with more ranks
# than a row's matrices: runs of tests/test_normuon.py, so in the whole suite they cost the planning alone
NORMUON_RUNS = [grid_config(dp, tp, strategy=s, normuon=True, **config)
                for s in owners.strategies_where(lambda c: c.holds_rows)  # NorMuon needs an owner of whole rows
                for dp, tp, config in [(4, 2, {}), (2, 4, {}), (8, 1, {}), (3, 2, dict(layers=1))]]
# the owner strategies overlapped (more, smaller collectives: one exchange per unit), tests/test_strategies.py's runs
OVERLAP_RUNS = [grid_config(dp, tp, strategy=s, overlap=owners.OVERLAP_DEFAULT) for s, dp, tp in OVERLAPPED]
GRID_RUNS = (LESSON_RUNS + NORMUON_RUNS + OVERLAP_RUNS
             + [suite_config(dp=1, tp=tp, steps=1, tp_newton_schulz="gram") for tp in GRAM_TPS])


def calls_per_step(ledgers, step, phases):
    """{phase: [collective calls of each rank]} in one step: one Ledger record a call."""
    return {p: [sum(r["step"] == step and r["phase"] == p for r in ledger["comm"]) for ledger in ledgers]
            for p in phases}


def assert_ledger_is_the_model(result, cfg):
    """The model of cfg's optimizer (built on meta tensors, no process) against the run's Ledgers."""
    cost = cost_model.lesson_cost(cost_model.lesson_optimizer(muon_tools.demo_specs(cfg), cfg), ONE_NODE)
    real = result["bytes_per_step"]
    assert result["bytes_same_every_step"]
    assert set(cost.traffic.phases) <= set(real), set(cost.traffic.phases) - set(real)
    assert cost.traffic.table(list(real)) == real  # every phase, axis, dtype, rank: sent and received
    # and as many collective calls, each priced with its fixed cost (--check-here)
    assert cost.traffic.calls_table(list(real)) == calls_per_step(result["ledgers"], cfg.steps, real)
    assert cost.ns_flops == result["ns_flops"]["per_rank"]
    assert cost.calls["ns"] == [sum(c["step"] == cfg.steps for c in led["compute"]) for led in result["ledgers"]]
    assert cost.state_bytes == result["state_bytes"]
    return cost


@pytest.mark.parametrize("strategy", owners.STRATEGIES)
@pytest.mark.parametrize("dp,tp", GRIDS)
def test_lesson_strategies_bytes_flops_and_state_are_the_ledgers(run_grid, dp, tp, strategy):
    cost = assert_ledger_is_the_model(grid_run(run_grid, dp, tp, strategy=strategy),
                                      grid_config(dp, tp, strategy=strategy))
    if dp * tp > 1:  # a test that cannot fail is a defect: these grids move bytes
        assert sum(cost.traffic.phases["grad presence"].sent) > 0


@pytest.mark.parametrize("strategy", owners.STRATEGIES)
@pytest.mark.parametrize("dp,tp,config", UNEVEN)
def test_uneven_cases_are_the_ledgers(run_grid, dp, tp, config, strategy):
    assert_ledger_is_the_model(grid_run(run_grid, dp, tp, strategy=strategy, **config),
                               grid_config(dp, tp, strategy=strategy, **config))


@pytest.mark.parametrize("dp,tp", BASELINE_GRIDS)
def test_adamw_zero1_baseline_is_the_ledger(run_grid, dp, tp):
    cost = assert_ledger_is_the_model(grid_run(run_grid, dp, tp, baseline=True),
                                      grid_config(dp, tp, baseline=True))
    assert sum(cost.ns_flops) == 0


@pytest.mark.parametrize("tp", GRAM_TPS)
def test_the_gram_form_is_the_ledger(run_grid, tp):
    cost = assert_ledger_is_the_model(run_grid(1, tp, steps=1, tp_newton_schulz="gram"),
                                      suite_config(dp=1, tp=tp, steps=1, tp_newton_schulz="gram"))
    assert sum(cost.traffic.phases["TP Gram"].sent) > 0


@pytest.mark.parametrize("cfg", NORMUON_RUNS, ids=lambda c: f"{c.strategy}-{c.dp}x{c.tp}-{c.layers}l")
def test_normuon_rows_and_state_are_the_ledgers(run_grid, cfg):
    """NorMuon's v and g (rows + 1 float32 a matrix, to every other holder of a part; comm-free's owner rows also to
    the other DP rows) and its v at the owner (state): phase by phase, rank by rank, as the runs record them."""
    result = grid_run(run_grid, cfg.dp, cfg.tp, strategy=cfg.strategy, normuon=True, layers=cfg.layers)
    cost = assert_ledger_is_the_model(result, cfg)
    moved = {p for p, t in cost.traffic.phases.items() if p.startswith("NorMuon") and sum(t.sent)}
    expected = ({"NorMuon rows"} if cfg.strategy == "owner" or cfg.tp > 1 else set()) | (
        {"NorMuon rows broadcast"} if cfg.strategy == "comm-free" and cfg.dp > 1 else set())
    assert moved == expected  # a test that cannot fail is a defect: these grids move NorMuon's rows
    plain = cost_model.lesson_cost(cost_model.lesson_optimizer(muon_tools.demo_specs(cfg), replace(cfg, normuon=False)), ONE_NODE)
    assert sum(cost.state_bytes) > sum(plain.state_bytes)  # v: one float32 per row of each matrix, at its owner


@pytest.mark.parametrize("cfg", OVERLAP_RUNS, ids=lambda c: f"{c.strategy}-{c.dp}x{c.tp}")
def test_overlapped_steps_are_the_ledgers(run_grid, cfg):
    cost = assert_ledger_is_the_model(grid_run(run_grid, cfg.dp, cfg.tp, strategy=cfg.strategy, overlap=cfg.overlap),
                                      cfg)
    plain = cost_model.lesson_cost(cost_model.lesson_optimizer(muon_tools.demo_specs(cfg), replace(cfg, overlap=0)),
                                   ONE_NODE)
    assert cost.traffic.table() == plain.traffic.table()  # the same bytes, in more calls
    assert sum(map(sum, cost.traffic.calls_table().values())) > sum(map(sum, plain.traffic.calls_table().values()))


def test_a_wrong_plan_fails_the_comparison(run_grid):
    """The comparison bites: the model of another bucket size, or of another strategy, is not the Ledger."""
    result = grid_run(run_grid, 3, 2, strategy="owner")
    for cfg in (replace(grid_config(3, 2, strategy="owner"), bucket_size=BUCKET // 2),  # the run's, but for one thing
                grid_config(3, 2, strategy="comm-free")):
        with pytest.raises(AssertionError):
            assert_ledger_is_the_model(result, cfg)


# -- DTensorMuon -------------------------------------------------------------------------------------------

def demo_params(cfg):
    """The demo model (dtensor_run.DemoModel) as the cost model's Params: its TP roles are dtensor_run.parallelize's."""
    out = []
    for n, p in DemoModel(cfg).named_parameters():
        role = ("expert" if p.ndim == 3 else "col" if ".fc1." in n else "row" if n.endswith("fc2.weight")
                else "replicate" if n.endswith("fc2.bias") else None)
        group = "muon" if is_muon(n, p.ndim) else "adamw" if n.startswith(("embed.", "head.")) else "adamw_no_wd"
        out.append(cost_model.Param(n, tuple(p.shape), role, group))
    return out


def demo_copies(cfg):
    mesh = cost_model.Mesh(cfg.dp, cfg.tp, cfg.replicate)
    return cost_model.placed_copies(cost_model.param_order(demo_params(cfg), cost_model.GROUPS), mesh,
                                    {g: i for i, g in enumerate(cost_model.GROUPS)})


def placed_copies(run):
    """A PlacedRun's parameters as Copies: the placements it gives them, on its whole mesh."""
    ranks = tuple(range(torch.Size(run.mesh).numel()))
    return [plan.Copy(n, g, shape, ranks, run.mesh, tuple(PLACEMENT[k] for k in where), n in run.expert_stacks,
                    run.dims) for g in range(len(run.groups)) for n, shape, where, group in run.params if group == g]


DEMO_MESHES = [(8, 1), (4, 2), (2, 4), (1, 8), (3, 2)]
DEMO_STEPS = 1
MUON_ONLY = ((("algorithm", "muon"),),)  # one param group, torch.optim.Muon's defaults
NORMUON_ONLY = ((("algorithm", "normuon"),),)  # one param group, NorMuon's defaults


def expert_runs(groups, prefix=""):
    return {f"{prefix}ep 2 x tp 2": PlacedRun((2, 2), ("ep", "tp"), (("w1", (4, 6, 4), ("S0", "S1"), 0),
                                                                      ("w2", (4, 4, 6), ("S0", "S2"), 0)),
                                               groups, expert_stacks=("w1", "w2"), steps=DEMO_STEPS),
            f"{prefix}ep 4, 6 experts": PlacedRun((4,), ("ep",), (("w1", (6, 5, 4), ("S0",), 0),
                                                                      ("w2", (6, 4, 5), ("S0",), 0)),
                                                   groups, expert_stacks=("w1", "w2"), steps=DEMO_STEPS)}


# NorMuon's rows (v and g of each matrix, to every rank holding its v) and its v: on TP x FSDP2, an uneven mesh with
# expert stacks, HSDP, and experts over ep (one rank holding none, and its v)
PLACED = {**expert_runs(MUON_ONLY), **expert_runs(NORMUON_ONLY, "normuon ")}
DEMO_RUNS = {**{f"{dp}x{tp}": DemoConfig(dp=dp, tp=tp, steps=DEMO_STEPS) for dp, tp in DEMO_MESHES},
             "hsdp 2x2x2": DemoConfig(replicate=2, dp=2, tp=2, steps=DEMO_STEPS),
             "normuon 4x2": DemoConfig(dp=4, tp=2, steps=DEMO_STEPS, normuon=True),
             "normuon 3x2, 7 experts": DemoConfig(dp=3, tp=2, experts=7, steps=DEMO_STEPS, normuon=True),
             "normuon hsdp 2x2x2": DemoConfig(replicate=2, dp=2, tp=2, steps=DEMO_STEPS, normuon=True)}


def case_copies():
    """{label: (copies, {group: algorithm}, world)} of every DTensor case checked here."""
    def algorithms(normuon):
        return {i: ("normuon" if normuon else "muon") if g == "muon" else "adamw" for i,
                g in enumerate(cost_model.GROUPS)}

    cases = {label: (demo_copies(cfg), algorithms(cfg.normuon), cfg.replicate * cfg.dp * cfg.tp)
             for label, cfg in DEMO_RUNS.items()}
    cases.update({label: (placed_copies(run), {0: dict(run.groups[0])["algorithm"]}, torch.Size(run.mesh).numel())
                  for label, run in PLACED.items()})
    return cases


def chunked_indices(shape, mesh_shape, where, coordinate):
    """The oracle: the global flat index of each element a rank holds, by torch.chunk on a tensor of every index
    (uneven and empty chunks as FSDP2 cuts them), one cut after another in split_order."""
    index = torch.arange(torch.Size(shape).numel()).view(shape)
    for i in placements.split_order(where):
        chunks = list(torch.chunk(index, mesh_shape[i], dim=where[i].dim))
        chunks += [chunks[0].narrow(where[i].dim, 0, 0)] * (mesh_shape[i] - len(chunks))
        index = chunks[coordinate[i]]
    return index.reshape(-1)


def test_every_piece_of_the_cut_is_torch_chunks_elements():
    """The plan's Cut (ranges per tensor dim, every rank at once) holds, for every rank, the elements torch.chunk
    gives it, in its local order; so does local_indices (one rank, from local_box); uneven and empty shards too."""
    checked = 0
    for copies, _, _ in case_copies().values():
        for c in copies:
            if not c.mesh_ranks:
                continue
            cut = plan.cut_of_copy(c)
            for rank, coordinate in zip(c.mesh_ranks, itertools.product(*[range(n) for n in c.mesh_shape])):
                k, _ = cut.position(rank)
                box = [torch.arange(a, b) for a, b in zip(cut.starts[k].tolist(), cut.stops[k].tolist())]
                grid = torch.arange(torch.Size(c.shape).numel()).view(c.shape)[torch.meshgrid(*box, indexing="ij")]
                expected = chunked_indices(c.shape, c.mesh_shape, c.placements, coordinate)
                assert torch.equal(grid.reshape(-1), expected), (c.name, coordinate)
                assert torch.equal(dtensor.local_indices(c.shape, c.mesh_shape, c.placements, coordinate), expected)
                checked += expected.numel() == 0
    assert checked > 0  # some empty shards among them


def test_every_rank_plans_its_own_routes_and_each_matrix_is_tiled_once():
    """Owners and FLOPs are the same on every rank; each rank's transfers (plan_matrices, as it runs on that rank)
    are its own of routes() (what the cost model prices); and the boxes a matrix's owner receives cover each
    element of it exactly once."""
    moved = 0
    for label, (copies, algorithms, world) in case_copies().items():
        muon = [c for c in copies if algorithms[c.group] != "adamw"]
        steps = {g: distributed_muon_cpu.NS_STEPS for g in algorithms}
        matrices, flops, owners = cost_model.dtensor_plan(muon, steps, world)
        gather, scatter = cost_model.dtensor_transfers(matrices)
        ours = [collections.Counter(t for t in zip(*(x.tolist() for x in moves)) if t[0] != t[1])
                for moves in (gather, scatter)]
        theirs = [collections.Counter(), collections.Counter()]
        for me in range(world):
            planned, their_flops, their_owners = plan.plan_matrices(muon, steps, me, world)
            assert their_owners == owners and their_flops == flops, label
            for m in planned:
                for counter, moves in zip(theirs, (m.gather, m.scatter)):
                    counter.update((s, d, n) for s, d, n, *_ in moves if s == me != d)
                if m.owner == me:
                    covered = torch.zeros(m.shape, dtype=torch.int64)
                    for _, _, numel, _, box in m.gather:
                        part = covered[tuple(slice(a, b) for a, b in box)]
                        assert part.numel() == numel, (label, m.name)
                        part += 1
                    assert bool((covered == 1).all()), (label, m.name)
        assert ours == theirs, label
        moved += sum(ours[0].values())
    assert moved > 0  # (whole experts on their own ranks move nothing: "ep 4, 6 experts")


@pytest.fixture(scope="module")
def dtensor_runs():
    """{label: [each rank's result]}: the demo on every DTENSOR mesh and the expert-parallel placed runs, one
    spawn of 8 ranks (each run on its own sub-mesh), DEMO_STEPS steps of exact gradients."""
    runs = {**DEMO_RUNS, **PLACED}
    results = muon_tools.spawn_ranks(Runs(tuple(runs.values()), timeout_s=60), run_many_rank)
    return {label: [r[i] for r in results if r[i] is not None] for i, label in enumerate(runs)}


def test_dtensor_bytes_flops_owners_and_state_are_the_ledgers(dtensor_runs):
    rows_moved = 0
    for label, (copies, algorithms, world) in case_copies().items():
        ranks = sorted(dtensor_runs[label], key=lambda r: r["rank"])
        assert len(ranks) == world, label
        names = [c.name for c in copies]
        cost = cost_model.dtensor_cost(copies, names, algorithms,
                                       {g: distributed_muon_cpu.NS_STEPS for g in algorithms}, world, ONE_NODE)
        ledgers = [r["ledger"] for r in ranks]
        step = max(rec["step"] for rec in ledgers[0]["comm"])
        phases = ("grad presence", "gather at owner", "scatter from owner") + (
            ("NorMuon rows",) if "normuon" in algorithms.values() else ())
        assert cost.traffic.table(phases) == muon_tools.bytes_per_step(ledgers, step, phases), label
        assert cost.traffic.calls_table(phases) == calls_per_step(ledgers, step, phases), label
        assert {p for rec in ledgers[0]["comm"] for p in [rec["phase"]]} <= set(phases) | {"refusal"}, label
        rows_moved += sum(cost.traffic.phases["NorMuon rows"].sent) if "NorMuon rows" in cost.traffic.phases else 0
        assert cost.ns_flops == [sum(c["flops"] for c in led["compute"] if c["step"] == step) for led in ledgers]
        assert sum(sum(t.sent) for t in cost.traffic.phases.values()) > 0 or world == 1, label
        for r in ranks:  # torch's own placements are the ones the model assumed, parameter by parameter
            for name, placed in r["placements"].items():
                mine = next(c for c in copies if c.name == name and (not c.mesh_ranks or r["rank"] in c.mesh_ranks))
                assert placed == str(tuple(mine.placements)), (label, name)
            if "state_bytes" in r:
                assert cost.state_bytes[r["rank"]] == r["state_bytes"], label
        matrices, _, owners = cost_model.dtensor_plan([c for c in copies if algorithms[c.group] != "adamw"],
                                              {g: distributed_muon_cpu.NS_STEPS for g in algorithms}, world)
        assert ranks[0]["owners"] == owners, label
    assert rows_moved > 0  # the NorMuon cases move its rows


# -- prices --------------------------------------------------------------------------------------------------

CLUSTER = cost_model.Cluster("test", gpus_per_node=2, intra_gbs=100.0, inter_gbs=10.0, intra_us=1.0, inter_us=10.0,
                     ns_tflops=1.0, train_tflops=1.0, hbm_gbs=1000.0, muon_bytes=24, adamw_bytes=28)


def test_a_ring_pays_its_slowest_link_and_an_all_to_all_each_link_apart():
    traffic = cost_model.Traffic(4, lambda r: r // 2)  # ranks 0, 1 on node 0; 2, 3 on node 1
    traffic.all_gather("inside", "TP", torch.bfloat16, [[0, 1], [2, 3]], 1000)
    traffic.all_gather("across", "DP", torch.float32, [[0, 2], [1, 3]], 1000)
    inside, across = traffic.phases["inside"], traffic.phases["across"]
    assert inside.sent == [2000] * 4 and across.sent == [4000] * 4  # the Ledger's ring count, (n - 1) x shard
    assert inside.seconds(0, CLUSTER) == pytest.approx(1e-6 + 2000 / 100e9)
    assert across.seconds(0, CLUSTER) == pytest.approx(10e-6 + 4000 / 10e9)
    traffic.all_to_all("mixed", "world", torch.bfloat16, [0, 0, 1, 2], [1, 2, 0, 0], [500, 100, 7, 3])
    mixed = traffic.phases["mixed"]
    assert mixed.sent == [1200, 14, 6, 0] and mixed.received == [20, 1000, 200, 0]
    # rank 0: 1000 B to rank 1 (its node) and 14 B back; 200 B to rank 2 and 6 B back: one message each way
    assert mixed.seconds(0, CLUSTER) == pytest.approx(max(1e-6 + 1000 / 100e9, 10e-6 + 200 / 10e9))
    traffic.all_reduce("vote", "world", torch.uint8, [[0, 1, 2, 3]], 10)
    assert traffic.phases["vote"].sent == [2 * 3 * 3] * 4  # 2 (n - 1) ceil(10 / 4)
    # ... at a tree's latency where that is fewer steps: 2 log2 4 = 4 against the ring's 2 (4 - 1) = 6
    assert traffic.phases["vote"].seconds(0, CLUSTER) == pytest.approx(4 * 10e-6 + 18 / 10e9)


def test_the_step_is_communication_plus_compute_and_overlap_the_larger():
    traffic = cost_model.Traffic(2, ONE_NODE)
    traffic.all_gather("p", "DP", torch.float32, [[0, 1]], 250)  # 1000 B: 1 us + 10 ns
    cost = cost_model.Cost("x", traffic, [2e6, 1e6], [0, 0], {"muon": [1000, 0], "adamw": [0, 0]}, 2)
    row = cost_model.summarize(cost, CLUSTER)
    compute = 2e6 / 1e12 + 1000 * 24 / 1000e9
    assert row.comm_s == pytest.approx(1e-6 + 1000 / 100e9) and row.compute_s == pytest.approx(compute)
    assert row.step_s == pytest.approx(row.comm_s + compute) and row.overlap_s == pytest.approx(max(row.comm_s, compute))
    two = cost_model.summarize(cost, replace(CLUSTER, in_flight=2))  # two collectives in flight at once, overlapped
    assert two.step_s == row.step_s and two.overlap_s == pytest.approx(max(row.comm_s / 2, compute))
    assert row.ns_max == 2e6 and row.ns_mean == 1.5e6


def test_the_chapters_models_have_their_published_sizes():
    """The shapes are the models': Llama 3 8B and 70B, DeepSeek-V3's 671 B (37 B active), GPT-2's 124 M."""
    sizes = {name: (m.total_params(), m.active_params()) for name, m in cost_model.MODELS.items()}
    assert sizes["gpt2-small"][0] == pytest.approx(124.5e6, rel=0.01)  # nanoGPT's 124M with a 50,304 vocabulary
    assert sizes["llama3-8b"][0] == pytest.approx(8.03e9, rel=0.005)
    assert sizes["llama3-70b"][0] == pytest.approx(70.6e9, rel=0.005)
    assert sizes["deepseek-v3"] == (pytest.approx(671e9, rel=0.01), pytest.approx(37e9, rel=0.03))


def test_gpt2_small_on_8_gpus_ranks_the_strategies_as_chapter_8_measures():
    """GPT-2 small's shapes (2 of its layers) at DP 8: comm-free moves fewer bytes than AdamW ZeRO-1 (chapter 8's rule at TP = 1), the owner
    strategies orthogonalize each matrix once (no more FLOPs than gather), DTensorMuon's step moves the least."""
    two_layers = replace(cost_model.MODELS["gpt2-small"], layers=2)  # the same shapes, fewer of them: a cheap plan
    rows, fwd_bwd, costs = cost_model.predict(cost_model.Scenario(two_layers, 8), cost_model.H100)
    by = {r.label: r for r in rows}
    assert by["comm-free"].sent_max < by["AdamW ZeRO-1"].sent_max < by["gather"].sent_max
    assert sum(costs["owner"].ns_flops) == sum(costs["comm-free"].ns_flops) == costs["owner"].single_device_flops
    assert sum(costs["gather"].ns_flops) > sum(costs["owner"].ns_flops)
    assert by["DTensorMuon"].sent_max < by["owner"].sent_max and fwd_bwd > 0


def test_attention_is_palms_term_in_the_forward_and_backward():
    """6 x active parameters x tokens, plus attention's two products with the sequence: 12 L H Q T per token with
    equal query and value heads (PaLM, Appendix B), 6 L H T (qk + v) with MLA's (DeepSeek-V3: 192 and 128)."""
    llama, deepseek = cost_model.MODELS["llama3-70b"], cost_model.MODELS["deepseek-v3"]
    assert llama.attention_flops_per_token() == 12 * 80 * 64 * 128 * 4096
    assert deepseek.attention_flops_per_token() == 6 * 61 * 128 * 4096 * (128 + 64 + 128)
    assert llama.train_flops() == (6 * llama.active_params() + 12 * 80 * 64 * 128 * 4096) * 2**22
    s = cost_model.Scenario(llama, 64, tp=8)
    assert cost_model.forward_backward_seconds(s, CLUSTER) == pytest.approx(llama.train_flops() / (64 * 1e12))
    marin = cost_model.MODELS["marin-moe-d2560"]  # issue 6044's d2560 shape, 64 experts: its 2.34 B active at 256 (routers,
    assert marin.active_params() == pytest.approx(2.34e9, rel=0.03)  # gated norms aside)
    assert cost_model.mfu_with(0.344, 2.0, 0.0) == 0.344 and cost_model.mfu_with(0.344, 2.0, 0.25) == pytest.approx(0.344 * 2 / 2.25)


def test_the_flat_buffer_gives_the_issues_figures():
    """Issue 43: with one bucket per buffer, the 70B-like model at 64 GPUs moves 1.49 x AdamW ZeRO-1's bytes in the
    gather flow and takes 3.06 x its step, not 2.99 x and 14.1 x as with Megatron's 40M-element buckets: fewer ranks
    touch each matrix, so fewer TP gathers and Newton-Schulz calls, the same DP gather."""
    labels = ("gather", "gather" + cost_model.FLAT, "AdamW ZeRO-1", "AdamW ZeRO-1" + cost_model.FLAT)
    costs = cost_model.predict_costs(cost_model.Scenario(cost_model.MODELS["llama3-70b"], 64, tp=8), cost_model.H100,
                                     labels)
    row = {k: cost_model.summarize(c, cost_model.H100) for k, c in costs.items()}
    flat, bucketed = row["gather" + cost_model.FLAT], row["gather"]
    assert flat.sent_max / row["AdamW ZeRO-1" + cost_model.FLAT].sent_max == pytest.approx(1.49, abs=0.005)
    assert flat.step_s / row["AdamW ZeRO-1" + cost_model.FLAT].step_s == pytest.approx(3.06, abs=0.005)
    assert bucketed.sent_max / row["AdamW ZeRO-1"].sent_max == pytest.approx(2.99, abs=0.005)
    assert bucketed.step_s / row["AdamW ZeRO-1"].step_s == pytest.approx(14.1, abs=0.05)
    gathered = {k: costs[k].traffic.phases["DP gather"].sent for k in labels[:2]}
    assert sum(gathered["gather"]) == sum(gathered["gather" + cost_model.FLAT])  # each rank's shard of the whole buffer, once
    assert sum(costs["gather" + cost_model.FLAT].calls["ns"]) < sum(costs["gather"].calls["ns"])


def test_normuon_rows_join_a_scenario_when_asked():
    """--normuon: owner, comm-free and DTensorMuon again with NorMuon's matrices, whose rows move besides Muon's bytes."""
    two_layers = replace(cost_model.MODELS["gpt2-small"], layers=2)
    plain = cost_model.predict_costs(cost_model.Scenario(two_layers, 8), cost_model.H100)
    costs = cost_model.predict_costs(cost_model.Scenario(two_layers, 8, normuon=True), cost_model.H100)
    assert set(costs) - set(plain) == {"owner, NorMuon", "comm-free, NorMuon", "DTensorMuon, NorMuon"}
    for label in ("owner", "DTensorMuon"):
        extra = costs[label + cost_model.NORMUON].traffic.phases["NorMuon rows"]
        assert sum(extra.sent) > 0 and cost_model.baseline_of(label + cost_model.NORMUON) == cost_model.baseline_of(label)
        sent = lambda c: sum(sum(t.sent) for t in c.traffic.phases.values())  # noqa: E731
        assert sent(costs[label + cost_model.NORMUON]) == sent(plain[label]) + sum(extra.sent)
    # TP = 1: comm-free's owner row holds each matrix whole; its rows go to the other DP rows beside the update
    assert sum(costs["comm-free" + cost_model.NORMUON].traffic.phases["NorMuon rows broadcast"].sent) > 0


def test_per_call_costs_are_priced_as_counted():
    """--check-here's terms: a collective's fixed cost per call and its op's bandwidth; Newton-Schulz calls, parts
    and the bookkeeping per parameter at their unit costs; ranks beyond the cores share them."""
    here = replace(CLUSTER, intra_us=0.0, call_us=(("all_gather", 50.0),), op_gbs=(("all_gather", 2.0),),
                   cpu_call_us=(("all_gather", 30.0),), cpu_gbs=(("all_gather", 1.0),),
                   ns_call_us=40.0, muon_part_us=10.0, adamw_part_us=20.0, apply_us=5.0, param_us=3.0, ns_shared=2.0,
                   cores=1)
    traffic = cost_model.Traffic(2, ONE_NODE)
    for _ in range(3):
        traffic.all_gather("p", "DP", torch.float32, [[0, 1]], 250)  # 1000 B a call, 3 calls
    assert traffic.calls_table() == {"p": [3, 3]}
    assert traffic.phases["p"].terms(0, here) == pytest.approx((0.0, 3000 / 2e9, 3 * 50e-6))
    assert traffic.phases["p"].cpu_seconds(1, here) == pytest.approx(3 * 30e-6 + 3000 / 1e9)
    cost = cost_model.Cost("x", traffic, [2e7, 0], [0, 0], {"muon": [1000, 0], "adamw": [0, 10]}, 2,
                   calls=dict(ns=[1, 0], muon=[1, 0], adamw=[0, 2], apply=[0, 4], params=[7, 7]))
    terms = cost.compute_terms(0, here)
    # Newton-Schulz as when every rank runs it at once: twice as long here
    assert terms == pytest.approx({"NS FLOPs": 2 * 2e7 / 1e12, "NS calls": 2 * 40e-6, "elementwise": 1000 * 24 / 1000e9,
                                   "parts": 10e-6, "bookkeeping": 21e-6})
    other = sum(cost.compute_terms(1, here).values())  # 2 AdamW parts, 4 applies, bookkeeping, its elementwise
    assert other == pytest.approx(40e-6 + 20e-6 + 21e-6 + 10 * 28 / 1000e9)
    row = cost_model.summarize(cost,
                               here)  # rank 0 the busiest; one core for two ranks: at least both ranks' CPU (its own
    cpu = sum(terms.values()) - 2e7 / 1e12 - 40e-6 + other + 2 * (3 * 30e-6 + 3000 / 1e9)  # Newton-Schulz alone)
    assert row.comm_s == pytest.approx(150e-6 + 3000 / 2e9) and row.terms["calls"] == pytest.approx(150e-6)
    assert row.step_s == pytest.approx(cpu) and row.overlap_s == pytest.approx(cpu)
    assert row.terms["shared cores"] == pytest.approx(cpu - row.comm_s - sum(terms.values()))
    assert cost_model.summarize(cost, replace(here, cores=2)).terms["shared cores"] == 0  # a core each: no floor


# -- the command line --------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0"], "--gpus and --tp must be >= 1"),
    (["--model", "llama3-8b", "--gpus", "12"], "TP 8 does not divide 12 GPUs"),
    (["--model", "llama3-8b", "--ep", "8"], "--ep applies to an MoE"),
    (["--model", "deepseek-v3", "--gpus", "96"], "EP 64 must divide the 96 GPUs"),
    (["--json", "x.json"], "--json and --figure go with --chapter"),
    (["--chapter", "--figure", "/no/such/folder/x.png"], "--figure /no/such/folder/x.png: the folder"),
    (["--model", "gpt-5"], "invalid choice"),
    (["--chapter", "--normuon"], "--normuon: one scenario's options"),
    (["--check-here", "--gpus", "8"], "--gpus: one scenario's options"),
    (["--rounds", "3"], "--rounds: only with --check-here"),
    (["--d", "64"], "--d: only with --check-here"),
    (["--gpus", "1000000000", "--tp", "1"], "--gpus 1000000000: at most 16384"),
    (["--chapter", "--check-here"], "separate runs"),
    (["--check-here", "--d", "0"], "must be >= 1"),
    (["--check-here", "--d", "100000000"], "needs at least"),
])
def test_bad_flags_are_refused_in_one_line_with_exit_2(argv, message, capsys):
    assert_refused(argv, message, capsys)


def assert_refused(argv, message, capsys):
    """cost_model's command refuses argv before it runs anything: exit 2, one line on stderr naming `message`."""
    with pytest.raises(SystemExit) as exit_:
        cost_model.main(argv)
    captured = capsys.readouterr()
    err = captured.err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not captured.out, captured.out


def test_one_table_names_every_optimizer_and_the_cluster(capsys):
    assert cost_model.main(["--model", "gpt2-small", "--gpus", "8", "--tp", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPT-2 small: 0.12 B parameters") and cost_model.H100.name in out
    rows = [line.split("  ")[0] for line in out.splitlines()[4:]]
    assert out.splitlines()[-1].split()[-2] == "-"  # AdamW under FSDP2 is its own baseline
    assert rows == ["gather", "gather, flat buffer", "owner", "comm-free", "AdamW ZeRO-1", "AdamW ZeRO-1, flat buffer",
                    "DTensorMuon", "AdamW, FSDP2"]


class OwnScatter(owners.Owner):
    """The owner strategy with a scatter of its own: a data path the model does not know."""

    name = "own-scatter"

    def scatter(self, opt, orthos, routes):
        return super().scatter(opt, orthos, routes)


@pytest.mark.parametrize("strategy", ["owner", "gather"])
def test_the_model_refuses_a_strategy_whose_data_path_it_does_not_know(strategy):
    """Priced as its base, it would be priced wrongly and say nothing: refused in one line, naming what is its own.
    The built-in strategies, and one that only assigns owners its own way (tests/test_fourth_strategy.py), are
    priced."""
    cfg = grid_config(4, 2, strategy=strategy)
    opt = cost_model.lesson_optimizer(muon_tools.demo_specs(cfg), cfg)
    assert cost_model.lesson_cost(opt, ONE_NODE).traffic.phases
    if strategy == "owner":
        opt.strategy.__class__ = OwnScatter
        own = "scatter"
    else:
        opt.strategy.middle = lambda tp_local, meta, group, grid, ledger: None
        own = "middle"
    with pytest.raises(ValueError, match=rf"^the cost model prices .* has its own {own}: price it by its own branch"):
        cost_model.lesson_cost(opt, ONE_NODE)
