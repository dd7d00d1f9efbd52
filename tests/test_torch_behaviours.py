"""What torch's own optimizer tests (tests/torch_optim) ask of an optimizer beside its step, checked here against
torch.optim.Muon and AdamW: a Tensor lr as torch takes and reads it, and an evenly strided parameter, in every
optimizer of this project; a deep copy of DTensorMuon that steps."""

import copy
import pickle

import pytest
import torch

from distmuon.dtensor import DTensorMuon
from test_optimizer_api import TinyNet
from test_resume_names import BUILDERS, gradients, halving, ours, set_grads, torch_reference, unwrapped


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-d", "1-d", "2-d"])
def test_a_tensor_lr_steps_as_torchs(single_process_group, build, shape):
    """A 1-element Tensor lr (0-d, 1-d or 2-d, as torch's test_tensor_lr gives it), halved in place by StepLR
    after every step: three steps torch.equal to torch.optim.Muon's and AdamW's with their own such lr."""
    lr = lambda: torch.tensor(0.02).reshape(shape)
    grads, start = gradients(3, seed=9), TinyNet().state_dict()
    model, opt = ours(build, "plain", start, single_process_group, lr=lr())
    scheduler = halving(opt)
    for step_grads in grads:
        set_grads(model, step_grads)
        opt.step()
        scheduler.step()
    assert all(torch.is_tensor(g["lr"]) and g["lr"].item() == lr().item() / 8 for g in opt.param_groups)
    want, got = torch_reference(start, grads, schedule=halving, lr=lr), unwrapped(model)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


@pytest.mark.parametrize("lr,message", [
    (torch.tensor([0.1, 0.2]), r"lr: Tensor lr must be 1-element \(got shape \(2,\)\)"),
    (torch.tensor(-1.0), r"lr must be >= 0 and finite \(got -1.0\)"),
])
def test_a_tensor_lr_is_checked_as_a_number(single_process_group, lr, message):
    for build in BUILDERS:
        with pytest.raises(ValueError, match=message):
            ours(build, "plain", TinyNet().state_dict(), single_process_group, lr=lr)


def strided(shape, seed):
    """A parameter of `shape` that is not contiguous but evenly strided (every other column of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape[:-1], 2 * shape[-1], generator=g)[..., ::2])


@pytest.mark.parametrize("build", BUILDERS)
def test_an_evenly_strided_parameter_steps_as_torchs(single_process_group, build):
    """A parameter viewable flat though not contiguous (torch's test_forloop_goes_right_direction gives one) is
    stepped in place, torch.equal to torch.optim.Muon and AdamW on the same strided tensors."""
    (w, b), (w_ref, b_ref) = [(strided((48, 16), 1), strided((16,), 2)) for _ in range(2)]
    assert not w.is_contiguous() and not b.is_contiguous()
    opt = BUILDERS[build]([dict(params=[("w", w)]), dict(params=[("b", b)], algorithm="adamw")], single_process_group)
    ref = [torch.optim.Muon([w_ref]), torch.optim.AdamW([b_ref])]
    g = torch.Generator().manual_seed(10)
    for _ in range(3):
        for p, q in ((w, w_ref), (b, b_ref)):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        for o in [opt] + ref:
            o.step()
    assert torch.equal(w, w_ref) and torch.equal(b, b_ref) and not w.is_contiguous()


COPIERS = {"deepcopy": copy.deepcopy, "pickle": lambda obj: pickle.loads(pickle.dumps(obj))}


@pytest.mark.parametrize("copier", COPIERS)
def test_a_copy_of_dtensor_muon_steps_as_the_original(single_process_group, copier):
    """copy.deepcopy(opt) (torch's test_deepcopy_copies_all_public_attrs) and pickling copy the parameters and the
    state, and the copy's step on its own parameters is the original's, torch.equal (pickled: its process group
    found again, the world)."""
    grads, start = gradients(2, seed=11), TinyNet().state_dict()
    model, opt = ours("dtensor", "plain", start, single_process_group)
    set_grads(model, grads[0])
    opt.step()
    twin = COPIERS[copier]((model, opt))
    assert set(twin[1].__dict__) == set(opt.__dict__) and twin[1].param_groups[0]["params"][0] is not \
        opt.param_groups[0]["params"][0]
    for m, o in ((model, opt), twin):
        set_grads(m, grads[1])
        o.step()
    want, got, copied = torch_reference(start, grads), unwrapped(model), unwrapped(twin[0])
    assert all(torch.equal(got[n], want[n]) and torch.equal(copied[n], want[n]) for n in want)
    assert twin[1].axis.group is opt.axis.group is torch.distributed.group.WORLD


def test_a_pickled_dtensor_muon_of_a_subgroup_finds_it_again(single_process_group):
    """Built on a process group other than the world (of the same one rank), pickled and unpickled: the copy steps
    on that group, as torch.optim.Muon's pickled copy steps, torch.equal."""
    subgroup = torch.distributed.new_group([0])
    w, w_ref = [torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(3))) for _ in range(2)]
    copies = [pickle.loads(pickle.dumps(o)) for o in (DTensorMuon([("w", w)], group=subgroup),
                                                      torch.optim.Muon([w_ref]))]
    assert copies[0].axis.group is subgroup
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        grad = torch.randn(6, 4, generator=g)
        for o in copies:
            o.param_groups[0]["params"][0].grad = grad.clone()
            o.step()
    mine, theirs = (o.param_groups[0]["params"][0] for o in copies)
    assert torch.equal(mine, theirs) and not torch.equal(mine, w)


CYCLES = {  # torch's schedulers that read optimizer.defaults for a momentum (Muon's) or betas (AdamW's) to cycle
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=4),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.05, step_size_up=2),
}


@pytest.mark.parametrize("algorithm", ["muon", "adamw"])
@pytest.mark.parametrize("schedule", CYCLES)
def test_schedulers_that_cycle_momentum_cycle_it_as_torchs(single_process_group, schedule, algorithm):
    """DTensorMuon's defaults are torch's optimizer's (with the constructor's options): OneCycleLR and CyclicLR
    find the momentum (Muon) or betas (AdamW) there and cycle it, three steps torch.equal to torch.optim.Muon's
    (or AdamW's) under the same scheduler."""
    grads, start = gradients(3, seed=12), TinyNet().state_dict()
    model, reference = TinyNet(), TinyNet()
    model.load_state_dict(start)
    reference.load_state_dict(start)
    pick = (lambda n, p: p.ndim == 2 and n != "embed.weight") if algorithm == "muon" else (lambda n, p: p.ndim == 1)
    torch_class = torch.optim.Muon if algorithm == "muon" else torch.optim.AdamW
    opt = DTensorMuon([dict(params=[(n, p) for n, p in model.named_parameters() if pick(n, p)],
                            algorithm=algorithm)], weight_decay=0.05)
    ref = torch_class([p for n, p in reference.named_parameters() if pick(n, p)], weight_decay=0.05)
    assert opt.defaults == {k: v for k, v in ref.defaults.items() if k != "decoupled_weight_decay"}  # AdamW's own
    schedulers = [CYCLES[schedule](o) for o in (opt, ref)]
    for step_grads in grads:
        for m in (model, reference):
            set_grads(m, step_grads)
        for o in [opt, ref] + schedulers:
            o.step()
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_a_momentum_a_scheduler_gives_an_adamw_group_is_refused(single_process_group):
    """A Muon and an AdamW group: OneCycleLR cycles the Muon group's momentum and writes one into the AdamW group too,
    which AdamW does not take: the step refuses it in one line (never ignored), nothing moved."""
    model, opt = ours("dtensor", "plain", TinyNet().state_dict(), single_process_group)
    CYCLES["OneCycleLR"](opt)
    set_grads(model, gradients(1)[0])
    weights = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"^rank 0: param group 1 \(adamw\): momentum: not an option of "
                                         r"torch.optim.AdamW"):
        opt.step()
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("given", ["pairs", "param_names", "plain"])
def test_state_dict_reports_the_names_torch_reports(single_process_group, given):
    """param_names in state_dict() as torch.optim.Muon's: the names given as (name, tensor) pairs or as a group's
    own param_names beside plain tensors, none for plain tensors alone (the plan's "0", "1" stay internal)."""
    w, v = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3, 5))
    group = {"pairs": dict(params=[("w", w), ("v", v)]), "param_names": dict(params=[w, v], param_names=["w", "v"]),
             "plain": dict(params=[w, v])}[given]
    saved = [cls([dict(group)]).state_dict()["param_groups"][0].get("param_names")
             for cls in (DTensorMuon, torch.optim.Muon)]
    assert saved[0] == saved[1] == (None if given == "plain" else ["w", "v"]), saved
