"""The optimizers' constructor arguments of a wrong kind, and a refused add_param_group: on one Gloo rank in this
process (conftest's single_process_group).

Every argument of the lesson's optimizers (distributed_muon_cpu.DistributedMuon; distmuon.owners' OwnerMuon and
CommFreeMuon, and their strategies Owner and CommFree; distmuon.large_runs.LargeRuns) and of DTensorMuon, given a value
of the wrong kind, is refused with a ValueError of one line that names it (distmuon/checks.py check_step_arguments and
check_options, distmuon/owners.py check_owner_options, distmuon/large_runs.py LargeRuns, distmuon/dtensor/
optimizer.py check_arguments); an unknown keyword is a TypeError, as Python's own. A refused add_param_group (a
1-D tensor in a Muon group, an unknown option, a tensor or a name already there, a value torch refuses, a non-dict,
a TP split of an unknown parameter) leaves the optimizer exactly as it was: its param groups, its layout and plan,
its state, and what a later valid add_param_group and step do, checked against an optimizer that never saw the
refused call (torch.equal).
"""

import copy
import math

import pytest
import torch

import distributed_muon_cpu
from distmuon import large_runs
from distmuon import owners
from distmuon.dtensor import DistributedConfig, DTensorMuon

LESSON = {"DistributedMuon": distributed_muon_cpu.DistributedMuon, "OwnerMuon": owners.OwnerMuon,
          "CommFreeMuon": owners.CommFreeMuon}


def tensors(seed=0):
    """The parameters every optimizer here is built on: two Muon matrices, an AdamW vector, and what a later
    add_param_group adds (a square matrix, a vector)."""
    g = torch.Generator().manual_seed(seed)
    shapes = dict(w=(8, 4), v=(4, 8), b=(8,), u=(6, 6), c=(6,))
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


def groups(t):
    return [dict(params=[("w", t["w"]), ("v", t["v"])]), dict(params=[("b", t["b"])], algorithm="adamw")]


def lesson(cls, grid, **kwargs):
    return lambda t: cls(groups(t), grid=grid, bucket_size=40, **kwargs)


# (argument, a value of the wrong kind): the options of torch's optimizers, taken by every constructor here
OPTIONS = [("lr", "0.1"), ("lr", None), ("momentum", "0.9"), ("nesterov", "yes"), ("ns_steps", 0.5),
           ("ns_coefficients", 0.5), ("ns_coefficients", None), ("ns_coefficients", "cubic"),
           ("ns_coefficients", [(3.4445, -4.775, 2.0315)] * 2), ("adjust_lr_fn", 3), ("eps", "1e-7"),
           ("weight_decay", None), ("betas", 0.9), ("betas", (0.9,)), ("amsgrad", 1), ("maximize", "no")]
# the lesson's optimizers' own
LESSON_ARGUMENTS = [("grid", "world"), ("grid", None), ("tp_split_dims", ["w"]), ("tp_split_dims", {0: 1}),
                    ("bucket_size", "1"), ("bucket_size", True), ("bucket_size", 0), ("large_runs", True),
                    ("large_runs", "blocks")]
OWNER_ARGUMENTS = [("owners", [1, 2]), ("owners", {0: "w"}), ("overlap", -1), ("overlap", True), ("overlap", 1.5),
                   ("batched_ns", "no"), ("batched_ns", 1)]
LARGE_RUNS_ARGUMENTS = [("row_layouts", ["w"]), ("row_layouts", "w"), ("row_layouts", {"w": 3}),
                        ("row_layouts", {0: large_runs.RowLayout((2,))}), ("ns_blocks", "rows"), ("ns_blocks", None),
                        ("tp_newton_schulz", "ring"), ("qk_clip_tau", 0), ("qk_clip_tau", "1"), ("qk_clip_tau", True),
                        ("qk_clip_tau", math.nan)]
DTENSOR_ARGUMENTS = [("expert_stacks", "w"), ("expert_stacks", [1]), ("distributed_config", {}),
                     ("batched_ns", "no"), ("group", "world"), ("row_layouts", ["w"]), ("row_layouts", {"w": 3}),
                     ("ns_blocks", "rows"), ("tp_newton_schulz", "ring"), ("qk_clip_tau", "1")]


def assert_refused_naming(argument, build):
    with pytest.raises(ValueError) as refused:
        build()
    message = str(refused.value)
    assert argument in message and "\n" not in message, message


def cases(arguments, constructors):
    return [pytest.param(c, a, v, id=f"{c}-{a}={v!r}") for c in constructors for a, v in arguments]


@pytest.mark.parametrize("cls,argument,value", cases(LESSON_ARGUMENTS + OPTIONS, LESSON)
                         + cases(OWNER_ARGUMENTS, ["OwnerMuon", "CommFreeMuon"])
                         + cases([("strategy", "owner"), ("strategy", owners.OwnerMuon)], ["DistributedMuon"]))
def test_the_lessons_optimizers_refuse_an_argument_of_the_wrong_kind_naming_it(single_process_group, cls, argument,
                                                                               value):
    kwargs = dict(dict(grid=single_process_group), **{argument: value})
    assert_refused_naming(argument, lambda: LESSON[cls](groups(tensors()), **kwargs))


def test_large_runs_and_strategy_must_be_instances_not_classes(single_process_group):
    assert_refused_naming("large_runs", lambda: distributed_muon_cpu.DistributedMuon(groups(tensors()), grid=single_process_group,
                                                                     large_runs=large_runs.LargeRuns))
    assert_refused_naming("strategy", lambda: distributed_muon_cpu.DistributedMuon(groups(tensors()), grid=single_process_group,
                                                                   strategy=owners.Owner))


@pytest.mark.parametrize("cls", ["OwnerMuon", "CommFreeMuon"])
def test_an_optimizer_built_around_its_strategy_refuses_another(single_process_group, cls):
    with pytest.raises(TypeError, match=f"^{cls} takes no strategy: it is DistributedMuon"):
        getattr(owners, cls)(groups(tensors()), grid=single_process_group, strategy=distributed_muon_cpu.Gather())


@pytest.mark.parametrize("cls", [owners.Owner, owners.CommFree], ids=["Owner", "CommFree"])
@pytest.mark.parametrize("argument,value", OWNER_ARGUMENTS, ids=[f"{a}={v!r}" for a, v in OWNER_ARGUMENTS])
def test_the_owner_strategies_refuse_an_argument_of_the_wrong_kind_naming_it(cls, argument, value):
    assert_refused_naming(argument, lambda: cls(**{argument: value}))


@pytest.mark.parametrize("argument,value", LARGE_RUNS_ARGUMENTS, ids=[f"{a}={v!r}" for a, v in LARGE_RUNS_ARGUMENTS])
def test_large_runs_refuses_an_argument_of_the_wrong_kind_naming_it(argument, value):
    """At once, before any optimizer is given it (row_layouts a dict of RowLayout: a list of pairs was taken by
    dict(), a string's characters too)."""
    assert_refused_naming(argument, lambda: large_runs.LargeRuns(**{argument: value}))


@pytest.mark.parametrize("argument,value", DTENSOR_ARGUMENTS + OPTIONS,
                         ids=[f"{a}={v!r}" for a, v in DTENSOR_ARGUMENTS + OPTIONS])
def test_dtensor_muon_refuses_an_argument_of_the_wrong_kind_naming_it(single_process_group, argument, value):
    assert_refused_naming(argument, lambda: DTensorMuon(groups(tensors()), **{argument: value}))


@pytest.mark.parametrize("build", ["lesson", "dtensor"])
def test_an_unknown_keyword_is_a_type_error_naming_it(single_process_group, build):
    """As Python refuses an unexpected keyword argument (an option of neither torch.optim.Muon nor AdamW)."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'momentun'"):
        if build == "lesson":
            distributed_muon_cpu.DistributedMuon(groups(tensors()), grid=single_process_group, momentun=0.9)
        else:
            DTensorMuon(groups(tensors()), momentun=0.9)


def test_the_arguments_a_refusal_names_are_taken_when_right(single_process_group):
    """The control: the same constructors take the right kinds (so the refusals above are of the values)."""
    t = tensors()
    distributed_muon_cpu.DistributedMuon(groups(t), grid=single_process_group, tp_split_dims={"w": 0}, bucket_size=40,
                       large_runs=large_runs.LargeRuns(row_layouts={"w": large_runs.RowLayout((2, 2), 2, ("q", "k"))},
                                                ns_blocks="blocks", qk_clip_tau=10.0),
                       ns_coefficients="polar_express", lr=0.02, betas=(0.9, 0.95))
    owners.OwnerMuon(groups(tensors()), grid=single_process_group, owners={0: ["w", "v"]}, overlap=2, batched_ns=True)
    owners.CommFreeMuon(groups(tensors()), grid=single_process_group, overlap=1)
    DTensorMuon(groups(tensors()), expert_stacks=(), distributed_config=DistributedConfig(), batched_ns=False,
                group=None, row_layouts={"w": large_runs.RowLayout((4, 4), 1, ("q", "k"))}, ns_blocks="heads",
                qk_clip_tau=5.0, ns_coefficients=[(3.4445, -4.775, 2.0315)] * 5)


# A refused add_param_group, then a valid one and a step: against an optimizer that never saw the refused call.
BAD_GROUPS = {
    "a 1-D tensor in a Muon group": lambda t: dict(params=[("x", torch.ones(5))]),
    "an unknown option": lambda t: dict(params=[("y", torch.ones(3, 3))], foo=1),
    "a tensor already there": lambda t: dict(params=[("w2", t["w"])]),
    "a name already there": lambda t: dict(params=[("w", torch.ones(3, 3))]),
    "an option torch refuses": lambda t: dict(params=[("y", torch.ones(3, 3))], lr=-1.0),
    "a wrong algorithm": lambda t: dict(params=[("y", torch.ones(3, 3))], algorithm="sgd"),
    "an integer tensor": lambda t: dict(params=[("y", torch.ones(3, 3, dtype=torch.int64))]),
    "no parameters": lambda t: dict(params=[]),
    "a list, not a dict": lambda t: [("y", torch.ones(3, 3))],
    "a tensor, not a dict": lambda t: torch.ones(3, 3),
}
LESSON_BAD_GROUPS = {  # the lesson's optimizers take a group's own TP splits, and float32 parameters only
    "a float64 tensor": lambda t: dict(params=[("y", torch.ones(3, 3, dtype=torch.float64))]),
    "a TP split of an unknown parameter": lambda t: dict(params=[("y", torch.ones(4, 4))], tp_split_dims={"z": 0}),
    "a TP split out of range": lambda t: dict(params=[("y", torch.ones(4, 4))], tp_split_dims={"y": 2}),
}


def plan_of(opt):
    """What the optimizer is, besides its tensors' values: its groups (names, shapes, options), layout and plan,
    the state it holds."""
    described = [{k: ([tuple(p.shape) for p in v] if k == "params" else v) for k, v in g.items()}
                 for g in opt.param_groups]
    state = sorted((name, sorted(opt.state[p])) for name, p in opt.param_by_name.items() if p in opt.state)
    if isinstance(opt, DTensorMuon):
        return copy.deepcopy((described, state, len(opt.state), opt.names, opt.owners, opt.ns_flops,
                              opt.local_matrices, repr(opt.matrices)))
    large_runs = opt.large_runs and (opt.large_runs.blocks, opt.large_runs.runs, opt.large_runs.gram)
    return copy.deepcopy((described, state, len(opt.state), opt.tp_split_dims, opt.layout, opt.dist_metas,
                          opt.muon_names, opt.owners, opt.parts, large_runs))  # what it is now, not a live view


BUILDS = {
    "DistributedMuon": lambda grid: lesson(distributed_muon_cpu.DistributedMuon, grid),
    "DistributedMuon with LargeRuns": lambda grid: lambda t: lesson(  # a LargeRuns serves one optimizer
        distributed_muon_cpu.DistributedMuon, grid, large_runs=large_runs.LargeRuns(
            row_layouts={"w": large_runs.RowLayout((2, 2), 2, ("q", "k"))}, ns_blocks="heads"))(t),
    "OwnerMuon": lambda grid: lesson(owners.OwnerMuon, grid),
    "OwnerMuon, overlapped": lambda grid: lesson(owners.OwnerMuon, grid, overlap=2),
    "CommFreeMuon": lambda grid: lesson(owners.CommFreeMuon, grid),
    "DTensorMuon": lambda grid: lambda t: DTensorMuon(groups(t)),
}


def refusals():
    for build in BUILDS:
        bad = dict(BAD_GROUPS, **(LESSON_BAD_GROUPS if build != "DTensorMuon" else {}))
        for what in bad:
            yield pytest.param(build, bad[what], id=f"{build}: {what}")


@pytest.mark.parametrize("build,bad_group", refusals())
def test_a_refused_add_param_group_leaves_the_optimizer_as_it_was(single_process_group, build, bad_group):
    make = BUILDS[build](single_process_group)
    refused, untouched = tensors(), tensors()
    opt, control = make(refused), make(untouched)
    before = plan_of(opt)
    with pytest.raises(ValueError) as why:
        opt.add_param_group(bad_group(refused))
    assert "\n" not in str(why.value)
    assert plan_of(opt) == before == plan_of(control)
    for t, o in ((refused, opt), (untouched, control)):  # then the same valid group, and a step
        o.add_param_group(dict(params=[("u", t["u"])], lr=0.05))
        o.add_param_group(dict(params=[("c", t["c"])], algorithm="adamw", weight_decay=0.0))
    assert plan_of(opt) == plan_of(control)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        grads = {name: torch.randn(p.shape, generator=g) for name, p in refused.items()}
        for t, o in ((refused, opt), (untouched, control)):
            for name, p in t.items():
                p.grad = grads[name].clone()
            o.step()
    for name in refused:
        assert torch.equal(refused[name], untouched[name]), name
    assert not torch.equal(refused["u"], tensors()["u"])  # the step moved them
