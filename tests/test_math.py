"""Section 1 of the script against PyTorch's own Muon and AdamW, bit for bit."""

import math

import pytest
import torch
from torch.optim._muon import _adjust_lr as torch_adjust_lr
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz
from torch.utils.flop_counter import FlopCounterMode

import distributed_muon_cpu
from distmuon import checks
from distmuon import owners
import muon_tools
from distmuon.adamw import adamw_

SHAPES = [(1, 1), (3, 5), (5, 3), (64, 64), (384, 128), (128, 512), (8, 128), (257, 31)]


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_is_torchs(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    matrix = torch.randn(shape, generator=g).to(dtype)
    expected = torch_newton_schulz(matrix.clone(), distributed_muon_cpu.NS_COEFFICIENTS, distributed_muon_cpu.NS_STEPS,
                                   distributed_muon_cpu.NS_EPS)
    got = distributed_muon_cpu.newton_schulz(matrix)
    assert got.dtype == torch.bfloat16 and got.shape == matrix.shape
    assert torch.equal(got, expected)


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_newton_schulz_steps_and_coefficients(steps):
    matrix = torch.randn(48, 80, generator=torch.Generator().manual_seed(steps))
    coefficients = (2.0, -1.5, 0.5)
    expected = torch_newton_schulz(matrix, coefficients, steps, 1e-5)
    assert torch.equal(distributed_muon_cpu.newton_schulz(matrix, steps, coefficients, 1e-5), expected)


def test_newton_schulz_does_not_modify_a_bf16_input():
    matrix = torch.randn(16, 32).bfloat16()
    before = matrix.clone()
    distributed_muon_cpu.newton_schulz(matrix)
    assert torch.equal(matrix, before)


def test_newton_schulz_orthogonalizes():
    # Not a bit-identity check: a sanity check that the math does what Muon needs.
    # The quintic iteration leaves singular values roughly in [0.5, 1.5] (Keller Jordan).
    s = torch.linalg.svdvals(distributed_muon_cpu.newton_schulz(torch.randn(64, 256)).float())
    assert s.min() > 0.5 and s.max() < 1.5


@pytest.mark.parametrize("fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(384, 128), (128, 512), (128, 128), (8, 128)])
def test_adjusted_lr_is_torchs(fn, shape):
    assert distributed_muon_cpu.adjusted_lr(0.02, fn, shape) == torch_adjust_lr(0.02, fn, torch.Size(shape))


def test_newton_schulz_flops_match_torchs_flop_counter():
    for shape in SHAPES:
        with FlopCounterMode(display=False) as counter:
            distributed_muon_cpu.newton_schulz(torch.randn(shape))
        assert distributed_muon_cpu.newton_schulz_flops(shape) == counter.get_total_flops(), shape


@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (33, 1), (1, 33), (7, 7), (257, 31)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("fn", ["original", "match_rms_adamw", "spectral_unclamped"])
def test_the_single_device_step_is_torch_optim_muons(shape, nesterov, fn):
    """Section 1's muon_step_, the step the lesson distributes, against torch.optim.Muon: four steps, bit for bit,
    on tall, wide, k x 1, 1 x k and odd shapes, each seeded apart."""
    g = torch.Generator().manual_seed(sum(shape) + 7 * nesterov)
    start = torch.randn(shape, generator=g)
    ours, theirs = start.clone(), torch.nn.Parameter(start.clone())
    opt = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=fn)
    group = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=fn,
                 ns_steps=distributed_muon_cpu.NS_STEPS,
                 ns_coefficients=distributed_muon_cpu.NS_COEFFICIENTS, eps=distributed_muon_cpu.NS_EPS)
    buf = torch.zeros_like(start)
    for _ in range(4):
        grad = torch.randn(start.shape, generator=g)
        theirs.grad = grad.clone()
        opt.step()
        distributed_muon_cpu.muon_step_(ours, grad, buf, group)
        assert torch.equal(ours, theirs.detach())
    assert torch.equal(buf, opt.state[theirs]["momentum_buffer"])
    assert not torch.equal(ours, start)


def test_the_lessons_constants_are_torchs_defaults():
    """Section 1's NS_COEFFICIENTS, NS_STEPS, NS_EPS are torch.optim.Muon's defaults (distmuon.checks reads them)."""
    defaults = checks.TORCH_OPTIONS["muon"]
    assert (distributed_muon_cpu.NS_COEFFICIENTS, distributed_muon_cpu.NS_STEPS,
            distributed_muon_cpu.NS_EPS) == (defaults["ns_coefficients"], defaults["ns_steps"],
                                                            defaults["eps"])
    assert checks.NS_COEFFICIENT_CHOICES["jordan"] == distributed_muon_cpu.NS_COEFFICIENTS


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_on_shards_equals_torch_optim_adamw(weight_decay):
    """adamw_ applied to uneven pieces of a flat tensor gives torch.optim.AdamW's bits."""
    g = torch.Generator().manual_seed(2)
    start = torch.randn(1000, generator=g)
    cuts = [0, 1, 17, 256, 257, 600, 999, 1000]  # uneven pieces: SIMD bodies and tails fall differently
    theirs = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([theirs], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    ours = start.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(start), torch.zeros_like(start)
    for step in range(1, 6):
        grad = torch.randn(start.shape, generator=g)
        theirs.grad = grad.clone()
        opt.step()
        for lo, hi in zip(cuts, cuts[1:]):
            adamw_(ours[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], float(step),
                      lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
        assert torch.equal(ours, theirs.detach()), step


def test_sharded_momentum_equals_whole():
    g = torch.Generator().manual_seed(3)
    buf_whole, buf_parts = torch.randn(777, generator=g), None
    buf_parts = buf_whole.clone()
    grad = torch.randn(777, generator=g)
    whole = distributed_muon_cpu.muon_momentum_(buf_whole, grad, 0.95, True)
    parts = torch.cat([distributed_muon_cpu.muon_momentum_(buf_parts[lo:hi], grad[lo:hi], 0.95, True)
                       for lo, hi in [(0, 5), (5, 300), (300, 777)]])
    assert torch.equal(whole, parts) and torch.equal(buf_whole, buf_parts)


def test_gradient_draw_sums_exactly_in_any_order():
    specs = distributed_muon_cpu.transformer_specs()
    per_rank = [distributed_muon_cpu.dp_rank_grads(specs, 0, 1, r) for r in range(muon_tools.MAX_WORLD)]
    for name in ["embed.weight", "layers.0.mlp.fc1.weight"]:
        forward = sum(g[name] for g in per_rank)
        backward = sum(g[name] for g in reversed(per_rank))
        exact = sum(g[name].double() for g in per_rank)
        assert torch.equal(forward, backward) and torch.equal(forward.double(), exact)
        assert not torch.equal(per_rank[0][name], per_rank[1][name])  # DP ranks saw different data
    assert math.isclose(distributed_muon_cpu.GRAD_SCALE * distributed_muon_cpu.GRAD_MAX_INT * muon_tools.MAX_WORLD,
                        16.0)


# Shapes with a small side, where bf16 baddbmm and addmm round some near-ties differently, 40 seeds
# each; and one ordinary shape, 384 x 128, with fewer: without bf16 matrix units (the CI machine) it is slow.
SMALL_SIDE = [(600, 6), (6, 600), (60, 6), (6, 60), (97, 5), (5, 97), (64, 1), (1, 64), (64, 2), (2, 64),
              (257, 31)]
SEEDS = {**{shape: range(40) for shape in SMALL_SIDE}, (384, 128): range(8)}


def owned_matrices(shape, seed):
    """What an owner holds: three matrices of one shape (stacked when batching) and one of another."""
    g = torch.Generator().manual_seed(seed)
    full = {f"m{i}": torch.randn(shape, generator=g) for i in range(3)}
    full["other"] = torch.randn(shape[::-1], generator=g)
    return full


def orthogonalize_owned(full, batched):
    group = dict(ns_steps=distributed_muon_cpu.NS_STEPS, ns_coefficients=distributed_muon_cpu.NS_COEFFICIENTS,
                 eps=distributed_muon_cpu.NS_EPS)
    ledger = distributed_muon_cpu.Ledger()
    orthos = owners.newton_schulz_owned(full, {n: group for n in full}, ledger, batched=batched)
    assert sorted(r["name"] for r in ledger.compute) == sorted(full)  # each matrix counted once
    return orthos


@pytest.mark.parametrize("shape", SEEDS)
def test_owner_newton_schulz_is_torchs_on_every_seed(shape):
    """The default path of the owner and comm-free strategies: bit-identical to torch, seed after seed."""
    for seed in SEEDS[shape]:
        full = owned_matrices(shape, seed)
        for name, ortho in orthogonalize_owned(full, batched=False).items():
            expected = torch_newton_schulz(full[name].clone(), distributed_muon_cpu.NS_COEFFICIENTS,
                                           distributed_muon_cpu.NS_STEPS, distributed_muon_cpu.NS_EPS)
            assert torch.equal(ortho, expected), (shape, seed, name)


def test_batched_newton_schulz_is_within_its_bound():
    """--batched-ns: within BATCHED_NS_BOUND of torch's largest entry. Not bit-identical by construction (bf16
    baddbmm rounds some near-ties unlike addmm, the reason it is not the default), but whether a given matrix
    lands on torch's bits depends on the CPU's bf16 kernels: only the bound is asserted."""
    worst = 0.0
    for shape, seeds in SEEDS.items():
        for seed in seeds:
            full = owned_matrices(shape, seed)
            for name, ortho in orthogonalize_owned(full, batched=True).items():
                expected = torch_newton_schulz(full[name].clone(), distributed_muon_cpu.NS_COEFFICIENTS,
                                               distributed_muon_cpu.NS_STEPS, distributed_muon_cpu.NS_EPS)
                relative = ((ortho.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                worst = max(worst, relative)
    assert worst <= owners.BATCHED_NS_BOUND
