"""A resume under other names (issue 47): a checkpoint saved from a torch.compile'd, activation-checkpointed,
DDP-wrapped or plain model, or from plain tensors, resumed into any other of these, by every optimizer here
(DTensorMuon and the lesson's DistributedMuon with each strategy), bit for bit against torch.optim.Muon and AdamW
run without interruption; a scheduler after a resume moves every optimizer's lr; and no step of any of them leaves
a parameter that has a gradient unchanged at a nonzero lr. All in this process, on a world of one Gloo rank."""

import io

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.nn.parallel import DistributedDataParallel

from distmuon import checks
from distmuon import owners
from distmuon.dtensor import DTensorMuon
from test_optimizer_api import VARIANTS, TinyNet

LR, WEIGHT_DECAY = 0.02, 0.1
# Every optimizer here: DTensorMuon, and the lesson's with each strategy (owner and comm-free also overlapped).
BUILDERS = {"dtensor": lambda groups, grid, **kw: DTensorMuon(groups, **kw)}
BUILDERS.update({f"{s}{options}": (lambda groups, grid, s=s, options=options, **kw:
                                   owners.OPTIMIZERS[s](groups, grid=grid, bucket_size=300, **options, **kw))
                 for s, options in VARIANTS})
# How a model's parameters get their names: wrapped three ways, plain, or no names at all (torch numbers them).
WRAPS = {
    "plain": lambda model: model,
    "compiled": torch.compile,  # names prefixed _orig_mod. (nothing is compiled: no forward runs here)
    "checkpointed": lambda model: apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, torch.nn.Linear)) or model,  # ._checkpoint_wrapped_module. inside
    "ddp": DistributedDataParallel,  # names prefixed module.
    "unnamed": lambda model: model,
}


def tiny_name(name):
    """TinyNet's own name of a parameter of one of WRAPS' models (the test's own reading of the wrappers)."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "").removeprefix("module.")


def is_matrix(name, p):
    """Muon's parameters of TinyNet: its Linear weights (the embedding goes to AdamW), whatever the wrapper."""
    return p.ndim == 2 and not tiny_name(name).startswith("embed")


def param_groups(model, kind):
    """[a Muon group, an AdamW group] of the model's parameters, named as `kind` names them (or not named)."""
    named = list(model.named_parameters())
    pick = (lambda n, p: p) if kind == "unnamed" else (lambda n, p: (n, p))
    return [dict(params=[pick(n, p) for n, p in named if is_matrix(n, p)]),
            dict(params=[pick(n, p) for n, p in named if not is_matrix(n, p)], algorithm="adamw")]


def gradients(steps, seed=0):
    """One random gradient per TinyNet parameter (by its unwrapped name) per step."""
    g, shapes = torch.Generator().manual_seed(seed), {n: p.shape for n, p in TinyNet().named_parameters()}
    return [{n: torch.randn(shape, generator=g) for n, shape in shapes.items()} for _ in range(steps)]


def set_grads(model, grads):
    for name, p in model.named_parameters():
        p.grad = grads[tiny_name(name)].clone()


def torch_reference(start, grads, schedule=None, lr=LR):
    """TinyNet's parameters {name: tensor} after torch.optim.Muon and AdamW (torch's defaults, our weight decay)
    fed `grads`, uninterrupted; schedule(optimizer) -> a scheduler stepped after every step; lr: a number, or a
    function giving each optimizer its own (a Tensor lr, which a scheduler fills in place)."""
    lrs = (lr(), lr()) if callable(lr) else (lr, lr)
    model = TinyNet()
    model.load_state_dict(start)
    named = list(model.named_parameters())
    ref = [torch.optim.Muon([p for n, p in named if is_matrix(n, p)], lr=lrs[0], weight_decay=WEIGHT_DECAY),
           torch.optim.AdamW([p for n, p in named if not is_matrix(n, p)], lr=lrs[1], weight_decay=WEIGHT_DECAY)]
    schedulers = [schedule(o) for o in ref] if schedule else []
    for step_grads in grads:
        set_grads(model, step_grads)
        for o in ref + schedulers:
            o.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def ours(build, kind, start, grid, lr=LR):
    """A TinyNet wrapped as `kind`, from `start`, and an optimizer `build` makes over its parameters."""
    model = TinyNet()
    model.load_state_dict(start)
    model = WRAPS[kind](model)
    return model, BUILDERS[build](param_groups(model, kind), grid, lr=lr, weight_decay=WEIGHT_DECAY)


def unwrapped(model):
    return {tiny_name(n): p.detach() for n, p in model.named_parameters()}


def through_a_file(state_dict):
    """The state dict as a resumed run reads it: saved with torch.save, loaded with torch.load."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def resume(build, saved_kind, resumed_kind, grid, grads, at, schedule=None):
    """`at` steps by an optimizer over a `saved_kind` model, its state (and its schedulers') saved; a fresh
    `resumed_kind` model from those weights and a fresh optimizer loading that state, then the other steps.
    Returns the resumed model's parameters {unwrapped name: tensor} and its optimizer."""
    start = TinyNet().state_dict()
    model, opt = ours(build, saved_kind, start, grid)
    scheduler = schedule(opt) if schedule else None
    for step_grads in grads[:at]:
        set_grads(model, step_grads)
        opt.step()
        if scheduler:
            scheduler.step()
    saved = through_a_file(dict(optim=opt.state_dict(), scheduler=scheduler and scheduler.state_dict()))
    model, opt = ours(build, resumed_kind, {n: p.clone() for n, p in unwrapped(model).items()}, grid)
    scheduler = schedule(opt) if schedule else None  # before the load, as torch's docs ask
    opt.load_state_dict(saved["optim"])
    if scheduler:
        scheduler.load_state_dict(saved["scheduler"])
    for step_grads in grads[at:]:
        before = unwrapped(model)
        before = {n: p.clone() for n, p in before.items()}
        set_grads(model, step_grads)
        opt.step()
        if scheduler:
            scheduler.step()
        assert all(not torch.equal(p, before[n]) for n, p in unwrapped(model).items()), "a parameter did not move"
    return start, unwrapped(model), opt


PAIRS = [("compiled", "plain"), ("plain", "compiled"), ("checkpointed", "plain"), ("plain", "checkpointed"),
         ("unnamed", "plain"), ("plain", "unnamed"), ("ddp", "plain"), ("plain", "ddp"), ("compiled", "ddp")]


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize("saved_kind,resumed_kind", PAIRS)
def test_a_resume_under_other_names_is_torchs_uninterrupted_run(single_process_group, build, saved_kind,
                                                                 resumed_kind):
    """Two steps, a resume under the other names, a third step: torch.equal to torch's three steps."""
    grads = gradients(3)
    start, got, _ = resume(build, saved_kind, resumed_kind, single_process_group, grads, at=2)
    want = torch_reference(start, grads)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


@pytest.mark.parametrize("build", BUILDERS)
def test_a_scheduler_after_a_resume_moves_the_lr(single_process_group, build):
    """StepLR halving the lr at every step, saved and resumed with the optimizer (under other names): the two
    steps after the resume take the halved lrs, torch.equal to torch's optimizers under the same scheduler."""
    grads = gradients(4, seed=1)
    start, got, opt = resume(build, "compiled", "plain", single_process_group, grads, at=2, schedule=halving)
    want = torch_reference(start, grads, schedule=halving)
    assert all(g["lr"] == LR / 16 for g in opt.param_groups)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


@pytest.mark.parametrize("build", BUILDERS)
def test_the_step_reads_the_loaded_groups(single_process_group, build):
    """After a load, the groups torch installed are the ones stepped: lr = 0 set on them moves no weight; and a
    checkpoint's own lr (0.05, where the new optimizer was built with 0.02) is the one taken, as torch takes it."""
    grads = gradients(2, seed=2)
    start = TinyNet().state_dict()
    model, opt = ours(build, "plain", start, single_process_group)
    set_grads(model, grads[0])
    for group in opt.param_groups:
        group["lr"] = 0.05
    opt.step()
    saved = through_a_file(opt.state_dict())
    model, opt = ours(build, "plain", {n: p.clone() for n, p in unwrapped(model).items()}, single_process_group)
    opt.load_state_dict(saved)
    assert all(g["lr"] == 0.05 for g in opt.param_groups)
    frozen = ours(build, "plain", unwrapped(model), single_process_group)
    frozen[1].load_state_dict(saved)
    for group in frozen[1].param_groups:
        group["lr"] = 0.0
    for m, o in ((model, opt), frozen):
        before = {n: p.clone() for n, p in unwrapped(m).items()}
        set_grads(m, grads[1])
        o.step()
    assert all(torch.equal(p, before[n]) for n, p in unwrapped(frozen[0]).items())  # lr 0: nothing moved
    want = torch_reference(start, grads, lr=0.05)
    got = unwrapped(model)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


@pytest.mark.parametrize("build", BUILDERS)
def test_no_step_leaves_a_parameter_with_a_gradient_unchanged(single_process_group, build):
    """Every optimizer and strategy, at a nonzero lr: a fresh one's step, and after loads of its own state dict,
    of one saved under every other naming, and of one whose groups a scheduler changed, every parameter with a
    gradient moves (the quiet bug of issue 47: a step that votes on names the load replaced moves nothing)."""
    grads = gradients(1, seed=3)[0]
    for saved_kind in WRAPS:
        model, opt = ours(build, saved_kind, TinyNet().state_dict(), single_process_group)
        set_grads(model, grads)
        opt.step()
        saved = through_a_file(opt.state_dict())
        for resumed_kind in ("plain", saved_kind):
            model, opt = ours(build, resumed_kind, TinyNet().state_dict(), single_process_group)
            opt.load_state_dict(saved)
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)  # changes every group's lr, as schedulers do
            before = {n: p.clone() for n, p in unwrapped(model).items()}
            set_grads(model, grads)
            opt.step()
            still = [n for n, p in unwrapped(model).items() if torch.equal(p, before[n])]
            assert not still, (saved_kind, resumed_kind, still)


def test_names_are_read_as_torchs_checkpoint_helpers_read_them(single_process_group):
    """distmuon.checks.canonical_name against torch's own reading (_get_fqns, which get/set_optimizer_state_dict
    key the state by) of every parameter name of TinyNet wrapped by each of WRAPS and by two of them at once."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    wrapped = [WRAPS[kind](TinyNet()) for kind in WRAPS] + [
        torch.compile(DistributedDataParallel(TinyNet())), DistributedDataParallel(WRAPS["checkpointed"](TinyNet()))]
    names = [(model, n) for model in wrapped for n, _ in model.named_parameters()]
    assert {n for _, n in names} > {n for n, _ in TinyNet().named_parameters()}  # some names are wrapped
    assert all({checks.canonical_name(n)} == _get_fqns(model, n) for model, n in names), \
        [(n, _get_fqns(model, n)) for model, n in names if {checks.canonical_name(n)} != _get_fqns(model, n)]


@pytest.mark.parametrize("saved_kind,resumed_kind", PAIRS)
def test_dtensor_muon_resumes_under_other_names_through_torchs_checkpoint_helpers(single_process_group, tmp_path,
                                                                                   saved_kind, resumed_kind):
    """DTensorMuon's own recipe (distmuon.dtensor.checkpoint: get/set_optimizer_state_dict and dcp) saved from one
    naming, loaded into another: the third step is torch's uninterrupted third, torch.equal."""
    from distmuon.dtensor import load_checkpoint, save_checkpoint

    grads, start = gradients(3, seed=13), TinyNet().state_dict()
    model, opt = ours("dtensor", saved_kind, start, single_process_group)
    for step_grads in grads[:2]:
        set_grads(model, step_grads)
        opt.step()
    save_checkpoint(str(tmp_path), model, opt)
    model, opt = ours("dtensor", resumed_kind, TinyNet().state_dict(), single_process_group)  # weights from the file
    load_checkpoint(str(tmp_path), model, opt)
    set_grads(model, grads[2])
    opt.step()
    want, got = torch_reference(start, grads), unwrapped(model)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
