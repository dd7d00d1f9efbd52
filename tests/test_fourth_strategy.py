"""A fourth strategy, written here as a user would write one (notes/08-strategies.md, "Adding a strategy"): a subclass
of Owner with a name and an owner rule of its own, its optimizer registered. It runs bit for bit against torch through
the runner, whose checks and accounting take it with no edit of theirs: nothing in the house branches on a strategy's
name, everything reads what the strategy declares."""

import re
from dataclasses import replace

import pytest

from conftest import grid_config, run_together, run_together_rank
import distributed_muon_cpu
from distmuon import large_runs
from distmuon import owners
import muon_tools
from distmuon.strategy import DECLARED, ChunkStrategy, Strategy
from test_strategies import assert_identical

NAME = "round-robin"
DP, TP = 3, 2  # uneven DP, TP-split matrices


class RoundRobin(owners.Owner):
    """The owner strategy with the matrices dealt out in turn from the last rank down, not balanced by FLOPs."""

    name = NAME

    def assign(self, opt):
        world = opt.grid.world.size
        return {world - 1 - r: opt.muon_names[r::world] for r in range(world)}


class RoundRobinMuon(owners.OwnerMuon):
    """OwnerMuon with RoundRobin plugged in."""

    strategy_class = RoundRobin


def round_robin_rank(rank, together, device):
    """A rank of run_together: a spawned process imports this module afresh, so it registers the strategy first."""
    owners.register(RoundRobinMuon)
    return run_together_rank(rank, together, device)


@pytest.fixture
def registered():
    owners.register(RoundRobinMuon)
    yield
    owners.unregister(NAME)


# The plain step, the overlapped one, NorMuon (its owner holds the rows) and the fused QKV by heads (large runs wrap it)
RUNS = [grid_config(DP, TP, strategy=NAME, **options)
        for options in ({}, dict(overlap=owners.OVERLAP_DEFAULT), dict(normuon=True), dict(ns_blocks="heads"))]


def test_a_fourth_strategy_runs_through_the_runner_bit_for_bit(registered):
    results = run_together(RUNS, round_robin_rank)
    for cfg in RUNS:
        assert_identical(results[cfg])
    plain = results[RUNS[0]]
    # its own rule, not the balanced one: the test tells the strategies apart
    world = DP * TP
    names = muon_tools.plan_optimizer(RUNS[0]).muon_names
    assert plain["owners"] == {n: world - 1 - i % world for i, n in enumerate(names)}
    assert plain["owners"] != muon_tools.plan_optimizer(replace(RUNS[0], strategy="owner")).owners
    # the accounting reads its declarations: its phases, in order, each moving bytes; each matrix orthogonalized once
    assert list(plain["bytes_per_step"]) == list(RoundRobin.phases)
    assert all(sum(t["sent"]) > 0 for t in plain["bytes_per_step"].values())
    assert plain["ns_flops"]["redundancy"] == 1.0
    printed = []
    muon_tools.print_header(RUNS[0], muon_tools.plan_optimizer(RUNS[0]), "CPU", "Gloo", True, printed.append)
    assert f"strategy {NAME}" in printed[0] and any(line.startswith("[7] Owners: 10 matrices") for line in printed)


def test_the_runners_checks_read_its_declarations(registered):
    for options in ({}, dict(overlap=1), dict(batched_ns=True), dict(normuon=True)):  # accepted, as owner's are
        cfg = grid_config(DP, TP, strategy=NAME, **options)
        muon_tools.validate(cfg, muon_tools.demo_specs(cfg))
    assert muon_tools.config_from_args(muon_tools.build_parser("").parse_args(["--strategy", NAME])).strategy == NAME
    # each refusal names the strategies that take what was asked, this one among them where it declares so
    refusals = [(dict(strategy="gather", overlap=1), r"--overlap applies to --strategy (.+) \(got gather\)", True),
                (dict(strategy="gather", normuon=True), r"--normuon applies to --strategy (.+), whose owner", True),
                (dict(strategy=NAME, tp_newton_schulz="gram"), r"--tp-newton-schulz gram applies to --strategy (.+): "
                 rf"strategy {NAME} orthogonalizes each matrix whole", False)]
    for options, refusal, named in refusals:
        cfg = grid_config(DP, TP, **options)
        with pytest.raises(ValueError, match=f"^{refusal}") as refused:
            muon_tools.validate(cfg, muon_tools.demo_specs(cfg))
        names = re.split(", | or ", re.match(refusal, str(refused.value)).group(1))
        assert (NAME in names, "gather" in names) == (named, not named), names
        assert named or names == ["gather"]
    assert NAME in muon_tools.PHASES_OF and muon_tools.PHASES_OF[NAME] == RoundRobin.phases


class Unnamed(owners.Owner):
    pass


class Undeclared:  # a strategy class that declares nothing
    pass


@pytest.mark.parametrize("optimizer_class,refusal", [
    (RoundRobinMuon, f"strategy '{NAME}' is registered already, by RoundRobinMuon"),
    (type("OwnerAgain", (owners.OwnerMuon,), dict(strategy_class=Unnamed)), "strategy 'owner' is registered already"),
    (type("Bare", (owners.OwnerMuon,), dict(strategy_class=Undeclared)),
     f"Bare's strategy_class Undeclared declares no {', '.join(DECLARED)} "),
    (RoundRobin, "register takes a subclass of DistributedMuon"),
])
def test_register_refuses_in_one_line_and_changes_nothing(registered, optimizer_class, refusal):
    before = dict(owners.OPTIMIZERS)
    with pytest.raises(ValueError, match=f"^{refusal}"):
        owners.register(optimizer_class)
    assert owners.OPTIMIZERS == before and owners.STRATEGIES == tuple(before)


def test_unregister_takes_out_only_what_register_added():
    assert owners.BUILT_IN[:3] == ("gather", "owner", "comm-free") and owners.STRATEGIES == owners.BUILT_IN
    owners.register(RoundRobinMuon)
    assert owners.STRATEGIES == owners.BUILT_IN + (NAME,) and owners.strategy_class(NAME) is RoundRobin
    owners.unregister(NAME)
    assert owners.STRATEGIES == owners.BUILT_IN and NAME not in muon_tools.PHASES_OF
    for name in ("owner", NAME):
        with pytest.raises(ValueError, match=f"^strategy '{name}' is not one register added"):
            owners.unregister(name)
    cfg = grid_config(DP, TP, strategy=NAME)
    with pytest.raises(ValueError, match=f"^--strategy must be one of {', '.join(owners.BUILT_IN)} "):
        muon_tools.validate(cfg, muon_tools.demo_specs(cfg))


@pytest.mark.parametrize("name", owners.STRATEGIES)
def test_every_strategy_declares_what_it_is_asked_and_is_what_it_declares(name):
    """Its class declares DECLARED; its planned optimizer's strategy is a Strategy, a ChunkStrategy wherever its units
    carry chunks (the step calls reduce_chunk and broadcast_chunk for them), with owners where it orthogonalizes each
    matrix once; wrapped by large runs, it declares the same."""
    cls = owners.strategy_class(name)
    assert all(hasattr(cls, a) for a in DECLARED) and cls.name == name
    opt = muon_tools.plan_optimizer(muon_tools.RunConfig(strategy=name))
    assert isinstance(opt.strategy, Strategy) and type(opt.strategy) is cls
    assert isinstance(opt.strategy, ChunkStrategy) == any(u.chunks for u in opt.strategy.units(opt))
    assert (opt.owners is not None) == cls.orthogonalizes_once
    wrapped = large_runs.LargeRuns().around(cls())
    assert [getattr(wrapped, a) for a in DECLARED] == [getattr(cls, a) for a in DECLARED]


class Relabelled(distributed_muon_cpu.Gather):
    """The gather strategy under another name: a strategy that runs the gather flow, as Gather does."""

    name = "relabelled"


def test_large_runs_give_their_middle_to_any_strategy_that_runs_the_gather_flow():
    wrapper = large_runs.LargeRuns()
    wrapped = wrapper.around(Relabelled())
    assert type(wrapped.strategy) is Relabelled and wrapped.middle == wrapper.middle
    assert not hasattr(wrapper.around(RoundRobin()), "middle")  # an owner's Newton-Schulz is its own


def test_large_runs_refuse_a_gather_flow_strategy_with_a_middle_of_its_own():
    """Its middle would be replaced by the gather flow's without a word: refused, and the strategy left as it was."""
    def own_middle(tp_local, meta, group, grid, ledger):
        return distributed_muon_cpu.orthogonalize_tp_local(tp_local, meta, group, grid, ledger)

    strategy = Relabelled(middle=own_middle)
    with pytest.raises(ValueError, match=r"^strategy 'relabelled' has a middle of its own, which large runs "):
        large_runs.LargeRuns().around(strategy)
    assert strategy.middle is own_middle
