"""A refused call changes nothing (issue 47): a load is checked whole before it replaces anything, in every
optimizer here; torch.optim.Muon's and AdamW's own state dicts load into DTensorMuon's matching groups bit for bit
(the lesson's ZeRO-1 optimizers refuse them: their state is one rank's shards); another algorithm's checkpoint is
refused in one line; and what torch's step would fail on halfway (a meta, non-contiguous or sparse tensor) is
refused before anything moves, a parameter with a gradient the plan does not know on every rank."""

import copy
from dataclasses import dataclass

import pytest
import torch

import muon_tools
from distmuon.dtensor import DTensorMuon
from test_optimizer_api import TinyNet
from test_resume_names import (BUILDERS, LR, WEIGHT_DECAY, gradients, is_matrix, ours, param_groups, set_grads,
                               through_a_file, torch_reference, unwrapped)

LESSON = r"state_dict has no ZeRO-1 layout"  # what the lesson's optimizers say first of a state dict not theirs


def drop_lr(sd):
    del sd["param_groups"][0]["lr"]


def as_normuon(sd):  # a NorMuon checkpoint of the same parameters: its group, options and state
    sd["param_groups"][0].update(algorithm="normuon", beta2=0.95, normuon_eps=1e-10)
    for i in sd["param_groups"][0]["params"]:
        sd["state"].get(i, {})["normuon_v"] = torch.zeros(1)


def swap_groups(sd):  # group 0 AdamW's, group 1 Muon's: Muon's checkpoint into AdamW's group and the reverse
    sd["param_groups"].reverse()


def rename(sd):
    for group in sd["param_groups"]:
        group["param_names"] = ["x." + n for n in group["param_names"]]


def bad_lr(sd):
    sd["param_groups"][1]["lr"] = -1.0


def reshape_momentum(sd):
    first = sd["param_groups"][0]["params"][0]
    sd["state"][first] = dict(sd["state"][first], momentum_buffer=torch.zeros(3))


def adamw_state_in_muon(sd):
    first = sd["param_groups"][0]["params"][0]
    sd["state"][first] = dict(step=torch.tensor(1.0), exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3))


def no_state_key(sd):
    del sd["state"]


BAD = {  # what is done to a saved state dict, and the line the load says
    drop_lr: r"loaded optimizer state: param group 0 \(muon\): the checkpoint lacks lr$",
    as_normuon: r"loaded optimizer state: param group 0: the checkpoint's algorithm is 'normuon', this optimizer's "
                r"'muon' .*: load a checkpoint of the same algorithm$",
    swap_groups: r"param group 0: the checkpoint's algorithm is 'adamw', this optimizer's 'muon'",
    rename: r"param group 0: the checkpoint's x.hidden.weight, x.out.weight match no parameter here, and this "
            r"optimizer's hidden.weight, out.weight none of the checkpoint's",
    bad_lr: r"loaded optimizer state: param group 1 \(adamw\): lr must be >= 0 and finite \(got -1.0\)$",
    reshape_momentum: r"param group 0: hidden.weight: its momentum_buffer has shape \(3,\), where this optimizer "
                      r"keeps \((48, 16|768,)\)$",
    adamw_state_in_muon: r"hidden.weight: the checkpoint keeps exp_avg, exp_avg_sq, step, a muon parameter "
                         r"momentum_buffer$",
    no_state_key: r"an optimizer state dict has 'state' and 'param_groups'$",
}


def snapshot(opt):
    """What a refused call must leave as it was: the group dicts themselves, and every state tensor's values."""
    return list(opt.param_groups), copy.deepcopy([dict(g, params=None) for g in opt.param_groups]), \
        {k: {s: t.clone() for s, t in v.items()} for k, v in opt.state.items()}


def assert_unchanged(opt, before):
    groups, options, state = before
    assert all(a is b for a, b in zip(opt.param_groups, groups)) and len(opt.param_groups) == len(groups)
    assert [dict(g, params=None) for g in opt.param_groups] == options
    assert opt.state.keys() == state.keys()
    assert all(torch.equal(opt.state[k][s], t) for k, v in state.items() for s, t in v.items())


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize("spoil", BAD, ids=lambda f: f.__name__)
def test_a_refused_load_changes_nothing(single_process_group, build, spoil):
    """A checkpoint of this optimizer after one step, spoiled one way, loaded into the optimizer after one step:
    refused in one line, and the optimizer's next step is still torch's second step."""
    grads = gradients(2, seed=4)
    start = TinyNet().state_dict()
    model, opt = ours(build, "plain", start, single_process_group)
    set_grads(model, grads[0])
    opt.step()
    saved = through_a_file(opt.state_dict())
    spoil(saved)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=BAD[spoil]) as refused:
        opt.load_state_dict(saved)
    assert "\n" not in str(refused.value)
    assert_unchanged(opt, before)
    set_grads(model, grads[1])
    opt.step()
    want, got = torch_reference(start, grads), unwrapped(model)
    assert all(torch.equal(got[n], want[n]) for n in want)


def torch_state_dicts(start, grads):
    """torch.optim.Muon's and AdamW's own state dicts after the first of `grads`, and the state dict of both
    together as one optimizer of two param groups keeps it (a Muon group, then an AdamW group)."""
    model = TinyNet()
    model.load_state_dict(start)
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_matrix(n, p)], lr=LR, weight_decay=WEIGHT_DECAY)
    adamw = torch.optim.AdamW([p for n, p in named if not is_matrix(n, p)], lr=LR, weight_decay=WEIGHT_DECAY)
    set_grads(model, grads[0])
    muon.step()
    adamw.step()
    m, a = muon.state_dict(), adamw.state_dict()
    shift = len(m["param_groups"][0]["params"])
    both = dict(state={**m["state"], **{k + shift: v for k, v in a["state"].items()}},
                param_groups=m["param_groups"] + [dict(g, params=[k + shift for k in g["params"]])
                                                  for g in a["param_groups"]])
    return m, a, both, {n: p.detach() for n, p in model.named_parameters()}


def number_steps(sd):
    """The state dict as an older torch saved AdamW's: each step a Python number."""
    for state in sd["state"].values():
        if "step" in state:
            state["step"] = state["step"].item()


@pytest.mark.parametrize("which", ["muon", "adamw", "both", "adamw, its steps numbers"])
def test_torchs_own_state_dicts_load_into_the_matching_groups(single_process_group, which):
    """torch.optim.Muon's state dict (no algorithm: Muon's) into a Muon group, AdamW's into an AdamW group (also
    with its steps numbers, as an older torch saved them and torch.optim.AdamW loads them), both into an
    optimizer of both: the next step is torch's second, torch.equal."""
    grads, start = gradients(2, seed=5), TinyNet().state_dict()
    m, a, both, after_one = torch_state_dicts(start, grads)
    if which == "adamw, its steps numbers":
        number_steps(a)
    model = TinyNet()
    model.load_state_dict(after_one)
    named = list(model.named_parameters())
    groups = [dict(params=[(n, p) for n, p in named if is_matrix(n, p)]),
              dict(params=[(n, p) for n, p in named if not is_matrix(n, p)], algorithm="adamw")]
    groups, saved = {"muon": ([groups[0]], m), "adamw": ([groups[1]], a), "both": (groups, both),
                     "adamw, its steps numbers": ([groups[1]], a)}[which]
    opt = DTensorMuon(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    opt.load_state_dict(through_a_file(saved))
    set_grads(model, grads[1])
    opt.step()
    want, got = torch_reference(start, grads), unwrapped(model)
    stepped = {n for g in groups for n in g["param_names"]}
    assert stepped and all(torch.equal(got[n], want[n]) for n in stepped)


@pytest.mark.parametrize("build", [b for b in BUILDERS if b != "dtensor"])
def test_the_lessons_optimizers_refuse_torchs_state_dicts_and_stay_intact(single_process_group, build):
    grads, start = gradients(2, seed=6), TinyNet().state_dict()
    _, _, both, _ = torch_state_dicts(start, grads)
    model, opt = ours(build, "plain", start, single_process_group)
    set_grads(model, grads[0])
    opt.step()
    before = snapshot(opt)
    with pytest.raises(ValueError, match=LESSON):
        opt.load_state_dict(both)
    assert_unchanged(opt, before)


def non_contiguous(model):
    model.hidden.weight = torch.nn.Parameter(torch.randn(16, 48).t())


@pytest.mark.parametrize("build", BUILDERS)
def test_a_meta_model_plans_and_its_step_is_refused(single_process_group, build):
    """Built on meta parameters, an optimizer is a plan from shapes (the cost model builds them so); its step is
    refused in one line, before anything moves, where torch's would fail inside with its internals' words."""
    model = TinyNet().to("meta")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = BUILDERS[build](param_groups(model, "plain"), single_process_group)
    with pytest.raises(ValueError, match=r"^(rank 0: )?\S+ is on the meta device \(no values\): an optimizer built on "
                                         r"meta parameters plans only; materialize them"):
        opt.step()


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize("spoil,message", [
    (non_contiguous, r"^hidden.weight cannot be viewed flat \(shape \(48, 16\), strides \(1, 48\)\), as every "
                     r"optimizer here steps a parameter: make it contiguous before the optimizer is built"),
])
def test_construction_refuses_what_the_step_would_fail_on_halfway(single_process_group, build, spoil, message):
    model = TinyNet()
    spoil(model)
    with pytest.raises(ValueError, match=message):
        BUILDERS[build](param_groups(model, "plain"), single_process_group)


def sparse_gradient(model):
    model.embed.weight.grad = model.embed.weight.grad.to_sparse()


def made_non_contiguous(model):  # after construction: the parameter's data replaced by a transposed copy
    model.hidden.weight.data = model.hidden.weight.detach().t().contiguous().t()


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize("spoil,message", [
    (sparse_gradient, r"the gradient of embed.weight is sparse \(torch.sparse_coo\): Muon and AdamW here take dense"),
    (made_non_contiguous, r"hidden.weight cannot be viewed flat"),
])
def test_a_step_refuses_before_the_momentum_moves(single_process_group, build, spoil, message):
    """A sparse gradient, a parameter made non-contiguous after construction: refused at step(), nothing moved
    (torch.optim.AdamW refuses a sparse gradient too); the step retried once it is fixed is torch's."""
    grads, start = gradients(2, seed=7), TinyNet().state_dict()
    model, opt = ours(build, "plain", start, single_process_group)
    set_grads(model, grads[0])
    opt.step()
    set_grads(model, grads[1])
    spoil(model)
    before, weights = snapshot(opt), {n: p.clone() for n, p in unwrapped(model).items()}
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert_unchanged(opt, before)
    assert all(torch.equal(p, weights[n]) for n, p in unwrapped(model).items())
    model.hidden.weight.data = model.hidden.weight.detach().contiguous()
    set_grads(model, grads[1])
    opt.step()
    want, got = torch_reference(start, grads), unwrapped(model)
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize("names", [True, False], ids=["with its name", "without a name"])
def test_a_parameter_put_into_param_groups_by_hand_is_refused(single_process_group, build, names):
    """torch's optimizers step any tensor put into param_groups by hand; these plan their step by name, so one
    the plan does not know, with a gradient, is refused, nothing moved (add_param_group plans it)."""
    model, opt = ours(build, "plain", TinyNet().state_dict(), single_process_group)
    extra = torch.nn.Parameter(torch.randn(4))
    opt.param_groups[1]["params"].append(extra)
    if names:
        opt.param_groups[1]["param_names"].append("extra")
    set_grads(model, gradients(1)[0])
    extra.grad = torch.ones(4)
    before, weights = snapshot(opt), {n: p.clone() for n, p in unwrapped(model).items()}
    with pytest.raises(ValueError, match="extra has a gradient but is not a parameter this optimizer planned"
                       if names else r"param group 1 has 6 params and 5 param_names"):
        opt.step()
    assert_unchanged(opt, before)
    assert all(torch.equal(p, weights[n]) for n, p in unwrapped(model).items())


@dataclass(frozen=True)
class Spawn:
    dp: int = 2
    tp: int = 1
    timeout_s: float = 120.0


def unplanned_parameter(opt, model):
    extra = torch.nn.Parameter(torch.randn(4))
    extra.grad = torch.ones(4)
    opt.param_groups[1]["params"].append(extra)
    opt.param_groups[1]["param_names"].append("extra")


ON_RANK_1 = {  # what rank 1 alone does before the step, and the line it raises
    unplanned_parameter: "rank 1: extra has a gradient but is not a parameter this optimizer planned",
    lambda opt, model: sparse_gradient(model): "rank 1: the gradient of embed.weight is sparse",
}


def refusals_rank(rank, spawn, device):
    """On each of 2 ranks, every optimizer here and every spoiling of ON_RANK_1, which rank 1 alone does: each
    rank's refusal (or None) and whether its weights stayed as they were."""
    torch.set_num_threads(1)
    from distributed_muon_cpu import make_grid

    grid, out = make_grid(2, 1, rank), {}
    for build in BUILDERS:
        for k, spoil in enumerate(ON_RANK_1):
            torch.manual_seed(0)
            model = TinyNet()
            opt = BUILDERS[build](param_groups(model, "plain"), grid)
            set_grads(model, gradients(1)[0])
            if rank == 1:
                spoil(opt, model)
            weights = {n: p.clone() for n, p in model.named_parameters()}
            try:
                opt.step()
                out[build, k] = None
            except ValueError as e:
                out[build, k] = str(e)
            out[build, k] = (out[build, k], all(torch.equal(p, weights[n]) for n, p in model.named_parameters()))
    return out


def test_what_one_rank_refuses_every_rank_refuses():
    """A parameter the plan does not know, a sparse gradient: on rank 1 alone, refused on both ranks, in one line
    naming it on rank 1 and naming rank 1 on rank 0, every weight as it was on both."""
    ranks = muon_tools.spawn_ranks(Spawn(), refusals_rank)
    for build in BUILDERS:
        for k, line in enumerate(ON_RANK_1.values()):
            (theirs, kept0), (mine, kept1) = ranks[0][build, k], ranks[1][build, k]
            assert mine.startswith(line), (build, mine)
            assert theirs == "rank 1 refused the step (it raised why); nothing changed", (build, theirs)
            assert kept0 and kept1, build


@pytest.mark.parametrize("build", BUILDERS)
def test_parameters_saved_in_another_order_load_by_name_or_are_refused(single_process_group, build):
    """A checkpoint whose groups list their parameters in the reverse order: DTensorMuon (state by parameter)
    takes each by its name, and its next step is torch's; the lesson's ZeRO-1 optimizers, whose shards depend on
    the order, refuse it in one line, intact."""
    grads, start = gradients(2, seed=8), TinyNet().state_dict()
    model, opt = ours(build, "plain", start, single_process_group)
    saved_model = TinyNet()
    saved_model.load_state_dict(start)
    reversed_groups = [dict(g, params=g["params"][::-1]) for g in param_groups(saved_model, "plain")]
    saver = BUILDERS[build](reversed_groups, single_process_group, lr=LR, weight_decay=WEIGHT_DECAY)
    set_grads(saved_model, grads[0])
    saver.step()
    set_grads(model, grads[0])
    opt.step()
    saved = through_a_file(saver.state_dict())
    if build == "dtensor":
        model, opt = ours(build, "plain", unwrapped(saved_model), single_process_group)
        opt.load_state_dict(saved)
        set_grads(model, grads[1])
        opt.step()
        want, got = torch_reference(start, grads), unwrapped(model)
        assert all(torch.equal(got[n], want[n]) for n in want)
    else:
        before = snapshot(opt)
        with pytest.raises(ValueError, match="param group 0: the checkpoint lists its parameters in another order"):
            opt.load_state_dict(saved)
        assert_unchanged(opt, before)
