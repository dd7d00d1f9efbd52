"""Section 9, second half: torch's reference (torch.optim.Muon / AdamW on the full parameters, fed every DP rank's
gradient: reference_params), NorMuon's, the bounds of the two opt-ins that are not bit for bit (batched_ns_tolerance,
gram_tolerance), and the check of a run against it (bound, verify, verdict)."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import replace
from unittest import mock

import torch

from distmuon import checks
import distributed_muon_cpu
from distmuon.checks import NS_COEFFICIENT_CHOICES
from distmuon.large_runs import gram_eligible
from distmuon.owners import BATCHED_NS_BOUND
from distributed_muon_cpu import (NS_COEFFICIENTS, NS_EPS, NS_STEPS, adjusted_lr, dp_rank_grads, initial_params,
                                  newton_schulz)
from muon_tools.settings import (MUON_GROUP, RunConfig, after_step, build_optimizer, demo_row_layouts, demo_specs,
                                 dp_rank_max_logits, group_hyperparameters)


class NorMuonReference(torch.optim.Optimizer):
    """NorMuon on one device, written from the paper (Li et al., arXiv 2510.05491) and its authors' reference code
    (github.com/zichongli5/NorMuon, normuon.py), on torch.optim.Muon's own pieces: its momentum (lerp, Nesterov),
    its Newton-Schulz (torch.optim._muon._zeropower_via_newtonschulz) and its lr adjustment (_adjust_lr). Then,
    per matrix, in float32: v <- lerp(v, mean over columns of O * O, 1 - beta2), one value per row; O divided by
    sqrt(v) + eps row by row; rescaled to O's Frobenius norm (||O|| / (||O / d|| + eps)); the step as Muon's. The
    independent check of the library's NorMuon (distmuon/normuon.py and the strategies that distribute it)."""

    def __init__(self, params, **options):
        """params and options as torch.optim.Muon takes them (param groups too), and beta2, normuon_eps; each option's
        default the library's (distmuon.checks.OPTIONS["normuon"]: torch.optim.Muon's, and the authors' two)."""
        unknown = set(options) - set(checks.OPTIONS["normuon"])
        if unknown:
            raise TypeError(f"NorMuonReference takes no {', '.join(sorted(unknown))}")
        super().__init__(params, dict(checks.OPTIONS["normuon"], **options))

    @torch.no_grad()
    def step(self):
        for h in self.param_groups:
            for p in h["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(momentum_buffer=torch.zeros_like(p), v=torch.zeros(p.shape[0], 1, device=p.device))
                buf, v = state["momentum_buffer"], state["v"]
                buf.lerp_(p.grad, 1 - h["momentum"])
                update = p.grad.lerp(buf, h["momentum"]) if h["nesterov"] else buf
                o = torch.optim._muon._zeropower_via_newtonschulz(update, h["ns_coefficients"], h["ns_steps"],
                                                                 h["eps"]).float()
                v.lerp_((o * o).mean(dim=-1, keepdim=True), 1 - h["beta2"])
                o_hat = o / (v.sqrt() + h["normuon_eps"])
                o_hat = o_hat * (o.norm() / (o_hat.norm() + h["normuon_eps"]))
                p.mul_(1 - h["lr"] * h["weight_decay"])
                p.add_(o_hat, alpha=-torch.optim._muon._adjust_lr(h["lr"], h["adjust_lr_fn"], p.shape))


def torch_optimizers(groups):
    """The single-device reference for param groups as DistributedMuon takes them, with plain
    tensors for params: torch.optim.Muon for each Muon group, torch.optim.AdamW for each AdamW one, and
    NorMuonReference for each NorMuon one (torch has no NorMuon)."""
    optimizers = []
    for h in groups:
        if not h["params"]:
            continue
        if h["algorithm"] == "normuon":
            # its coefficients: torch's default, swapped for one per iteration as torch.optim.Muon's are (below)
            optimizers.append(NorMuonReference(h["params"], **{k: v for k, v in h.items()
                                                                if k not in ("params", "algorithm", "ns_coefficients")}))
        elif h["algorithm"] == "muon":
            optimizers.append(torch.optim.Muon(h["params"], lr=h["lr"], weight_decay=h["weight_decay"],
                                               momentum=h["momentum"], nesterov=h["nesterov"],
                                               ns_steps=h["ns_steps"], adjust_lr_fn=h["adjust_lr_fn"]))
        else:
            # foreach=False: torch's single-tensor AdamW, its default on the CPU; on a GPU
            # torch would pick the multi-tensor kernels, whose rounding may differ.
            optimizers.append(torch.optim.AdamW(h["params"], lr=h["lr"], betas=h["betas"], eps=h["eps"],
                                                weight_decay=h["weight_decay"], foreach=False))
    return optimizers


def total_grads(specs, seed, step, dp, missing=()):
    """The gradient the single-device reference sees: the sum over the DP ranks that have
    one (a missing gradient counts as zeros, as in DDP), or None where no rank has one."""
    per_rank = [dp_rank_grads(specs, seed, step, r, missing) for r in range(dp)]
    total = {}
    for s in specs:
        present = [grads[s.name] for grads in per_rank if grads[s.name] is not None]
        total[s.name] = sum(present) if present else None
    return total


# The reference of section 8's options, written from the papers' equations and torch's own code,
# not from the lesson's optimizers: torch.optim.Muon steps the blocks as separate parameters; its
# Newton-Schulz is swapped for the same operations with one (a, b, c) per iteration; QK-clip
# scales the reference's rows from the maxima of every DP rank.
@contextlib.contextmanager
def torch_newton_schulz_per_iteration(coefficients):
    """torch.optim.Muon with its _zeropower_via_newtonschulz replaced by torch's own operations, taking
    coefficients[i] at iteration i (the last one repeated). Nothing is replaced for one triple."""
    if isinstance(coefficients[0], (int, float)):
        yield
        return

    def zeropower(grad, ns_coefficients, ns_steps, eps):
        x = grad.to(dtype=torch.bfloat16, copy=True)
        if grad.size(0) > grad.size(1):
            x = x.T
        x.div_(x.norm().clamp(min=eps))
        for i in range(ns_steps):
            a, b, c = coefficients[min(i, len(coefficients) - 1)]
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz", zeropower):
        yield


@contextlib.contextmanager
def ns_inputs_recorded(optimizers, name_of, record):
    """Inside, the Newton-Schulz (whichever is in place) of every torch.optim.Muon among `optimizers` also
    appends its input, as the bf16 it first becomes, to record[name] (name_of: {id(param): name}; others
    are left out): torch calls it for the parameters with a gradient, in order."""
    inputs, inner = [], torch.optim._muon._zeropower_via_newtonschulz

    def recorded(grad, *args):
        inputs.append(grad.to(torch.bfloat16, copy=True))
        return inner(grad, *args)

    with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz", recorded):
        yield
    stepped = [p for opt in optimizers if isinstance(opt, (torch.optim.Muon, NorMuonReference))
               for g in opt.param_groups for p in g["params"] if p.grad is not None]
    for p, x in zip(stepped, inputs, strict=True):
        if id(p) in name_of:
            record.setdefault(name_of[id(p)], []).append(x)


def clip_rows_(weight, rows, max_logit, tau):
    """Kimi K2's per-head QK-clip on the reference: the head's q and k rows times sqrt(min(1, tau / S))."""
    if max_logit > tau:
        weight[rows].mul_(math.sqrt(min(1.0, tau / max_logit)))


def torch_reference_steps(specs, cfg, device, step_ms=None):
    """torch.optim.Muon / AdamW on one device, the run's steps: (its final params on the CPU, {matrix stepped
    whole: its Newton-Schulz inputs}). step_ms: a list to fill with each step's optimizer time in ms, the
    device synchronized around it (benchmarks/torch_step.py); the inputs then go unrecorded, so that only
    torch's own work is timed."""
    torch.set_num_threads(1)  # same thread count as every rank: bf16 matmul bits can depend on it
    params = {n: t.to(device) for n, t in initial_params(specs, cfg.seed).items()}
    layouts = {} if cfg.baseline else demo_row_layouts(specs, cfg)
    blocks = {} if cfg.ns_blocks == "whole" else {n: [torch.tensor(r) for r in rows.blocks(cfg.ns_blocks == "heads")]
                                                  for n, rows in layouts.items()}
    separate = {n: [params[n][index] for index in indices] for n, indices in blocks.items()}  # the blocks, copied
    optimizers = torch_optimizers([dict(h, params=[t for s in specs if s.group == g
                                                   for t in separate.get(s.name, [params[s.name]])])
                                   for g, h in group_hyperparameters(cfg).items()])
    ns_inputs, whole = {}, {id(params[n]): n for n in params if n not in separate}  # what bounds gram: its inputs
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for step in range(1, cfg.steps + 1):
        grads = total_grads(specs, cfg.seed, step, cfg.dp, cfg.missing_grads)
        for s in specs:  # None where no rank has a gradient: torch skips the parameter
            grad = None if grads[s.name] is None else grads[s.name].to(device)
            for t, index in zip(separate.get(s.name, [params[s.name]]), blocks.get(s.name, [None])):
                t.grad = grad if grad is None or index is None else grad[index]
        if step_ms is not None:
            sync()  # the gradients' copies ended: only the step is timed
        t0 = time.perf_counter()
        with torch_newton_schulz_per_iteration(NS_COEFFICIENT_CHOICES[cfg.ns_coefficients]), \
                ns_inputs_recorded(optimizers, whole, ns_inputs) if step_ms is None else contextlib.nullcontext():
            for opt in optimizers:
                opt.step()
        if step_ms is not None:
            sync()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        for name, ts in separate.items():
            for t, index in zip(ts, blocks[name]):
                params[name][index] = t
        if cfg.qk_clip_tau is not None:
            maxima = [dp_rank_max_logits(specs, cfg.seed, step, r) for r in range(cfg.dp)]
            for name, rows in layouts.items():
                s = torch.stack([m[name] for m in maxima]).amax(0).tolist()
                for h in range(rows.periods):
                    for segment, label in enumerate(rows.names):
                        if label in ("q", "k"):
                            clip_rows_(params[name], slice(rows.segment_rows(h, segment).start,
                                                           rows.segment_rows(h, segment).stop), s[h], cfg.qk_clip_tau)
                for t, index in zip(separate.get(name, []), blocks.get(name, [])):
                    t.copy_(params[name][index])
    return {n: p.cpu() for n, p in params.items()}, ns_inputs


@functools.lru_cache(maxsize=16)
def _reference_params(specs, cfg, device):
    return torch_reference_steps(specs, cfg, device)


def reference_params(specs, cfg, device="cpu", ns_inputs=None):
    """Run torch.optim.Muon / torch.optim.AdamW on one device; return the final params (on the CPU).

    The result depends on what the ranks were fed (the model, the seed, the steps, DP's number of
    gradient contributions, the hyperparameters), not on how they split the work (TP, strategy,
    buckets, overlap). So it is kept for the runs of one process that share those inputs, e.g.
    benchmarks/compare.py's four strategies and the tests: torch computes it once for them.
    ns_inputs: a dict to fill with {matrix stepped whole: [its Newton-Schulz input at each step]}.
    """
    how = dict(tp=1, strategy="gather", bucket_size=RunConfig.bucket_size, overlap=0, batched_ns=False,
               tp_newton_schulz="gather", timeout_s=RunConfig.timeout_s, fail_rank=-1, backend="gloo", device="cpu")
    params, inputs = _reference_params(tuple(specs), replace(cfg, **how), device)
    if ns_inputs is not None:
        ns_inputs.update(inputs)
    return {n: t.clone() for n, t in params.items()}


def muon_groups_of(cfg):
    """The param groups that run Muon: none in the AdamW ZeRO-1 baseline."""
    return () if cfg.baseline else (MUON_GROUP,)


def batched_ns_tolerance(steps, lr, adjust_lr_fn, shape, bound=BATCHED_NS_BOUND):
    """How far --batched-ns may leave a Muon matrix of `shape` (rows, cols) from torch's after `steps` steps.

    Each step adds -adjusted_lr * O, and a batched O differs from torch's by at most
    `bound` times its largest entry (section 7). That entry is at most the
    largest singular value Newton-Schulz leaves: about 1.2, the quintic's maximum on
    [0, 1]; 1.5 leaves room for bf16 rounding. Weight decay scales both runs alike
    and only shrinks earlier differences, as QK-clip's multipliers (<= 1) do; the
    momentum does not depend on the weights.
    """
    return steps * adjusted_lr(lr, adjust_lr_fn, shape) * 1.5 * bound


# newton_schulz_tp (section 8.3) against torch's Newton-Schulz of the whole matrix: both are bf16
# evaluations of the same iteration, so |O_gram - O_torch| <= |O_gram - O_64| + |O_torch - O_64|,
# O_64 the iteration in float64 on the same input, and torch's own error is computed on each
# step's real input. The Gram path does torch's operations on the same bf16 values but two, the
# norm and the Gram matrix: float32 sums over the ranks in another order than one matmul's, each
# rounded to bf16 once as torch rounds, so they differ only where a sum lies near a bf16 tie.
# Its error against O_64 is assumed at most GRAM_ERROR_RATIO x torch's (an assumption, not a
# theorem: a rounding can land either side; tests/test_large_runs.py checks it on every matrix of
# its sweeps and prints the largest, and 1.25 leaves room above it). No bound from the shape
# alone holds: on a nearly low-rank input (momenta often are) the quintic (slope a > 3 at 0, each
# iteration) blows what rounding leaves in the small singular values up to O(1) entries, in
# torch's result as in this one.
GRAM_ERROR_RATIO = 1.25


def gram_ns_tolerance(update, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, eps=NS_EPS, result=None):
    """The largest |newton_schulz_tp - newton_schulz| allowed on this input, entrywise: (1 + GRAM_ERROR_RATIO)
    x torch's own error, max |newton_schulz(update) - the same iteration in float64 on the bf16 input both see|.
    result: newton_schulz(update, steps, coefficients, eps), where the caller has it already (a sweep that
    compares against it too): not computed again."""
    exact = newton_schulz(update.bfloat16(), steps, coefficients, eps, dtype=torch.float64)
    if result is None:
        result = newton_schulz(update, steps, coefficients, eps)
    torch_error = (result.double() - exact).abs().max().item()
    return (1 + GRAM_ERROR_RATIO) * torch_error


def gram_tolerance(inputs, lr, adjust_lr_fn, shape, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, eps=NS_EPS):
    """How far --tp-newton-schulz gram may leave a matrix of `shape` from torch's after the steps whose
    Newton-Schulz inputs were `inputs`: each step moves it by adjusted_lr x its O (batched_ns_tolerance's
    argument), so the sum of adjusted_lr x gram_ns_tolerance."""
    return adjusted_lr(lr, adjust_lr_fn, shape) * sum(gram_ns_tolerance(x, steps, coefficients, eps) for x in inputs)


def gram_names(specs, cfg):
    """The matrices a run orthogonalizes with newton_schulz_tp: --tp-newton-schulz gram, TP > 1, not by blocks."""
    if cfg.tp_newton_schulz != "gram" or cfg.tp == 1:
        return set()
    blocked = set(demo_row_layouts(specs, cfg)) if cfg.ns_blocks != "whole" else set()
    return {s.name for s in specs if s.group == MUON_GROUP and s.name not in blocked
            and gram_eligible(s.global_shape, s.tp_split_dim)}


def bound(cfg, checks, device="cpu"):
    """check_against_torch's rows (the lesson's section 6), each with what the report shows beside it: the
    parameter's global shape, split and optimizer, the tolerance of its opt-in (0: bit for bit) and "ok".

    A check is "ok" when bit-identical; with --batched-ns, a Muon matrix is also ok within
    batched_ns_tolerance (it cannot be bit-identical, section 7), and with --tp-newton-schulz gram, a
    matrix newton_schulz_tp orthogonalized within gram_tolerance of its Newton-Schulz inputs in torch's
    run (reference_params records them: run here, on `device`, for those runs only).
    """
    specs, muon_groups = demo_specs(cfg), muon_groups_of(cfg)
    gram, ns_inputs = gram_names(specs, cfg), {}
    if gram:
        reference_params(specs, cfg, device, ns_inputs)
    rows = []
    for c, spec in zip(checks, specs, strict=True):
        optimizer = "Muon" if spec.group in muon_groups else "AdamW"
        tolerance = (batched_ns_tolerance(cfg.steps, cfg.lr, cfg.adjust_lr_fn, spec.global_shape)
                     if cfg.batched_ns and optimizer == "Muon" else
                     gram_tolerance(ns_inputs[spec.name], cfg.lr, cfg.adjust_lr_fn, spec.global_shape,
                                    cfg.ns_steps, cfg.ns_coefficients) if spec.name in gram else 0.0)
        rows.append(dict(c, global_shape=list(spec.global_shape), tp_split_dim=spec.tp_split_dim,
                         optimizer=optimizer, tolerance=tolerance,
                         ok=c["identical"] or c["max_abs_diff"] <= tolerance))
    return rows


def verify(cfg, results, device="cpu"):
    """Every rank's run_steps results against torch on `device`, as rank 0 checks them in run_rank:
    (bound's rows, seconds). For runs that came back without that check: several sharing one spawn."""
    specs = demo_specs(cfg)
    t1 = time.perf_counter()
    reference = reference_params(specs, cfg, device)
    checks = distributed_muon_cpu.check_against_torch(specs, results, reference, cfg.tp,
                                                      initial_params(specs, cfg.seed))
    return bound(cfg, checks, device), time.perf_counter() - t1


def rank_program(cfg, run_rank=distributed_muon_cpu.run_rank):
    """The lesson's run_rank (section 6; distributed_muon.py's own, its GPU twin) with this run's model,
    optimizer, what it adds after a step and torch's reference: what spawn_ranks starts on every rank, or a
    torchrun process calls."""
    specs = demo_specs(cfg)
    build = functools.partial(build_optimizer, specs, cfg)
    return functools.partial(run_rank, cfg, specs, build, functools.partial(reference_params, specs, cfg),
                             after_step(cfg, specs, build))


def run_demo_steps(cfg, grid, device="cpu"):
    """The lesson's run_steps for this run, on a rank that has joined already: for several runs in one
    spawn (the tests'), each checked afterwards with verify."""
    specs = demo_specs(cfg)
    build = functools.partial(build_optimizer, specs, cfg)
    return distributed_muon_cpu.run_steps(cfg, specs, build, grid, device, after_step(cfg, specs, build))


def verdict(checks, reference="torch"):
    """'PASS: 26/26 parameters bit-identical to torch' (or FAIL), with those within a derived bound
    (--batched-ns, --tp-newton-schulz gram) said apart; reference: what they were compared with."""
    n_same, n_within = sum(c["identical"] for c in checks), sum(c["ok"] and not c["identical"] for c in checks)
    within = f", {n_within} within their derived bound" if n_within else ""
    passed = all(c["ok"] for c in checks)
    return passed, (f"{'PASS' if passed else 'FAIL'}: {n_same}/{len(checks)} parameters bit-identical to "
                    f"{reference}{within}")
