"""Independent single-device references for what large runs add (issue 20): fused blocks, per-iteration
Newton-Schulz coefficients (Polar Express) and QK-clip, written from the papers' equations on top of
torch.optim.Muon itself, never from the distributed optimizers (nor from muon_tools/reference.py, which
tests/test_large_runs.py checks against this file). Importable by any test (the DTensor optimizer's too).

  * Blocks (Moonlight's Q, K, V apart, or each head apart): torch.optim.Muon with every block a separate
    parameter; its own lr adjustment then sees each block's shape.
  * Polar Express (arXiv 2505.16932): torch.optim.Muon with its Newton-Schulz
    (torch.optim._muon._zeropower_via_newtonschulz) swapped for newton_schulz_per_iteration below: torch's
    own operations, in torch's order, with one (a, b, c) per iteration.
  * QK-clip (Kimi K2, arXiv 2507.20534, per-head): after the step, where S_h, the largest logit of query
    head h over every rank, exceeds tau: with one query head per key head, its q and k rows times
    sqrt(tau / S_h); with keys shared (GQA), its q rows times tau / S_h and the keys left alone.

A layout is anything with .sizes (rows of each segment in one period), .periods (key heads) and .names (of
the segments, "q" and "k" are clipped), such as distmuon.large_runs.RowLayout; the rows are computed here.
"""

import contextlib
import math
from unittest import mock

import torch


def newton_schulz_per_iteration(grad, coefficients, steps, eps=1e-7):
    """torch.optim.Muon's Newton-Schulz, operation for operation (bf16, the Gram matrix of the wide
    orientation, norm clamped by eps, then addmm twice per iteration), with coefficients[i] at
    iteration i; past the list, its last triple."""
    x = grad.to(dtype=torch.bfloat16, copy=True)
    transposed = grad.size(0) > grad.size(1)
    if transposed:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for i in range(steps):
        a, b, c = coefficients[min(i, len(coefficients) - 1)]
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if transposed else x


@contextlib.contextmanager
def torch_muon_with_coefficients(coefficients):
    """Inside: torch.optim.Muon's step orthogonalizes with newton_schulz_per_iteration(coefficients)."""
    def zeropower(grad, ns_coefficients, ns_steps, eps):
        return newton_schulz_per_iteration(grad, coefficients, ns_steps, eps)

    with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz", zeropower):
        yield


def segment_rows(layout, head, segment):
    """The rows of `segment` in head `head` of a matrix laid out head by head."""
    start = head * sum(layout.sizes) + sum(layout.sizes[:segment])
    return range(start, start + layout.sizes[segment])


def block_rows(layout, per_head):
    """Each block's rows: per_head, every segment of every head alone; else the segments of one name joined
    across heads (all the query heads' "q" rows are one Q), an unnamed segment joined with itself only."""
    segments = range(len(layout.sizes))
    if per_head:
        return [list(segment_rows(layout, h, s)) for h in range(layout.periods) for s in segments]
    names = list(layout.names) or list(segments)
    return [[r for h in range(layout.periods) for s in segments if names[s] == name for r in segment_rows(layout, h, s)]
            for name in sorted(set(names), key=names.index)]


def qk_clip_(weight, layout, max_logits, tau):
    """Kimi K2's per-head QK-clip of one matrix, in place: returns each query head's multiplier.
    max_logits holds one value per query head (the "q" segments of every period, in row order; a matrix of
    "k" rows only: one per period). gamma = tau / S where S > tau. One query head a period (MHA): its q
    rows and its period's k rows times sqrt(gamma). Several (GQA, keys shared): its q rows times gamma and
    the k rows untouched, as the report treats MLA's shared rotary key."""
    q_segments = [i for i, name in enumerate(layout.names) if name == "q"]
    k_segments = [i for i, name in enumerate(layout.names) if name == "k"]
    shared = len(q_segments) > 1
    multipliers = []
    for head, s in enumerate(max_logits.tolist()):
        gamma = tau / s if s > tau else 1.0
        period, j = divmod(head, len(q_segments)) if q_segments else (head, None)
        scale = gamma if shared else math.sqrt(gamma)
        rows = [segment_rows(layout, period, q_segments[j])] if q_segments else []
        rows += [] if shared else [segment_rows(layout, period, k) for k in k_segments]
        for r in rows:
            if scale != 1.0:
                weight[r.start:r.stop].mul_(scale)
        multipliers.append(scale)
    return multipliers


def reference_muon(params, grads, *, lr, weight_decay, momentum, nesterov=True, ns_steps=5,
                   adjust_lr_fn="original", coefficients=None, layouts=None, per_head=None, tau=None,
                   max_logits=None):
    """torch.optim.Muon on the matrices `params` ({name: full tensor}, left untouched), one step per
    entry of `grads` (a list of {name: full gradient}); returns (final {name: tensor}, multipliers).

    coefficients: None (torch's), or one (a, b, c) per iteration (torch's Newton-Schulz swapped).
    layouts: {name: layout}; with per_head False (blocks) or True (heads), those matrices are stepped
        as their blocks, separate parameters. tau, max_logits (a list per step of {name: (heads,)}, the
        maximum over every rank): QK-clip after each step; multipliers: a list per step of {name: [..]}.
    """
    params = {n: p.detach().clone() for n, p in params.items()}
    blocks = ({} if per_head is None else
              {n: [torch.tensor(rows) for rows in block_rows(layout, per_head)] for n, layout in layouts.items()})
    tensors = {n: [params[n][i] for i in blocks[n]] if n in blocks else [params[n]] for n in params}
    opt = torch.optim.Muon([t for ts in tensors.values() for t in ts], lr=lr, weight_decay=weight_decay,
                           momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
    multipliers = []
    for step, step_grads in enumerate(grads):
        for name, ts in tensors.items():
            for t, index in zip(ts, blocks.get(name, [None])):
                t.grad = step_grads[name] if index is None else step_grads[name][index]
        with torch_muon_with_coefficients(coefficients) if coefficients is not None else contextlib.nullcontext():
            opt.step()
        for name, index in blocks.items():
            for t, i in zip(tensors[name], index):
                params[name][i] = t
        if tau is not None:
            multipliers.append({n: qk_clip_(params[n], layouts[n], max_logits[step][n], tau) for n in max_logits[step]})
            for name, index in blocks.items():
                for t, i in zip(tensors[name], index):
                    t.copy_(params[name][i])
    return params, multipliers


# -- checks shared by the tests of every optimizer (the lesson's and DTensorMuon) ---------------------
def assert_qk_multipliers(returned, expected, held):
    """clip_qk_'s contract (the lesson's DistributedMuon.clip_qk_): one entry for every laid-out matrix with
    q or k rows (`expected`: {name: [multiplier of each head]}), each head's multiplier where this rank
    holds its q or k rows (held: {name: set of heads}), None elsewhere."""
    assert returned == {n: [m if h in held[n] else None for h, m in enumerate(ms)] for n, ms in expected.items()}, \
        (returned, expected, held)


def shape_only_gram_bound(shape):
    """The bound tp_newton_schulz="gram" first had (GRAM_NS_BOUND): 2**-5 of the largest entry of torch's
    orthogonal matrix, times sqrt(m / 64) past m = 64 (m the short side), whatever the input. Kept to show
    that nearly low-rank inputs break it, and why the bound now comes from the input (gram_ns_tolerance)."""
    return 2.0**-5 * max(1.0, math.sqrt(min(shape) / 64))
