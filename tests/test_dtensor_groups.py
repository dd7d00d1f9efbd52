"""DTensorMuon's step group by group (exchange_bytes) and overlapped (overlap=K): bit for bit against
torch.optim.Muon / AdamW on the DTensor test meshes (the demo's runs of tests/test_dtensor.py, with the options),
NorMuon's rows too; each exchange's bytes bounded by the group (the Ledger: deterministic, not RSS); the gathers of
later groups launched before a group's is waited for; bad values refused in one line.

One spawn of 8 Gloo ranks runs every scenario (tests/dtensor_scenarios.py's Runs).
"""

import pytest
import torch

import distributed_muon_cpu
import muon_tools

from distmuon.dtensor import DTensorMuon  # noqa: E402
from dtensor_run import DemoConfig, DemoModel, expert_stack_names, is_muon, param_groups  # noqa: E402
from dtensor_scenarios import Runs, run_many_rank  # noqa: E402
from dtensor_verify import run_reference  # noqa: E402
from test_cost_model import ONE_NODE, calls_per_step, demo_copies  # noqa: E402
import cost_model  # noqa: E402
from test_dtensor import MESHES, assert_identical  # noqa: E402

EXCHANGE_BYTES = 4000  # the demo's 40 x 40 matrices are 3200 bytes in bf16: about one parameter per group
GROUPED = {f"{dp}x{tp}, overlap {k}": DemoConfig(dp=dp, tp=tp, exchange_bytes=EXCHANGE_BYTES, overlap=k)
           for (dp, tp), k in zip(MESHES, (2, 1, 0, 2, 1, 2))}
GROUPED.update({
    "2x2, overlap 0": DemoConfig(dp=2, tp=2, exchange_bytes=EXCHANGE_BYTES),
    "2x2, overlap 3": DemoConfig(dp=2, tp=2, exchange_bytes=EXCHANGE_BYTES, overlap=3),
    "hsdp 2x2x2, overlap 1": DemoConfig(replicate=2, dp=2, tp=2, exchange_bytes=EXCHANGE_BYTES, overlap=1),
    "uneven strided 3x2, overlap 2": DemoConfig(dp=3, tp=2, experts=7, exchange_bytes=EXCHANGE_BYTES, overlap=2),
    "normuon 4x2, overlap 1": DemoConfig(dp=4, tp=2, normuon=True, exchange_bytes=EXCHANGE_BYTES, overlap=1),
    "2x2, one per owner": DemoConfig(dp=2, tp=2, exchange_bytes="one_per_owner"),
    "uneven strided 3x2, one per owner": DemoConfig(dp=3, tp=2, experts=7, exchange_bytes="one_per_owner"),
    "normuon hsdp 2x2x2, one per owner, overlap 1": DemoConfig(replicate=2, dp=2, tp=2, normuon=True,
                                                             exchange_bytes="one_per_owner", overlap=1),
    "2x2, one exchange": DemoConfig(dp=2, tp=2),  # what the groups are measured against
})


@pytest.fixture(scope="module")
def grouped():
    results = muon_tools.spawn_ranks(Runs(tuple(GROUPED.values()), timeout_s=60), run_many_rank)
    return {label: [r[i] for r in results if r[i] is not None] for i, label in enumerate(GROUPED)}


@pytest.mark.parametrize("label", list(GROUPED))
def test_grouped_and_overlapped_steps_equal_torch_bit_for_bit(grouped, label):
    cfg = GROUPED[label]
    ranks = grouped[label]
    assert len(ranks) == cfg.replicate * cfg.dp * cfg.tp
    reference = run_reference(DemoConfig(experts=cfg.experts, normuon=cfg.normuon))
    assert_identical(ranks, reference, label)


def exchanges(rank, phase):
    return [c for c in rank["ledger"]["comm"] if c["phase"] == phase]


def test_each_exchange_is_bounded_by_its_group_and_moves_what_one_exchange_moves(grouped):
    """The step's transient exchange buffers: every all-to-all of a group at most the group's bytes each way, at most
    exchange_bytes or one parameter larger than that (where one exchange each way carries more), and
    all the groups together exactly the one exchange's."""
    bound = max([EXCHANGE_BYTES] + [2 * p.numel() for n, p in DemoModel(DemoConfig()).named_parameters()
                                    if is_muon(n, p.ndim)])
    for one, many in zip(grouped["2x2, one exchange"], grouped["2x2, overlap 0"]):
        for phase in ("gather at owner", "scatter from owner"):
            whole, parts = exchanges(one, phase), exchanges(many, phase)
            steps = {c["step"] for c in whole}
            assert len(parts) > 3 * len(whole) and len(whole) == len(steps)
            assert max(max(c["sent"], c["received"]) for c in parts) <= bound, phase
            assert max(max(c["sent"], c["received"]) for c in whole) > bound, phase
            for key in ("sent", "received"):
                assert sum(c[key] for c in parts) == sum(c[key] for c in whole), (phase, key)


@pytest.mark.parametrize("label", ["2x2, overlap 0", "normuon 4x2, overlap 1", "uneven strided 3x2, overlap 2",
                                   "2x2, one per owner", "uneven strided 3x2, one per owner",
                                   "normuon hsdp 2x2x2, one per owner, overlap 1", "2x2, one exchange"])
def test_the_cost_model_prices_the_groups_as_the_ledgers_record_them(grouped, label):
    """benchmarks/cost_model.py's DTensorMuon with exchange_bytes: each phase's bytes and calls per rank, one step."""
    cfg = GROUPED[label]
    copies, world = demo_copies(cfg), cfg.replicate * cfg.dp * cfg.tp
    muon = "normuon" if cfg.normuon else "muon"
    algorithms = {i: muon if g == "muon" else "adamw" for i, g in enumerate(cost_model.GROUPS)}
    cost = cost_model.dtensor_cost(copies, [c.name for c in copies], algorithms,
                                   {g: distributed_muon_cpu.NS_STEPS for g in algorithms}, world,
                           ONE_NODE, exchange_bytes=cfg.exchange_bytes)
    ledgers = [r["ledger"] for r in sorted(grouped[label], key=lambda r: r["rank"])]
    phases = ("grad presence", "gather at owner", "scatter from owner") + (("NorMuon rows",) if cfg.normuon else ())
    step = max(rec["step"] for rec in ledgers[0]["comm"])
    assert cost.traffic.table(phases) == muon_tools.bytes_per_step(ledgers, step, phases), label
    assert cost.traffic.calls_table(phases) == calls_per_step(ledgers, step, phases), label
    assert min(cost.traffic.calls_table(phases)["gather at owner"]) > (1 if cfg.exchange_bytes else 0), label


def launches_before_first_wait(rank, phase):
    events = [(kind, p) for step, kind, p in rank["ledger"]["events"] if step == 1 and p == phase]
    return next(i for i, (kind, _) in enumerate(events) if kind == "wait")


@pytest.mark.parametrize("label,k", [("2x2, overlap 0", 0), ("2x2, overlap 3", 3), ("4x2, overlap 1", 1)])
def test_overlap_keeps_k_more_gathers_in_flight(grouped, label, k):
    for rank in grouped[label]:
        assert launches_before_first_wait(rank, "gather at owner") == k + 1, label


@pytest.mark.parametrize("options,message", [
    (dict(overlap=-1, exchange_bytes=100), "overlap must be an integer >= 0 (got -1)"),
    (dict(overlap=True, exchange_bytes=100), "overlap must be an integer >= 0 (got True)"),
    (dict(overlap=2), "overlap=2 needs exchange_bytes"),
    (dict(exchange_bytes=0), "exchange_bytes must be None, 'one_per_owner' or an integer >= 1 (got 0)"),
    (dict(exchange_bytes=1.5), "exchange_bytes must be None, 'one_per_owner' or an integer >= 1 (got 1.5)"),
    (dict(exchange_bytes="one per owner"),
     "exchange_bytes must be None, 'one_per_owner' or an integer >= 1 (got 'one per owner')"),
])
def test_bad_overlap_or_exchange_bytes_is_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as e:
        model = DemoModel(DemoConfig())
        DTensorMuon(param_groups(model, DemoConfig()), expert_stacks=expert_stack_names(model), **options)
    assert "\n" not in str(e.value)


def test_plain_matrices_in_one_process_group_by_group_equal_torch():
    """No process group: every matrix whole here, in groups that exchange nothing (and overlap=1 over them)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = [(24, 40), (40, 24), (16, 16), (40, 40)]
    start = [torch.randn(s, generator=g) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    opt = DTensorMuon([(f"w{i}", p) for i, p in enumerate(ours)], lr=0.02, weight_decay=0.1, exchange_bytes=2500,
                      overlap=1)
    assert len(opt.exchange.exchange_groups(opt, {f"w{i}" for i in range(4)}, 2500)) == 3
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1)
    for step in range(2):
        for a, b in zip(ours, theirs):
            a.grad = torch.randint(-64, 65, a.shape, generator=g).float() / 1024
            b.grad = a.grad.clone()
        opt.step()
        reference.step()
    for i, (a, b, s) in enumerate(zip(ours, theirs, start)):
        assert not torch.equal(a, s), f"w{i} did not move"
        assert torch.equal(a, b), f"w{i}"
