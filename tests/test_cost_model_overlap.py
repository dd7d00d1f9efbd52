"""benchmarks/cost_model.py's DTensorMuon by groups, overlapped (section 9, cost_model_overlap.py): the pipeline
recurrence against schedules worked by hand, more overlap never slower, the groups the library's own (a spawn of 4
ranks: DTensorMuon's exchange_groups and its Ledger, call by call), one group the model's one-exchange step, and the
command line's refusals."""

from dataclasses import asdict, replace
import random
import re

import pytest
import torch
import torch.distributed as dist

import distributed_muon_cpu
import muon_tools
from dtensor_run import DemoConfig, build_on_mesh, give_grads
from dtensor_scenarios import Runs
from test_cost_model import CLUSTER, ONE_NODE, assert_refused, calls_per_step, demo_copies
import cost_model

# -- the recurrence, by hand ---------------------------------------------------------------------------------

ONE_RANK = [[3.0], [1.0], [2.0]]  # Newton-Schulz seconds of 3 groups on one rank


def totals(gather, compute, back, ks):
    return [cost_model.pipeline(gather, compute, back, k).total for k in ks]


def test_the_step_issues_gathers_k_groups_ahead_of_each_way_back():
    """optimizer.py's loop: iteration j starts group j's gather, then group j-K's Newton-Schulz and its way back."""
    assert cost_model.link_order(3, 0) == [("gather", 0), ("back", 0), ("gather", 1), ("back", 1), ("gather", 2),
                                           ("back", 2)]
    assert cost_model.link_order(3, 1) == [("gather", 0), ("gather", 1), ("back", 0), ("gather", 2), ("back", 1),
                                           ("back", 2)]
    assert cost_model.link_order(3, 5) == [("gather", 0), ("gather", 1), ("gather", 2), ("back", 0), ("back", 1),
                                           ("back", 2)]


def test_without_overlap_the_step_is_every_groups_gather_newton_schulz_and_way_back_in_turn():
    s = cost_model.pipeline([1, 2, 1], ONE_RANK, [1, 1, 2], 0)
    assert s.gather_end == [1, 7, 10] and s.ns_end == [4, 8, 12] and s.back_end == [5, 9, 14]
    assert s.total == (1 + 3 + 1) + (2 + 1 + 1) + (1 + 2 + 2)


def test_one_group_in_flight_hides_the_gathers_behind_newton_schulz_or_newton_schulz_behind_the_link():
    """Three groups, gather and way back 1 s each, Newton-Schulz c s each. K = 0: 3 (2 + c). K = 1: compute-bound
    (c >= 2: the link's two collectives a group fit in one Newton-Schulz) 1 + 3c + 1, the first gather and the last
    way back the only ones not hidden; link-bound (c <= 1/2 here) 3 x 2, Newton-Schulz hidden; between, worked by
    hand: c = 1.5 gives 7 (the scatter of group 0 holds group 2's gather back 0.5 s), and K = 2 then 6.5."""
    link = [1.0] * 3
    for c, by_hand in ((2.0, [12, 8, 8]), (3.0, [15, 11, 11]), (0.5, [7.5, 6, 6]), (1.5, [10.5, 7, 6.5])):
        assert totals(link, [[c]] * 3, link, (0, 1, 2)) == pytest.approx(by_hand), c
    assert cost_model.pipeline(link, [[1.5]] * 3, link, 1).gather_end == [1, 2, 4.5]


def test_each_rank_runs_its_own_groups_newton_schulz_while_another_rank_runs_an_earlier_groups():
    """Rank 0 owns groups 0 and 2, rank 1 group 1 (3 s each), every collective 1 s. K = 0: 3 x 5. K = 1: rank 1's
    Newton-Schulz of group 1 starts at 2 s, when its gather lands, during rank 0's of group 0 (1 s to 4 s): the
    step ends at 10 s, where the slowest owner of each group taken as one device would end at 11."""
    compute, link = [[3.0, 0.0], [0.0, 3.0], [3.0, 0.0]], [1.0] * 3
    assert totals(link, compute, link, (0, 1)) == pytest.approx([15, 10])
    assert cost_model.pipeline(link, compute, link, 1).ns_end == [4, 5, 9]
    assert cost_model.pipeline(link, [[3.0]] * 3, link, 1).total == 11  # one device doing all three


def test_more_overlap_is_never_slower_and_no_faster_than_the_link_or_the_busiest_rank():
    rng, checked = random.Random(49), 0
    for _ in range(2000):
        n, world = rng.randint(1, 6), rng.randint(1, 3)
        draw = lambda: rng.choice([0.0, rng.uniform(0, 3)])  # noqa: E731
        gather, back = [draw() for _ in range(n)], [draw() for _ in range(n)]
        compute = [[draw() for _ in range(world)] for _ in range(n)]
        steps = totals(gather, compute, back, range(n + 1))
        assert all(later <= earlier + 1e-12 for earlier, later in zip(steps, steps[1:])), (gather, compute, back)
        assert steps[0] == pytest.approx(sum(gather) + sum(map(max, compute)) + sum(back))
        busiest = max(map(sum, zip(*compute)))
        assert steps[-1] >= max(sum(gather) + sum(back), busiest) - 1e-12
        checked += steps[-1] < steps[0] - 1e-9
    assert checked > 1000  # overlap does shorten most of these


# -- the groups, DTensorMuon's own -----------------------------------------------------------------------------

# The demo's 40 x 40 matrices are 3,200 bytes in bf16: 4,000 bytes holds one, 10,000 three (fc1 and fc2 are 4 of them)
SPAWNED = {"2x2, 4,000 bytes, overlap 1": DemoConfig(dp=2, tp=2, steps=1, exchange_bytes=4000, overlap=1),
           "normuon 2x2, 10,000 bytes, overlap 2": DemoConfig(dp=2, tp=2, steps=1, normuon=True, exchange_bytes=10_000,
                                                             overlap=2)}


def groups_body(rank, runs, device):
    """Each run's step on the 4 ranks: the library's own groups (exchange.exchange_groups) and the Ledger."""
    torch.set_num_threads(1)
    out = []
    for cfg in runs.runs:
        _, model, where, opt = build_on_mesh(cfg, rank, device)
        give_grads(model, cfg, 1, where)
        opt.step()
        out.append(dict(groups=opt.exchange.exchange_groups(opt, set(opt.param_by_name), cfg.exchange_bytes),
                        ledger=asdict(opt.ledger)))
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def spawned():
    results = muon_tools.spawn_ranks(Runs(tuple(SPAWNED.values()), dp=4, timeout_s=60), groups_body)
    return {label: [r[i] for r in results] for i, label in enumerate(SPAWNED)}


def model_of(cfg):
    """(copies, {group: algorithm}, world) of the demo as the cost model places it."""
    return demo_copies(cfg), cost_model.dtensor_algorithms("DTensorMuon" + cost_model.NORMUON * cfg.normuon), cfg.dp * cfg.tp


@pytest.mark.parametrize("label", list(SPAWNED))
def test_the_groups_are_the_librarys_and_each_exchange_is_its_groups_call_in_the_ledger(spawned, label):
    cfg = SPAWNED[label]
    copies, algorithms, world = model_of(cfg)
    steps = {g: distributed_muon_cpu.NS_STEPS for g in algorithms}
    groups = cost_model.dtensor_groups(copies, algorithms, steps, world, ONE_NODE, cfg.exchange_bytes)
    ranks = spawned[label]
    theirs = [tuple(names) for names, exchanged, _ in ranks[0]["groups"] if exchanged]
    assert [g.names for g in groups] == theirs and len(theirs) > 3, label
    assert all(r["groups"] == ranks[0]["groups"] for r in ranks)  # the same groups on every rank
    assert all(g.nbytes <= cfg.exchange_bytes or len(g.names) == 1 for g in groups)
    ledgers = [r["ledger"] for r in ranks]
    phases = ("gather at owner", "scatter from owner") + (("NorMuon rows",) if cfg.normuon else ())
    for phase in phases:  # call i of a phase on every rank: group i's collective, its bytes each way
        calls = [[(c["sent"], c["received"]) for c in led["comm"] if c["step"] == 1 and c["phase"] == phase]
                 for led in ledgers]
        modelled = [[(t.sent[r], t.received[r]) for g in groups for t in [g.traffic.phases.get(phase)] if t]
                    for r in range(world)]
        assert calls == modelled, (label, phase)
    # every group's bytes together: the Ledger's table of the step (muon_tools.bytes_per_step), and its calls
    real, calls = muon_tools.bytes_per_step(ledgers, 1, phases), calls_per_step(ledgers, 1, phases)
    for phase in phases:
        parts = [g.traffic.phases[phase] for g in groups if phase in g.traffic.phases]
        for key in ("sent", "received"):
            assert [sum(x) for x in zip(*(getattr(t, key) for t in parts))] == real[phase][key], (label, phase, key)
        assert [sum(x) for x in zip(*(t.calls for t in parts))] == calls[phase], (label, phase)
    owned = [sum(c["flops"] for c in led["compute"] if c["step"] == 1) for led in ledgers]
    assert [sum(f) for f in zip(*(g.ns_flops for g in groups))] == owned, label


# -- a scenario ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("normuon", [False, True])
def test_one_group_is_the_models_one_exchange_step(normuon):
    """Without exchange_bytes the step is one group: the vote, the gather, the busiest rank's Newton-Schulz, the way
    back (NorMuon's rows and the scatter), as summarize prices dtensor_cost's step (its compute the busiest rank's,
    here the same rank's)."""
    cfg = DemoConfig(dp=4, tp=2, normuon=normuon)
    copies, algorithms, world = model_of(cfg)
    steps = {g: distributed_muon_cpu.NS_STEPS for g in algorithms}
    (one,) = cost_model.predict_overlap(copies, [c.name for c in copies], algorithms, steps, world, ONE_NODE, CLUSTER,
                                        None, [0])
    row = cost_model.summarize(cost_model.dtensor_cost(copies, [c.name for c in copies], algorithms, steps, world,
                                                       ONE_NODE), CLUSTER)
    assert len(one.groups) == 1 and one.vote_s > 0 and one.elementwise_s > 0
    assert one.vote_s + one.schedule.total == pytest.approx(row.comm_s + row.ns_max / (CLUSTER.ns_tflops * 1e12))
    assert one.step_s == pytest.approx(row.step_s)


def test_llama3_8b_by_groups_more_overlap_never_slower_and_grouping_costs_what_it_serializes():
    """On the H100 cluster: each K no slower than the one before it, K = 0 the sum of every group's collectives and
    slowest owner, and the busiest rank's Newton-Schulz the same however the matrices are grouped."""
    s = cost_model.Scenario(replace(cost_model.MODELS["llama3-8b"], layers=4), 64, tp=8)
    one = cost_model.scenario_overlap(s, cost_model.H100, None, [0])[0]
    predictions = cost_model.scenario_overlap(s, cost_model.H100, 256 << 20, range(5))  # 8 groups
    steps = [p.step_s for p in predictions]
    assert all(b <= a for a, b in zip(steps, steps[1:])) and steps[-1] < steps[2] < steps[1] < steps[0]
    p0 = predictions[0]
    assert p0.schedule.total == pytest.approx(p0.link_s + sum(
        max(g.ns_flops) / (cost_model.H100.ns_tflops * 1e12) for g in p0.groups))
    assert p0.ns_s == pytest.approx(one.ns_s) and len(p0.groups) > 1
    assert sum(g.nbytes for g in p0.groups) == one.groups[0].nbytes


@pytest.mark.parametrize("argv,message", [
    (["--overlap", "-1"], "argument --overlap: '-1': each must be >= 0"),
    (["--overlap", "1,x"], "argument --overlap: '1,x': a comma-separated list of integers"),
    (["--exchange-bytes", "0"], "argument --exchange-bytes: '0': each must be >= 1"),
    (["--exchange-bytes", "2TB"], "argument --exchange-bytes: '2TB': a comma-separated list of sizes"),
    (["--overlap-table", "--gpus", "8"], "--gpus: one scenario's options"),
    (["--chapter", "--overlap", "1"], "--overlap: one scenario's options"),
    (["--overlap-table", "--check-here"], "separate runs"),
    (["--model", "llama3-8b", "--gpus", "12", "--overlap", "1"], "TP 8 does not divide 12 GPUs"),
    (["--check-overlap-here", "--overlap", "1"], "--overlap: one scenario's options"),
    (["--check-overlap-here", "--exchange-bytes", "1KiB,2KiB"], "takes one --exchange-bytes"),
    (["--check-overlap-here", "--check-here"], "separate runs"),
    (["--overlap-table", "--d", "64"], "--d: only with --check-here or --check-overlap-here"),
    (["--check-overlap-here", "--d", "100000000"], "needs at least"),
])
def test_bad_overlap_flags_are_refused_in_one_line_with_exit_2(argv, message, capsys):
    assert_refused(argv, message, capsys)


def test_the_overlap_table_has_a_row_for_each_size_and_k_in_milliseconds(capsys):
    assert cost_model.main(["--model", "gpt2-small", "--gpus", "8", "--tp", "1", "--overlap", "0,2",
                    "--exchange-bytes", "8MiB,32MiB,one_per_owner"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPT-2 small: 0.12 B parameters") and "DTensorMuon by groups" in lines[1]
    header, rule, *rows = lines[2:]
    assert header.split("  ")[0] == "exchange_bytes" and "comm ms" in header and "step ms" in header
    assert set(rule.replace(" ", "")) == {"-"} and len({len(r) for r in [header, rule] + rows}) == 1  # aligned
    cells = [re.split(r" {2,}", r.strip()) for r in rows]
    assert [c[:2] for c in cells] == [["one exchange", "-"], ["8.0 MiB", "0"], ["8.0 MiB", "2"], ["32.0 MiB", "0"],
                                      ["32.0 MiB", "2"], ["one_per_owner", "0"], ["one_per_owner", "2"]]
    step = [float(r.split()[-2].replace(",", "")) for r in rows]
    assert step[2] < step[1] and step[4] < step[3] and step[6] < step[5] and rows[0].endswith("1.00x")
    groups = {c[0]: int(c[2].replace(",", "")) for c in cells}
    assert groups["8.0 MiB"] > groups["32.0 MiB"] > groups["one exchange"] == 1 and groups["one_per_owner"] > 1


def test_the_check_here_times_every_variant_and_prints_the_models_prediction_beside_it():
    """--check-overlap-here at a tiny size (d = 8: groups of 512 bytes are qkv and proj, fc, fc2): a row for one
    exchange and for each K, measured, beside the pipeline's prediction on the same machine figures."""
    lines = []
    table = cost_model.check_overlap_here(8, 1, 2, 512, print_fn=lines.append)
    assert [row[:3] for row in table] == [["one exchange", "-", 1]] + [["512 B", k, 3] for k in (0, 1, 2)]
    number = lambda cell: float(cell.replace(",", ""))  # noqa: E731
    pipeline, predicted, least = ([number(row[i]) for row in table] for i in (5, 6, 7))
    assert pipeline[1] >= pipeline[2] >= pipeline[3] and all(p >= q for p, q in zip(predicted, pipeline))
    assert all(t > 0 for t in least) and "vs median" in lines[1]
