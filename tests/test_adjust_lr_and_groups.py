"""The lesson's optimizer options, as torch.optim.Muon / AdamW take them: every adjust_lr_fn torch accepts
(spectral_unclamped included) bit for bit against torch, and every param group's options checked at
construction (check_param_groups), for the lesson's DistributedMuon as for DTensorMuon (tests/test_dtensor.py);
and the named parameters checked by one function (named_params) for both, with the same words."""

import pytest
import torch
from torch.optim._muon import _adjust_lr as torch_adjust_lr

import distributed_muon_cpu
from distmuon import owners
from distmuon import checks
from distmuon.dtensor import DTensorMuon
from test_optimizer_api import TinyNet, split_groups


@pytest.mark.parametrize("fn", checks.ADJUST_LR_FNS + (None,))
@pytest.mark.parametrize("shape", [(384, 128), (128, 512), (128, 128), (8, 128)])
def test_every_adjust_lr_fn_torch_accepts_is_torchs(fn, shape):
    assert distributed_muon_cpu.adjusted_lr(0.02, fn, shape) == torch_adjust_lr(0.02, fn, torch.Size(shape))
    assert set(checks.ADJUST_LR_FNS) == {"original", "match_rms_adamw", "spectral_unclamped"}


def test_spectral_unclamped_steps_like_torch_on_one_rank(single_process_group):
    """The lesson's optimizer with a Muon group in spectral_unclamped (below 1 for the wide out.weight, 48 > 16
    columns) beside one in original and the AdamW group, fed the same random gradients as torch.optim.Muon with
    the same groups: torch.equal after every step."""
    torch.manual_seed(0)
    ours, theirs = TinyNet(), TinyNet()
    theirs.load_state_dict(ours.state_dict())
    groups = split_groups(ours)
    (hidden, _), (out, _) = groups[0]["params"]
    opt = owners.OPTIMIZERS["owner"]([dict(params=[groups[0]["params"][0]], adjust_lr_fn="spectral_unclamped"),
                                  dict(params=[groups[0]["params"][1]]), groups[1]],
                                 grid=single_process_group, bucket_size=300, lr=0.02)
    named = dict(theirs.named_parameters())
    ref = [torch.optim.Muon([dict(params=[named[hidden]], adjust_lr_fn="spectral_unclamped"),
                             dict(params=[named[out]])], lr=0.02, weight_decay=0.1, adjust_lr_fn="original"),
           torch.optim.AdamW([named[n] for n in groups[1]["param_names"]], lr=0.02)]  # torch's defaults, as ours
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        for name, p in ours.named_parameters():
            p.grad = torch.randn(p.shape, generator=g)
            named[name].grad = p.grad.clone()
        opt.step()
        for o in ref:
            o.step()
        assert all(torch.equal(p, named[n]) for n, p in ours.named_parameters()), step
    assert distributed_muon_cpu.adjusted_lr(0.02, "spectral_unclamped", (16, 48)) < 0.02


@pytest.mark.parametrize("group,message", [
    (dict(adjust_lr_fn="spectral"), "Adjust learning rate function spectral is not supported: param group 0 (muon): "
                                    "adjust_lr_fn must be None or one of original, match_rms_adamw, "
                                    "spectral_unclamped (got 'spectral')"),
    (dict(lr=float("nan")), "param group 0 (muon): lr must be >= 0 and finite (got nan)"),
    (dict(momentum=-0.1), "param group 0 (muon): momentum must be in [0, 1) (got -0.1)"),
])
def test_the_lessons_optimizer_checks_every_group(single_process_group, group, message):
    groups = split_groups(TinyNet())
    groups[0].update(group)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        owners.OPTIMIZERS["gather"](groups, grid=single_process_group)
    groups = split_groups(TinyNet())
    groups[1].update(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"param group 1 \(adamw\): betas must be in \[0, 1\) \(got 1.0\)"):
        owners.OPTIMIZERS["gather"](groups, grid=single_process_group)


@pytest.mark.parametrize("make_groups,message", [
    (lambda m: [dict(params=list(m.parameters()))],
     "Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([48]). Muon needs 2-D "
     "parameters; 2 has shape (48,): put it in a group of algorithm 'adamw' (muon_param_groups splits a model the "
     "way Muon users do)"),
    (lambda m: [dict(params=list(m.named_parameters()), algorithm="sgd")],
     "param group 0: algorithm must be 'muon', 'normuon' or 'adamw' (got 'sgd')"),
    (lambda m: split_groups(m) + [dict(params=[("out.weight", torch.nn.Parameter(torch.zeros(16, 48)))])],
     "parameter out.weight appears twice"),
    (lambda m: [dict(split_groups(m)[0], lr=-1.0)], "param group 0 (muon): lr must be >= 0 and finite (got -1.0)"),
])
def test_both_optimizers_check_named_params_with_one_function(single_process_group, make_groups, message):
    """The lesson's DistributedMuon and DTensorMuon refuse the same groups with the same line: distmuon.checks.named_params."""
    for build in (lambda groups: distributed_muon_cpu.DistributedMuon(groups, grid=single_process_group), DTensorMuon):
        with pytest.raises(ValueError) as refused:
            build(make_groups(TinyNet()))
        assert str(refused.value) == message


def test_the_lessons_zero1_optimizers_keep_float32_parameters(single_process_group):
    """Their flat buffers are float32: a float64 model is refused in one line (DTensorMuon steps it as torch does:
    tests/torch_optim/test_contract.py, test_dtype)."""
    with pytest.raises(ValueError) as refused:
        distributed_muon_cpu.DistributedMuon(split_groups(TinyNet().double()), grid=single_process_group)
    assert str(refused.value) == "hidden.weight is torch.float64; this reference keeps float32 parameters"
