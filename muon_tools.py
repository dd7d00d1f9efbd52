"""The tooling around the lesson: a run and its check against torch, the report, the launcher, the command line.

distributed_muon_cpu.py is the lesson (sections 1-5: the gather flow and its optimizer), muon_owners.py
its section 6 (the owner and comm-free strategies), muon_large_runs.py its section 7 (what large runs
add). What is here is what a command needs around them, and nothing a reader of the algorithm must
read: it continues the lesson's numbering.

    8. A run of the demo (run_steps, the example of use), and its verification against torch.optim.Muon
       and torch.optim.AdamW (reference_params, verify, verdict)
    9. Accounting (bytes per phase, Newton-Schulz FLOPs, redundancy, balance) and the report
    10. Main: the launcher (start, watch and stop the ranks) and the command line
    11. Training checks: how a real training is checked against one process (the bound on its
        gradients, the chaos floor), for examples/train_gpt.py and dtensor_demo.py alike

The launcher (spawn_ranks, exit_code, RankFailure), the table formatting (format_table,
human_bytes), the parser (OneLineParser) and the checks of a command's options (check_launch,
check_writable, flag) serve every command of the repository: distributed_muon.py,
distributed_muon_dtensor.py, dtensor_demo.py, examples/ and benchmarks/ import them from here,
and the training checks (bound_ratio, loss_drift, one_ulp_up) too. `python distributed_muon_cpu.py`
runs main() below.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, fields, replace
from unittest import mock

import torch
import torch.distributed as dist

from distributed_muon_cpu import (ADJUST_LR_FNS, NS_COEFFICIENTS, NS_COEFFICIENT_CHOICES, NS_EPS, NS_STEPS, N_LAYERS,
                                  ParamSpec, adjusted_lr, check_topology, dp_rank_grads, initial_params, make_grid,
                                  newton_schulz, plan_grid, rank_grid, tp_shard, transformer_specs)
from muon_checks import check_hyperparameters
from muon_owners import (BATCHED_NS_BOUND, OPTIMIZERS, OVERLAP_DEFAULT, STRATEGIES, check_owner_options,
                         load_balance)
from muon_large_runs import (NS_BLOCKS, TP_NEWTON_SCHULZ, check_large_run_options, gram_eligible,
                             newton_schulz_flops_of, transformer_row_layouts)


# =============================================================================
# 8. A run, and its verification against torch.optim.Muon / torch.optim.AdamW
# =============================================================================
# A run of the demo: every rank builds the optimizer over its TP pieces of the
# section 3 model and steps it with its own gradients (run_steps: the example of
# use). Then the reference: PyTorch's own single-device torch.optim.Muon and
# torch.optim.AdamW on the full parameters, fed the sum of every DP rank's
# gradient: an independent implementation, not this script's code path. Every
# rank's TP piece of every parameter must equal the matching piece of the
# reference bit for bit (torch.equal). No tolerance is needed by default: the only
# cross-rank reduction that changes a value is the gradient sum, exact by
# construction (section 3; QK-clip's maxima are a MAX, exact in any order);
# everything else is elementwise on shards or one Newton-Schulz on the same full
# bf16 matrix with the same thread count. Two exceptions are choices, each held to
# a bound instead: batched_ns (section 6) and tp_newton_schulz="gram" (section 7.3's
# newton_schulz_tp sums the Gram matrix over ranks).

# The demo run needs the per-head maxima a forward pass would report: a stand-in.


def dp_rank_max_logits(specs, seed, step, dp_rank):
    """{fused QKV name: the largest logit of each of its heads in DP rank dp_rank's forward at `step`}
    (float32). Head h's lies in [0.75, 1.25] x 25 (h + 1): with tau = 100 the first three heads never
    clip, the last three always do, and the two between depend on the step and the batch."""
    g = torch.Generator().manual_seed((seed * 100_003 + step) * 1_009 + dp_rank + 1)
    return {name: 25 * (0.75 + 0.5 * torch.rand(rows.periods, generator=g)) * torch.arange(1, rows.periods + 1)
            for name, rows in transformer_row_layouts(specs).items()}


def computed_here(max_logits, tp_rank, tp):
    """What a rank reports: its TP rank's heads (the demo's QKV is split by rows), -inf for the others."""
    out = {}
    for name, s in max_logits.items():
        heads = s.numel() // tp
        out[name] = torch.full_like(s, -math.inf)
        out[name][tp_rank * heads:(tp_rank + 1) * heads] = s[tp_rank * heads:(tp_rank + 1) * heads]
    return out


# A rank that stops beating for this long (stopped, frozen, swapped out) ends the run, and so
# does a collective that waits this long (--timeout): many times the demo's start and step,
# room for a loaded laptop (their times: notes/measured/default_4x2.txt).
TIMEOUT_S = 20.0


@dataclass(frozen=True)
class RunConfig:
    dp: int = 4
    tp: int = 2
    steps: int = 3
    seed: int = 0
    bucket_size: int = 1 << 16
    lr: float = 0.02
    momentum: float = 0.95
    weight_decay: float = 0.1
    ns_steps: int = NS_STEPS
    adjust_lr_fn: str = "original"
    strategy: str = "gather"  # one of STRATEGIES
    baseline: bool = False  # the AdamW ZeRO-1 baseline instead of Muon: every parameter takes AdamW
    model: str = "transformer"  # one of MODELS: the transformer of section 3, or lopsided_specs()
    layers: int = N_LAYERS  # transformer layers of the demo model (5 Muon matrices each)
    overlap: int = 0  # owner / comm-free: K >= 1 pipelines the step, Newton-Schulz K units behind (section 6)
    batched_ns: bool = False  # owner / comm-free: same-shape matrices in one call (not bitwise torch's)
    ns_coefficients: str = "jordan"  # one of NS_COEFFICIENT_CHOICES (section 1)
    ns_blocks: str = "whole"  # one of NS_BLOCKS: the fused QKV whole, by blocks or by heads (muon_large_runs.py)
    tp_newton_schulz: str = "gather"  # gather: "gram" orthogonalizes eligible TP pieces where they lie (muon_large_runs.py)
    qk_clip_tau: float = None  # a number > 0: QK-clip after every step, with dp_rank_max_logits (muon_large_runs.py)
    timeout_s: float = TIMEOUT_S  # a silent rank or a stuck collective ends the run after this long
    missing_grads: tuple = ()  # (name, dp_rank or -1 for all, step): gradients that are None (tests)
    fail_rank: int = -1  # for testing failure handling: this rank raises at step 1


def lopsided_specs():
    """One huge matrix among many small ones (--model lopsided): work that cannot be
    spread evenly over ranks that each take whole matrices."""
    specs = [ParamSpec("huge.weight", (1024, 128), 0, "muon"), ParamSpec("huge.bias", (1024,), 0, "adamw_no_wd")]
    for i in range(12):  # alternately tall (split rows) and wide (split columns)
        specs.append(ParamSpec(f"small.{i}.weight", (32, 64) if i % 2 else (64, 32), i % 2, "muon"))
    specs += [ParamSpec("small.router.weight", (8, 32), -1, "muon"),
              ParamSpec("out.weight", (64, 32), 0, "adamw")]
    return specs


def thin_specs():
    """Matrices with a small side (--model thin): k x 1, 1 x k, k x 2, 600 x 6, odd sizes.

    On such shapes bf16 rounding near-ties are common enough that a Newton-Schulz
    done in any other order than torch's shows up in a few steps. Eight copies of
    each shape, so that one rank can be given several of the same shape, and one
    6 x 6000 matrix that outweighs any rank's share of the rest, so that a rank can
    be given it alone.
    """
    shapes = [((600, 6), 0), ((6, 600), 1), ((60, 6), 0), ((6, 60), 1), ((97, 5), -1), ((5, 97), -1),
              ((64, 1), 0), ((1, 64), 1), ((64, 2), 0), ((2, 64), 1)]
    specs = [ParamSpec(f"thin.{copy}.{rows}x{cols}.weight", (rows, cols), split, "muon")
             for copy in range(8) for (rows, cols), split in shapes]
    return specs + [ParamSpec("thin.wide.weight", (6, 6000), 1, "muon"),
                    ParamSpec("thin.bias", (60,), 0, "adamw_no_wd"), ParamSpec("thin.scale", (), -1, "adamw_no_wd")]


MODELS = ("transformer", "lopsided", "thin")


def demo_specs(cfg):
    if cfg.model == "transformer":
        return transformer_specs(n_layers=cfg.layers)
    return lopsided_specs() if cfg.model == "lopsided" else thin_specs()


def check_tp_divides(specs, tp):
    """Raise ValueError naming the first parameter TP cannot split evenly."""
    for s in specs:
        if s.tp_split_dim >= 0 and s.global_shape[s.tp_split_dim] % tp:
            raise ValueError(f"TP {tp} does not divide {s.name} dim {s.tp_split_dim} "
                             f"(size {s.global_shape[s.tp_split_dim]}, global shape {tuple(s.global_shape)})")


def tp_local_shape(spec, tp):
    shape = list(spec.global_shape)
    if spec.tp_split_dim >= 0:
        shape[spec.tp_split_dim] //= tp
    return tuple(shape)


MUON_GROUP = "muon"
BASELINE = "baseline"  # --baseline: AdamW ZeRO-1 for every parameter, the yardstick Muon is priced against


def run_kind(cfg):
    """What a run is: one of STRATEGIES, or BASELINE."""
    return BASELINE if cfg.baseline else cfg.strategy


def group_hyperparameters(cfg):
    """The three param groups of the demo model and their hyperparameters.

    With the AdamW ZeRO-1 baseline (--baseline) the matrices take AdamW too:
    the same parameters and layout, and no Newton-Schulz at all.
    """
    muon = dict(algorithm="muon", lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                nesterov=True, ns_steps=cfg.ns_steps, adjust_lr_fn=cfg.adjust_lr_fn,
                ns_coefficients=cfg.ns_coefficients)
    # One lr and weight decay for Muon and AdamW (Moonlight's practice with
    # match_rms_adamw); torch's default betas and eps; no decay on norms and biases.
    adamw = dict(algorithm="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8)
    return {"muon": adamw if cfg.baseline else muon, "adamw": adamw,
            "adamw_no_wd": dict(adamw, weight_decay=0.0)}


def demo_row_layouts(specs, cfg):
    """The fused QKV's layout when a run asks for blocks or QK-clip (none otherwise: torch's run)."""
    return transformer_row_layouts(specs) if cfg.ns_blocks != "whole" or cfg.qk_clip_tau is not None else {}


def build_optimizer(specs, cfg, grid, params):
    """The demo's optimizer for cfg.strategy over this rank's TP pieces `params` ({name: tensor})."""
    groups = [dict(h, params=[(s.name, params[s.name]) for s in specs if s.group == g])
              for g, h in group_hyperparameters(cfg).items()]
    options = {} if cfg.strategy == "gather" else dict(overlap=cfg.overlap, batched_ns=cfg.batched_ns)
    return OPTIMIZERS[cfg.strategy]([g for g in groups if g["params"]], grid=grid, bucket_size=cfg.bucket_size,
                                    tp_split_dims={s.name: s.tp_split_dim for s in specs if s.tp_split_dim >= 0},
                                    row_layouts=demo_row_layouts(specs, cfg), ns_blocks=cfg.ns_blocks,
                                    tp_newton_schulz=cfg.tp_newton_schulz, qk_clip_tau=cfg.qk_clip_tau, **options)



def tp_pieces(specs, cfg, tp_rank):
    """{name: TP rank tp_rank's piece of the starting parameter}: what that rank holds before step 1."""
    return {s.name: tp_shard(t, s.tp_split_dim, tp_rank, cfg.tp).contiguous()
            for s, t in zip(specs, initial_params(specs, cfg.seed).values())}


def plan_optimizer(cfg, rank=0):
    """The optimizer rank `rank` will build, built here on a grid without process groups.

    Its layout (buckets, dist_meta) and owners depend on shapes alone, so the
    launcher prints them from the very code every rank runs, before any rank starts.
    """
    specs = demo_specs(cfg)
    grid = plan_grid(cfg.dp, cfg.tp, rank)
    return build_optimizer(specs, cfg, grid, tp_pieces(specs, cfg, grid.tp.rank))


def run_steps(rank, cfg, device):
    """The body of every rank, whatever launched it: returns its final params, ledger and step times."""
    specs = demo_specs(cfg)
    grid = make_grid(cfg.dp, cfg.tp, rank)
    params = {name: piece.to(device) for name, piece in tp_pieces(specs, cfg, grid.tp.rank).items()}
    opt = build_optimizer(specs, cfg, grid, params)
    resume_at = (cfg.steps + 1) // 2  # checkpoint round trip halfway through (see below)
    step_ms, qk_clip = [], []
    for step in range(1, cfg.steps + 1):
        if rank == cfg.fail_rank:
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (--fail-rank)")
        grads = dp_rank_grads(specs, cfg.seed, step, grid.dp.rank, cfg.missing_grads)
        for s in specs:
            grad = grads[s.name]
            if grad is not None:
                grad = tp_shard(grad, s.tp_split_dim, grid.tp.rank, cfg.tp).contiguous().to(device)
            params[s.name].grad = grad
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if cfg.qk_clip_tau is not None:  # what this rank's forward would have reported, then the clip (muon_large_runs.py)
            max_logits = computed_here(dp_rank_max_logits(specs, cfg.seed, step, grid.dp.rank), grid.tp.rank, cfg.tp)
            qk_clip.append(opt.clip_qk_(max_logits))
        if step == resume_at:
            # Resume from a checkpoint mid-run: a fresh optimizer loads this rank's
            # state_dict. If the state were lost, the momentum would restart and
            # the final comparison with torch would fail.
            fresh = build_optimizer(specs, cfg, grid, params)
            fresh.load_state_dict(opt.state_dict())
            fresh.ledger = opt.ledger
            opt = fresh
    return dict(rank=rank, params={n: p.detach().cpu() for n, p in params.items()},
                ledger=asdict(opt.ledger), step_ms=step_ms, state_bytes=opt.state_bytes(), owners=opt.owners,
                qk_clip=qk_clip)


def torch_optimizers(groups):
    """The single-device reference for param groups as DistributedMuon takes them, with plain
    tensors for params: torch.optim.Muon for each Muon group, torch.optim.AdamW for each AdamW one."""
    optimizers = []
    for h in groups:
        if not h["params"]:
            continue
        if h["algorithm"] == "muon":
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


# The reference of section 7's options, written from the papers' equations and torch's own code,
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
    stepped = [p for opt in optimizers if isinstance(opt, torch.optim.Muon)
               for g in opt.param_groups for p in g["params"] if p.grad is not None]
    for p, x in zip(stepped, inputs, strict=True):
        if id(p) in name_of:
            record.setdefault(name_of[id(p)], []).append(x)


def clip_rows_(weight, rows, max_logit, tau):
    """Kimi K2's per-head QK-clip on the reference: the head's q and k rows times sqrt(min(1, tau / S))."""
    if max_logit > tau:
        weight[rows].mul_(math.sqrt(min(1.0, tau / max_logit)))


@functools.lru_cache(maxsize=16)
def _reference_params(specs, cfg, device):
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
    for step in range(1, cfg.steps + 1):
        grads = total_grads(specs, cfg.seed, step, cfg.dp, cfg.missing_grads)
        for s in specs:  # None where no rank has a gradient: torch skips the parameter
            grad = None if grads[s.name] is None else grads[s.name].to(device)
            for t, index in zip(separate.get(s.name, [params[s.name]]), blocks.get(s.name, [None])):
                t.grad = grad if grad is None or index is None else grad[index]
        with torch_newton_schulz_per_iteration(NS_COEFFICIENT_CHOICES[cfg.ns_coefficients]), \
                ns_inputs_recorded(optimizers, whole, ns_inputs):
            for opt in optimizers:
                opt.step()
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


def reference_params(specs, cfg, device="cpu", ns_inputs=None):
    """Run torch.optim.Muon / torch.optim.AdamW on one device; return the final params (on the CPU).

    The result depends on what the ranks were fed (the model, the seed, the steps, DP's number of
    gradient contributions, the hyperparameters), not on how they split the work (TP, strategy,
    buckets, overlap). So it is kept for the runs of one process that share those inputs, e.g.
    benchmarks/compare.py's four strategies and the tests: torch computes it once for them.
    ns_inputs: a dict to fill with {matrix stepped whole: [its Newton-Schulz input at each step]}.
    """
    how = dict(tp=1, strategy="gather", bucket_size=RunConfig.bucket_size, overlap=0, batched_ns=False,
               tp_newton_schulz="gather", timeout_s=RunConfig.timeout_s, fail_rank=-1)
    params, inputs = _reference_params(tuple(specs), replace(cfg, **how), device)
    if ns_inputs is not None:
        ns_inputs.update(inputs)
    return {n: t.clone() for n, t in params.items()}


def compare_to_reference(specs, reference, rank_params, dp, tp, muon_groups=(MUON_GROUP,)):
    """One row per parameter: max |delta| over every rank's piece and torch.equal on all of them."""
    rows = []
    for s in specs:
        max_diff, identical = 0.0, True
        for rank, params in rank_params.items():
            expected = tp_shard(reference[s.name], s.tp_split_dim, rank % tp, tp)
            got = params[s.name]
            same = got.shape == expected.shape and torch.equal(got, expected)
            identical &= same
            if got.shape == expected.shape:
                max_diff = max(max_diff, (got.double() - expected.double()).abs().max().item())
            else:
                max_diff = float("inf")
        rows.append(dict(name=s.name, global_shape=list(s.global_shape), tp_split_dim=s.tp_split_dim,
                         optimizer="Muon" if s.group in muon_groups else "AdamW",
                         max_abs_diff=max_diff, identical=bool(identical)))
    return rows


def muon_groups_of(cfg):
    """The param groups that run Muon: none in the AdamW ZeRO-1 baseline."""
    return () if cfg.baseline else (MUON_GROUP,)


def batched_ns_tolerance(steps, lr, adjust_lr_fn, shape, bound=BATCHED_NS_BOUND):
    """How far --batched-ns may leave a Muon matrix of `shape` (rows, cols) from torch's after `steps` steps.

    Each step adds -adjusted_lr * O, and a batched O differs from torch's by at most
    `bound` times its largest entry (section 6). That entry is at most the
    largest singular value Newton-Schulz leaves: about 1.2, the quintic's maximum on
    [0, 1]; 1.5 leaves room for bf16 rounding. Weight decay scales both runs alike
    and only shrinks earlier differences, as QK-clip's multipliers (<= 1) do; the
    momentum does not depend on the weights.
    """
    return steps * adjusted_lr(lr, adjust_lr_fn, shape) * 1.5 * bound


# newton_schulz_tp (section 7.3) against torch's Newton-Schulz of the whole matrix: both are bf16
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


def gram_ns_tolerance(update, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, eps=NS_EPS):
    """The largest |newton_schulz_tp - newton_schulz| allowed on this input, entrywise: (1 + GRAM_ERROR_RATIO)
    x torch's own error, max |newton_schulz(update) - the same iteration in float64 on the bf16 input both see|."""
    exact = newton_schulz(update.bfloat16(), steps, coefficients, eps, dtype=torch.float64)
    torch_error = (newton_schulz(update, steps, coefficients, eps).double() - exact).abs().max().item()
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


def verify(cfg, results, device="cpu"):
    """Every rank's parameters against torch on `device`: (checks, reference seconds).

    A check is "ok" when bit-identical; with --batched-ns, a Muon matrix is also ok
    within batched_ns_tolerance (it cannot be bit-identical, section 6), and with
    --tp-newton-schulz gram, a matrix newton_schulz_tp orthogonalized within gram_tolerance
    of its Newton-Schulz inputs in the reference.
    """
    specs = demo_specs(cfg)
    t1 = time.perf_counter()
    ns_inputs = {}
    reference = reference_params(specs, cfg, device, ns_inputs)
    checks = compare_to_reference(specs, reference, {r["rank"]: r["params"] for r in results}, cfg.dp, cfg.tp,
                                  muon_groups_of(cfg))
    start, gram = initial_params(specs, cfg.seed), gram_names(specs, cfg)
    for c, spec in zip(checks, specs):
        # how far the weights moved: the scale against which max |d| = 0 means something
        c["max_abs_update"] = (reference[c["name"]] - start[c["name"]]).abs().max().item()
        c["tolerance"] = (batched_ns_tolerance(cfg.steps, cfg.lr, cfg.adjust_lr_fn, spec.global_shape)
                          if cfg.batched_ns and c["optimizer"] == "Muon" else
                          gram_tolerance(ns_inputs[spec.name], cfg.lr, cfg.adjust_lr_fn, spec.global_shape,
                                         cfg.ns_steps, cfg.ns_coefficients) if spec.name in gram else 0.0)
        c["ok"] = c["identical"] or c["max_abs_diff"] <= c["tolerance"]
    return checks, time.perf_counter() - t1


def verdict(checks):
    """'PASS: 26/26 parameters bit-identical to torch' (or FAIL), with those within a derived bound
    (--batched-ns, --tp-newton-schulz gram) said apart."""
    n_same, n_within = sum(c["identical"] for c in checks), sum(c["ok"] and not c["identical"] for c in checks)
    within = f", {n_within} within their derived bound" if n_within else ""
    passed = all(c["ok"] for c in checks)
    return passed, f"{'PASS' if passed else 'FAIL'}: {n_same}/{len(checks)} parameters bit-identical to torch{within}"


# =============================================================================
# 9. Accounting
# =============================================================================
# Bytes per phase come from each rank's Ledger (section 2); FLOPs from the
# Newton-Schulz calls each rank made. The redundancy factor is
#
#     sum over ranks of Newton-Schulz FLOPs  /  FLOPs of one device doing each matrix once.
#
# In the gather flow every TP peer orthogonalizes the same full matrix, and so does
# every DP rank whose shard touches it: the redundancy is TP x (how many DP
# shards a matrix touches, FLOP-weighted), at most DP x TP, which it reaches
# when every rank touches every matrix. The owner and comm-free strategies
# (section 6) give each matrix one owner instead: redundancy 1, and max/mean
# FLOPs per rank then says how well the owners are balanced.

# The phases of each strategy's data path, and of the baseline's, in the order they happen.
PHASES_OF = {
    "gather": ("grad presence", "grad reduce-scatter", "DP gather", "TP gather", "param all-gather"),
    "owner": ("grad presence", "grad reduce-scatter", "gather at owner", "scatter from owner", "param all-gather"),
    "comm-free": ("grad presence", "grad reduce-scatter", "grad reduce at owner", "gather at owner",
                  "scatter from owner", "param all-gather", "update broadcast from owner"),
    BASELINE: ("grad presence", "grad reduce-scatter", "param all-gather"),
}
PHASES = PHASES_OF["gather"]


def bytes_per_step(ledgers, step, phases=PHASES):
    """{phase: {"axis", "dtype", "sent": [per rank], "received": [per rank]}} for one step."""
    table = {}
    for phase in phases:
        sent, received, axes, dtypes = [], [], set(), set()
        for ledger in ledgers:
            records = [r for r in ledger["comm"] if r["step"] == step and r["phase"] == phase]
            sent.append(sum(r["sent"] for r in records))
            received.append(sum(r["received"] for r in records))
            axes |= {r["axis"] for r in records}
            dtypes |= {r["dtype"] for r in records}
        table[phase] = dict(axis="/".join(sorted(axes)) or "-", dtype="/".join(sorted(dtypes)) or "-",
                            sent=sent, received=received)
    return table


def flops_per_step(ledgers, specs, step, ns_steps, muon_groups=(MUON_GROUP,), blocks=None):
    """Newton-Schulz FLOPs per rank; redundancy and max/mean are None where there is no Muon.
    blocks: {name: its blocks of rows} of the matrices orthogonalized by blocks (--ns-blocks)."""
    per_rank = [sum(r["flops"] for r in ledger["compute"] if r["step"] == step) for ledger in ledgers]
    single = sum(newton_schulz_flops_of(s.global_shape, ns_steps, (blocks or {}).get(s.name))
                 for s in specs if s.group in muon_groups)
    mean = sum(per_rank) / len(per_rank)
    return dict(per_rank=per_rank, single_device=single, redundancy=sum(per_rank) / single if single else None,
                max_over_mean=max(per_rank) / mean if mean else None)


def account(cfg, results):
    """Bytes per phase (last step), whether every step moved the same, and Newton-Schulz FLOPs."""
    ledgers = [r["ledger"] for r in results]
    phases = PHASES_OF[run_kind(cfg)]
    # and those of the options of section 7 a run took ("TP Gram", "QK-clip maxima", ...), as they came
    phases += tuple(dict.fromkeys(r["phase"] for ledger in ledgers for r in ledger["comm"] if r["phase"] not in phases))
    tables = [bytes_per_step(ledgers, s, phases) for s in range(1, cfg.steps + 1)]
    specs = demo_specs(cfg)
    blocks = ({} if cfg.ns_blocks == "whole" else
              {n: rows.blocks(cfg.ns_blocks == "heads") for n, rows in demo_row_layouts(specs, cfg).items()})
    flops = flops_per_step(ledgers, specs, cfg.steps, cfg.ns_steps, muon_groups_of(cfg), blocks)
    return tables[-1], all(t == tables[0] for t in tables), flops


def total_bytes(table, direction="sent"):
    """(max over ranks of bytes sent (or received) per step, the same by all ranks per step)."""
    per_rank = [sum(col) for col in zip(*(t[direction] for t in table.values()))]
    return max(per_rank), sum(per_rank)


def format_table(header, rows, aligns):
    if not len(header) == len(aligns) == (len(rows[0]) if rows else len(header)):
        raise ValueError(f"a table of {len(header)} columns needs as many aligns ({len(aligns)}) and cells")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(f"{str(x):{a}{w}}" for x, a, w in zip(row, aligns, widths))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def format_grid(dp, tp):
    """The rank layout as a small table."""
    grid = rank_grid(dp, tp)
    width = max(4, len(str(dp * tp - 1)) + 1)
    lines = ["      " + "".join(f"{'TP ' + str(t):>{width + 2}}" for t in range(tp))]
    for d in range(dp):
        lines.append(f"DP {d:<3}" + "".join(f"{r:>{width + 2}}" for r in grid[d].tolist()))
    return "\n".join(lines)


def format_buffer_map(layout):
    """--explain: which DP rank keeps which part of which parameter, and the padding."""
    dp, lines = layout.dp, []
    for b in layout.buckets:
        lines.append(f"bucket ({b.buffer_idx}, {b.bucket_idx}): {b.used:,} elements + {b.numel - b.used} padding "
                     f"= {b.numel:,}; DP shard = {b.numel // dp:,} elements")
        for name in b.names:
            start, end = layout.bucket_ranges[name]
            parts = " ".join(f"DP{r}[{m.param_slice.start}:{m.param_slice.stop}]"
                             for r, m in enumerate(ms[name] for ms in layout.metas) if m.local_numel)
            lines.append(f"    {name:<26} {str(layout.shapes[name]):<11} [{start:>6}, {end:>6})  {parts}")
        if b.numel > b.used:
            holders = " ".join(f"DP{r}" for r in range(dp) if b.shard_range(r, dp)[1] > b.used)
            lines.append(f"    {'(padding)':<26} {'':<11} [{b.used:>6}, {b.numel:>6})  {holders}")
    return "\n".join(lines)


def print_header(cfg, plan, device_kind, backend, explain, print_fn):
    """The grid, the virtual buffer and the owners, from `plan` (plan_optimizer): what every rank will hold."""
    world = cfg.dp * cfg.tp
    print_fn(f"Distributed Muon: {world} {device_kind} rank{'s' * (world != 1)} over {backend}, "
             f"DP={cfg.dp} x TP={cfg.tp}, {'the AdamW ZeRO-1 baseline' if cfg.baseline else 'strategy ' + cfg.strategy}, "
             f"{cfg.steps} steps, seed {cfg.seed}, "
             f"torch {torch.__version__}\n")
    print_fn("[2] The grid (rank = dp_rank * TP + tp_rank; a row is a TP group, a column a DP group)")
    print_fn(format_grid(cfg.dp, cfg.tp) + "\n")
    buckets = plan.layout.buckets
    used, padded = sum(b.used for b in buckets), sum(b.numel for b in buckets)
    n_buffers = len({b.buffer_idx for b in buckets})
    whole = " (Muon matrices are sharded whole, outside the buckets)" if plan.strategy == "comm-free" else ""
    print_fn(f"[4] Virtual buffer: {n_buffers} param groups, {len(buckets)} buckets of <= {cfg.bucket_size:,} "
             f"elements, {used:,} TP-local elements + {padded - used} padding per rank{whole}")
    if explain:
        print_fn(format_buffer_map(plan.layout))
    if plan.owners:
        per_rank, balance = load_balance(plan.ns_flops, plan.owners, world)
        print_fn(f"[6] Owners: {len(plan.owners)} matrices on {world} ranks by longest-processing-time over "
                 f"Newton-Schulz FLOPs; max/mean = {balance:.2f}")
        if explain:
            rows = [[r, sum(o == r for o in plan.owners.values()), f"{per_rank[r] / 1e9:.3f}",
                     " ".join(n for n, o in plan.owners.items() if o == r)] for r in range(world)]
            print_fn(format_table(["rank", "matrices", "GFLOP", "owns"], rows, [">", ">", ">", "<"]))
    print_fn("")


def qk_clipped_heads(results):
    """Per step, {(matrix, head, multiplier)} of the heads QK-clip scaled, from every rank's clip_qk_ answers."""
    steps = len(results[0].get("qk_clip") or ())
    return [{(n, h, m) for r in results for n, ms in r["qk_clip"][i].items() for h, m in enumerate(ms)
             if m is not None and m < 1} for i in range(steps)]


def report(cfg, plan, results, checks, ranks_s, ref_s, backend="gloo", print_fn=print):
    """Print the verification (checks from verify) and the accounting; return them all as one dict."""
    world = cfg.dp * cfg.tp
    n_same = sum(c["identical"] for c in checks)
    passed, summary = verdict(checks)
    reference_name = "torch.optim.AdamW" if cfg.baseline else "torch.optim.Muon / torch.optim.AdamW"
    print_fn(f"[8] Every rank's piece against {reference_name} on one device "
             f"(torch.equal): {n_same}/{len(checks)} parameters identical")
    rows = [[c["name"], "x".join(map(str, c["global_shape"])) or "scalar",
             "-" if c["tp_split_dim"] < 0 else c["tp_split_dim"], c["optimizer"],
             f"{c['max_abs_diff']:.1e}" if c["max_abs_diff"] else "0",
             "yes" if c["identical"] else f"no, <= {c['tolerance']:.1e}" if c["ok"] else "NO"]
            for c in checks]
    print_fn(format_table(["parameter", "global shape", "split", "optimizer", "max |d|", "identical"], rows,
                          ["<", ">", ">", "<", ">", ">"]) + "\n")

    clipped = qk_clipped_heads(results)
    if cfg.qk_clip_tau is not None:
        heads = sum(len(m) for m in results[0]["qk_clip"][0].values())
        print_fn(f"[7] QK-clip, tau {cfg.qk_clip_tau:g}: heads clipped per step "
                 f"{', '.join(f'{len(c)}/{heads}' for c in clipped)} (one MAX all-reduce of the per-head maxima)\n")

    table, same_every_step, flops = account(cfg, results)
    gloo_note = "; on Gloo the reduce-scatter is an all-to-all and a local sum" if backend == "gloo" else ""
    print_fn(f"[9] Bytes per step: ring counts for all-gather and reduce-scatter, exact counts for all-to-all "
             f"({'the same every step' if same_every_step else 'last step; steps differ'}{gloo_note})")
    rows = [[phase, t["axis"], t["dtype"], human_bytes(max(t["sent"])), human_bytes(max(t["received"])),
             human_bytes(sum(t["sent"]))] for phase, t in table.items()]
    max_sent, all_sent = total_bytes(table)
    max_received, _ = total_bytes(table, "received")
    rows.append(["total", "", "", human_bytes(max_sent), human_bytes(max_received), human_bytes(all_sent)])
    print_fn(format_table(["phase", "axis", "dtype", "sent/rank (max)", "received/rank (max)", "sent, all ranks"],
                          rows, ["<", "<", "<", ">", ">", ">"]) + "\n")

    if flops["single_device"]:
        print_fn(f"[9] Newton-Schulz FLOPs per step: single device {flops['single_device'] / 1e9:.3f} GFLOP; "
                 f"per rank {', '.join(f'{f / 1e9:.3f}' for f in flops['per_rank'])} GFLOP")
        why = ("every TP peer, and every DP rank whose shard touches a matrix, orthogonalizes it"
               if cfg.strategy == "gather" else "each matrix is orthogonalized once, by its owner")
        print_fn(f"    redundancy = sum over ranks / single device = {flops['redundancy']:.2f} "
                 f"(upper bound DP x TP = {world}; {why}); max/mean per rank = {flops['max_over_mean']:.2f}\n")
    state = [r["state_bytes"] for r in results]
    print_fn(f"[9] Optimizer state per rank: max {human_bytes(max(state))}, min {human_bytes(min(state))}")

    step_ms = [max(r["step_ms"][i] for r in results) for i in range(cfg.steps)]
    timings = dict(ranks_s=ranks_s, reference_s=ref_s, step_ms_slowest_rank=step_ms,
                   step_ms_median=statistics.median(step_ms))
    print_fn(f"Timing: ranks {ranks_s:.1f} s (start, init, {cfg.steps} steps), reference {ref_s:.1f} s, "
             f"median step {timings['step_ms_median']:.0f} ms (slowest rank)")
    print_fn(f"Result: {summary}")
    return dict(config=asdict(cfg), torch=torch.__version__, passed=passed, checks=checks,
                buckets=[asdict(b) for b in plan.layout.buckets], owners=results[0]["owners"], bytes_per_step=table,
                bytes_same_every_step=same_every_step, bytes_sent_max_rank=max_sent, bytes_sent_all_ranks=all_sent,
                ns_flops=flops, state_bytes=state, timings=timings, ledgers=[r["ledger"] for r in results],
                qk_clip=[{f"{n} head {h}": m for n, h, m in sorted(c)} for c in clipped])



# =============================================================================
# 10. Main: the launcher and the command line
# =============================================================================
# The launcher checks the arguments and plans the layout (before starting any
# rank), starts one process per rank, watches them, then runs the single-device
# reference and prints the report. Each rank writes its final parameters, ledger
# and timings to a temporary folder that the launcher reads. Like torchrun, it
# stops every rank on Ctrl-C or SIGTERM, and names the rank that failed, died or
# stopped responding.

def one_line(error):
    """An exception as one line, 'Type: message', whatever newlines its message holds."""
    return " ".join(f"{type(error).__name__}: {error}".split())


def write_atomically(path, write):
    """Write through a temporary name, so the launcher never reads half a file."""
    with open(path + ".partial", "wb") as f:
        write(f)
    os.replace(path + ".partial", path)


HEARTBEAT_S = 0.5  # how often a rank says it is alive


def start_heartbeat(heartbeats, rank, launcher):
    """A thread that writes the time into heartbeats[rank] every HEARTBEAT_S.

    It beats while the rank computes or waits in a collective, and stops only
    when the whole process does (SIGSTOP, a debugger, swapped out): that is how
    the launcher tells the rank that stopped from the peers waiting for it.
    `launcher` is the read end of a pipe whose write end only the launcher holds:
    it becomes readable (end of file) when the launcher is gone, even killed by
    SIGKILL, and then the rank ends itself rather than run on as an orphan.
    """
    def beat():
        while not launcher.poll(HEARTBEAT_S):  # nothing is ever sent: it times out, or the launcher died
            heartbeats[rank] = time.monotonic()
        os._exit(1)

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()


def name_process(title):
    """Show `title` in ps and top (Linux's prctl PR_SET_NAME); elsewhere do nothing."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME, at most 15 bytes
    except (OSError, AttributeError):
        pass


def run_rank(rank, body, cfg, port, out_dir, heartbeats, launcher):
    """One spawned rank: join the Gloo world, run body(rank, cfg, "cpu"), write what it returns to out_dir.

    Nothing is printed here: a failure is written to rank<R>.error (time, one
    line, traceback) and the launcher reports it once, for the whole run.
    """
    # Ctrl-C in a terminal sends SIGINT to every process of the job; the launcher
    # alone decides what happens next (it stops every rank and cleans up).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process(f"muon rank {rank}")
    start_heartbeat(heartbeats, rank, launcher)
    torch.set_num_threads(1)  # same thread count everywhere (section 8)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=cfg.dp * cfg.tp, timeout=datetime.timedelta(seconds=cfg.timeout_s))
        result = body(rank, cfg, "cpu")
        dist.destroy_process_group()
        write_atomically(os.path.join(out_dir, f"rank{rank}.pt"), lambda f: torch.save(result, f))
    except BaseException as e:
        # When one rank dies its peers fail too ("connection closed"). The time
        # lets the launcher name the rank that failed first: the cause.
        text = f"{time.time()!r}\n{one_line(e)}\n{traceback.format_exc()}"
        write_atomically(os.path.join(out_dir, f"rank{rank}.error"), lambda f: f.write(text.encode()))
        os._exit(1)  # no teardown that could wait on a dead peer


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method():
    """How ranks are started: forked from a server that has already imported torch.

    Each freshly spawned process spends seconds importing torch (and torch._dynamo,
    which torch.optim.Optimizer imports on first use), and 8 ranks on 2 cores do it
    at once. A forkserver imports them once and forks each rank from it, which
    reaches the first step several times sooner. "spawn" remains where there is no forkserver.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch.optim", "torch._dynamo"])
    return "forkserver"


class RankFailure(RuntimeError):
    """A rank failed, died or stopped responding; str() is one line, .traceback the rank's own."""

    def __init__(self, message, traceback_text=""):
        super().__init__(message)
        self.traceback = traceback_text


class Interrupted(BaseException):
    """SIGTERM, turned into an exception so that the launcher can clean up as for Ctrl-C."""


def raise_interrupted(signum, frame):
    raise Interrupted()


def rank_errors(out_dir):
    """[(time, rank, one-line error, traceback)] of every rank that wrote an error, earliest first."""
    errors = []
    for name in os.listdir(out_dir):
        if name.startswith("rank") and name.endswith(".error"):
            with open(os.path.join(out_dir, name)) as f:
                when, error, trace = f.read().split("\n", 2)
            errors.append((float(when), int(name[len("rank"):-len(".error")]), error, trace))
    return sorted(errors)


def blame(exits, out_dir):
    """The RankFailure that names the cause, once some rank has exited abnormally.

    exits: [(rank, exit code)] in the order the launcher saw them end. A rank
    killed by a signal is the cause (its peers then fail with "connection
    closed"); otherwise the rank whose error was written first is.
    """
    for rank, code in exits:
        if code < 0:
            return RankFailure(f"rank {rank} was killed by {signal.Signals(-code).name}")
    errors = rank_errors(out_dir)
    if errors:
        _, rank, error, trace = errors[0]
        others = sorted(r for _, r, _, _ in errors[1:])
        also = f" (then rank{'s' * (len(others) > 1)} {', '.join(map(str, others))} failed too)" if others else ""
        return RankFailure(f"rank {rank} failed: {error}{also}", trace)
    rank, code = exits[0]
    return RankFailure(f"rank {rank} exited with code {code}")


POLL_S = 0.2  # how often the launcher looks at the ranks
ERRORS_LAND_S = 1.0  # after a first failure, how long its peers get to fail and say why


def watch(procs, heartbeats, out_dir, timeout_s):
    """Wait for every rank; return None when all succeeded, else the RankFailure.

    Every POLL_S it looks at which processes ended and at every heartbeat. A rank
    that exited with an error ends the run (its peers fail right after it; the
    launcher waits ERRORS_LAND_S for their errors, to name the first); so does a
    rank whose heartbeat is older than timeout_s.
    """
    exits = []
    while True:
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=POLL_S)
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if p.exitcode is None and now - heartbeats[rank] > timeout_s:
                return RankFailure(f"rank {rank} stopped responding: no heartbeat for {timeout_s:g} s "
                                   f"(--timeout {timeout_s:g}); it was stopped or frozen")
        exits += [(rank, p.exitcode) for rank, p in enumerate(procs)
                  if p.exitcode not in (None, 0) and rank not in dict(exits)]
        if exits:
            deadline = now + ERRORS_LAND_S
            while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
                multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None],
                                                timeout=deadline - time.monotonic())
            return blame(exits, out_dir)
        if all(p.exitcode == 0 for p in procs):
            return None


def stop(procs):
    """SIGKILL every rank still running (a stopped one too) and reap it; a rank whose start
    failed (no pid) has nothing to stop, and the start's own error goes on."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.exitcode is None:
            p.kill()
    for p in started:
        p.join()


def spawn_ranks(cfg, body=run_steps):
    """Run body(rank, cfg, "cpu") on cfg.dp x cfg.tp ranks; return what each returned, in rank order,
    or raise RankFailure naming the rank at fault.

    body is what a rank does once the Gloo world is joined: section 8's run_steps by
    default (examples/ pass their own; it must be importable by name, as any
    multiprocessing target). cfg needs dp, tp and timeout_s. Whatever ends the run
    (success, a failure, Ctrl-C or SIGTERM in the launcher), every rank is stopped
    and the temporary folder removed before this returns.
    """
    context = multiprocessing.get_context(start_method())
    world = cfg.dp * cfg.tp
    heartbeats = context.Array("d", world, lock=False)  # shared memory: one time per rank
    with tempfile.TemporaryDirectory(prefix="distributed-muon-") as out_dir:
        launcher, alive = context.Pipe(duplex=False)  # the ranks watch `launcher`; `alive` stays here
        args = (body, cfg, free_port(), out_dir, heartbeats, launcher)
        procs = [context.Process(target=run_rank, args=(rank,) + args, name=f"rank {rank}") for rank in range(world)]
        try:
            for p in procs:
                p.start()
            for rank in range(world):  # the clock starts once every rank is started
                heartbeats[rank] = time.monotonic()
            failure = watch(procs, heartbeats, out_dir, cfg.timeout_s)
        finally:
            stop(procs)
        if failure:
            raise failure
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


# The command line: its checks, made before any rank starts, then its parser and main().
def check_launch(timeout_s, fail_rank=-1, world=1):
    """The launcher's own options, shared by every command that launches ranks (ValueError, one line)."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"--timeout must be > 0 seconds and finite (got {timeout_s})")
    if not -1 <= fail_rank < world:
        raise ValueError(f"--fail-rank must name a rank in [0, {world}) (got {fail_rank})")


def check_writable(path, option="--json"):
    """Raise ValueError (one line) unless `path` could be written, before any rank starts.
    It creates nothing, so every rank of a torchrun job may check the same path."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{option} {path} is a directory")
    if not os.path.isdir(folder):
        raise ValueError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise ValueError(f"{option} {path} is not writable")


def host_memory():
    """This machine's physical memory in bytes (what `free` calls total): the budget the commands check
    the sizes of a run against before starting it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def flag(argument):
    """The command-line flag of a keyword argument: bucket_size -> --bucket-size."""
    return "--" + argument.replace("_", "-")


MAX_LAYERS = 24  # 24 layers: 5.6 M parameters, every rank holds them all; more is a typo on a laptop



def check_large_run_flags(*, ns_coefficients, ns_blocks, tp_newton_schulz, qk_clip_tau, strategy):
    """--ns-coefficients, --ns-blocks, --tp-newton-schulz and --qk-clip, by the optimizers' own checks spelled
    as flags, and the one combination only a strategy refuses (at construction, after the ranks started):
    the Gram form with an owner strategy. examples/train_gpt.py's command line checks them here too."""
    check_large_run_options(lambda k: "--qk-clip" if k == "qk_clip_tau" else flag(k), ns_blocks=ns_blocks,
                            tp_newton_schulz=tp_newton_schulz, qk_clip_tau=qk_clip_tau)
    if ns_coefficients not in NS_COEFFICIENT_CHOICES:
        raise ValueError(f"--ns-coefficients must be one of {', '.join(NS_COEFFICIENT_CHOICES)} "
                         f"(got {ns_coefficients!r})")
    if tp_newton_schulz != "gather" and strategy != "gather":
        raise ValueError(f"--tp-newton-schulz {tp_newton_schulz} applies to --strategy gather: strategy "
                         f"{strategy} orthogonalizes each matrix whole on one owner, which receives it anyway")


def validate(cfg, specs):
    """Every check that can be made before spawning; raises ValueError with one line.
    The optimizer's own rules are its own functions, spelled with the flags' names."""
    check_topology(cfg.dp, cfg.tp)
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1 (got {cfg.steps})")
    if not 0 <= cfg.seed < 2**32:
        raise ValueError(f"--seed must be in [0, 2**32) (got {cfg.seed})")
    check_hyperparameters(flag, bucket_size=cfg.bucket_size, lr=cfg.lr, weight_decay=cfg.weight_decay,
                          momentum=cfg.momentum, adjust_lr_fn=cfg.adjust_lr_fn)
    if cfg.lr == 0:
        raise ValueError("--lr must be > 0: with lr 0 no weight moves and the comparison proves nothing")
    if cfg.ns_steps < 1:
        raise ValueError(f"--ns-steps must be >= 1 (got {cfg.ns_steps})")
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)} (got {cfg.strategy!r})")
    if cfg.baseline and cfg.strategy != "gather":
        raise ValueError(f"--baseline runs AdamW for every parameter: it takes no --strategy (got {cfg.strategy})")
    if cfg.model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)} (got {cfg.model!r})")
    if not 1 <= cfg.layers <= MAX_LAYERS:
        raise ValueError(f"--layers must be in [1, {MAX_LAYERS}] (got {cfg.layers})")
    check_owner_options(flag, overlap=cfg.overlap)
    check_large_run_flags(ns_coefficients=cfg.ns_coefficients, ns_blocks=cfg.ns_blocks,
                          tp_newton_schulz=cfg.tp_newton_schulz, qk_clip_tau=cfg.qk_clip_tau, strategy=cfg.strategy)
    if cfg.tp_newton_schulz == "gram" and cfg.tp == 1:
        raise ValueError("--tp-newton-schulz gram sums Newton-Schulz's Gram matrix over the TP ranks: with --tp 1 "
                         "no matrix is split, so it would change nothing")
    laid_out = [f for f, on in (("--ns-blocks", cfg.ns_blocks != "whole"), ("--qk-clip", cfg.qk_clip_tau is not None))
                if on]
    if laid_out and (cfg.model != "transformer" or cfg.baseline):
        raise ValueError(f"{' and '.join(laid_out)}: no fused QKV to act on with --model {cfg.model}"
                         f"{' --baseline' if cfg.baseline else ''} (--model transformer has one, under Muon)")
    if cfg.overlap and cfg.strategy not in ("owner", "comm-free"):
        raise ValueError(f"--overlap applies to --strategy owner or comm-free (got {cfg.strategy})")
    if cfg.batched_ns and cfg.strategy not in ("owner", "comm-free"):
        raise ValueError(f"--batched-ns applies to --strategy owner or comm-free (got {cfg.strategy})")
    check_launch(cfg.timeout_s, cfg.fail_rank, cfg.dp * cfg.tp)
    names = {s.name for s in specs}
    for name, rank, step in cfg.missing_grads:
        if name not in names or not -1 <= rank < cfg.dp or not 1 <= step <= cfg.steps:
            raise ValueError(f"missing gradient ({name}, DP rank {rank}, step {step}) names no parameter, "
                             f"DP rank or step of this run")
    check_tp_divides(specs, cfg.tp)


def run(cfg, explain=False, print_fn=print):
    """Plan, start the ranks on this machine, verify against torch, account; returns the results dict."""
    validate(cfg, demo_specs(cfg))
    plan = plan_optimizer(cfg)
    print_header(cfg, plan, "CPU", "Gloo", explain, print_fn)
    t0 = time.perf_counter()
    results = spawn_ranks(cfg)
    ranks_s = time.perf_counter() - t0
    checks, ref_s = verify(cfg, results)
    return report(cfg, plan, results, checks, ranks_s, ref_s, print_fn=print_fn)


class OneLineParser(argparse.ArgumentParser):
    """The parser of every command of the project. What argparse itself refuses (an unknown flag, a
    value that is not a number, a choice not offered, a missing value) ends the command as every
    other refusal does: one line `error: <message>` on stderr, exit 2, before any rank starts
    (argparse's own ends with the usage, a dozen lines). --help is argparse's. Under torchrun every
    process parses the same argv: rank 0 alone says it, as run_under_torchrun does."""

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


def build_parser(description, launcher="spawn"):
    """The command line. launcher "torchrun" (distributed_muon.py) takes DP from the world size by default."""
    d = RunConfig()
    p = OneLineParser(description=description)
    if launcher == "torchrun":
        p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: processes / TP)")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default %(default)s)")
    else:
        p.add_argument("--dp", type=int, default=d.dp, help="data-parallel size (default %(default)s)")
        p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of parameters and gradients (default %(default)s)")
    p.add_argument("--bucket-size", type=int, default=d.bucket_size,
                   help="largest bucket in elements, before padding to a multiple of DP (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate, Muon and AdamW (default %(default)s)")
    p.add_argument("--momentum", type=float, default=d.momentum, help="Muon momentum in [0, 1) (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="decoupled weight decay (default %(default)s)")
    p.add_argument("--ns-steps", type=int, default=d.ns_steps, help="Newton-Schulz iterations (default %(default)s)")
    p.add_argument("--adjust-lr-fn", default=d.adjust_lr_fn,
                   help=f"one of {', '.join(ADJUST_LR_FNS)} (default %(default)s)")
    p.add_argument("--strategy", default=d.strategy, choices=STRATEGIES,
                   help="gather (default): every rank that touches a matrix orthogonalizes it; owner: one rank "
                        "per matrix, all-to-all exchanges; comm-free: matrices sharded whole across DP")
    p.add_argument("--baseline", action="store_true",
                   help="run the AdamW ZeRO-1 baseline instead: every parameter takes AdamW, no Muon")
    p.add_argument("--model", default=d.model, choices=MODELS,
                   help="transformer (default): section 3's model; lopsided: one huge matrix among small ones; "
                        "thin: matrices with a small side (600x6, 64x1, 97x5, ...)")
    p.add_argument("--layers", type=int, default=d.layers, help="transformer layers (default %(default)s)")
    p.add_argument("--overlap", type=int, nargs="?", const=OVERLAP_DEFAULT, default=d.overlap, metavar="K",
                   help="owner, comm-free: pipeline the step bucket by bucket, Newton-Schulz K units behind "
                        f"the gradient reductions (section 6; K = {OVERLAP_DEFAULT} if omitted; default off)")
    p.add_argument("--batched-ns", action="store_true",
                   help="owner, comm-free: orthogonalize same-shape matrices in one batched call; faster for many "
                        "small matrices, but not bit-identical to torch (within 2**-5 of the largest entry)")
    p.add_argument("--ns-coefficients", default=d.ns_coefficients, choices=tuple(NS_COEFFICIENT_CHOICES),
                   help="Newton-Schulz coefficients: jordan (default, torch's one quintic) or polar_express "
                        "(one per iteration, arXiv 2505.16932)")
    p.add_argument("--ns-blocks", default=d.ns_blocks, choices=NS_BLOCKS,
                   help="the fused QKV orthogonalized whole (default, torch's), as Q, K, V (blocks) or per head "
                        "(heads), each block's lr adjusted for its own shape")
    p.add_argument("--tp-newton-schulz", default=d.tp_newton_schulz, choices=TP_NEWTON_SCHULZ,
                   help="gather (default): TP gather -> Newton-Schulz -> TP shard; gram: matrices split along "
                        "their long side exchange a Gram matrix per iteration instead (--strategy gather; "
                        "not bit-identical, within a derived bound)")
    p.add_argument("--qk-clip", type=float, default=d.qk_clip_tau, dest="qk_clip_tau", metavar="TAU",
                   help="QK-clip after every step (Kimi K2): heads whose largest logit exceeds TAU have their q "
                        "and k rows scaled by sqrt(TAU / max); the demo's maxima are synthetic (default off)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s", metavar="SECONDS",
                   help="seconds after which a rank that stopped responding, or a collective that waits, "
                        "ends the run (default %(default)s)")
    p.add_argument("--explain", action="store_true",
                   help="print which DP rank keeps which part of which parameter, and who owns which matrix")
    p.add_argument("--json", metavar="PATH", help="write the run's results (checks, bytes, FLOPs, timings)")
    p.add_argument("--traceback", action="store_true", help="on a rank's failure, print its traceback too")
    p.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)  # tests: make this rank raise
    return p


def config_from_args(a):
    """The RunConfig the parsed arguments describe (every field is a flag of the same name)."""
    return RunConfig(**{f.name: getattr(a, f.name) for f in fields(RunConfig) if hasattr(a, f.name)})


def write_json(path, results):
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def exit_code(work, show_traceback=False):
    """Run work() the way a command should end: its return code, or one line on stderr and
    2 (a bad flag, path or config), 1 (a rank failed), 130 (Ctrl-C) or 143 (SIGTERM)."""
    previous = signal.signal(signal.SIGTERM, raise_interrupted)  # SIGTERM cleans up as Ctrl-C does
    try:
        return work()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        if show_traceback:
            print(e.traceback, file=sys.stderr, end="")
        return 1
    except KeyboardInterrupt:
        print("error: interrupted (SIGINT); every rank stopped, temporary files removed", file=sys.stderr)
        return 130  # 128 + SIGINT, as shells and torchrun report it
    except Interrupted:
        print("error: terminated (SIGTERM); every rank stopped, temporary files removed", file=sys.stderr)
        return 143  # 128 + SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv=None):
    args = build_parser("ZeRO-1 x TP distributed Muon on CPU ranks over Gloo, checked bit for bit against "
                        "torch.optim.Muon / AdamW.").parse_args(argv)

    def work():
        if args.json:
            check_writable(args.json)
        results = run(config_from_args(args), explain=args.explain)  # validates before spawning anything
        write_json(args.json, results)
        return 0 if results["passed"] else 1

    return exit_code(work, args.traceback)


# The notebooks' helpers.
def notebook_requirements():
    """The notebooks' setup: install requirements.txt when this torch has no torch.optim.Muon (the
    reference, torch >= 2.9) or matplotlib is missing. A torch already imported stays loaded until
    the kernel restarts, so a new one asks for a restart."""
    import importlib.util

    if hasattr(torch.optim, "Muon") and importlib.util.find_spec("matplotlib") is not None:
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", "requirements.txt"], check=True)
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Muon (torch >= 2.9): a newer torch was "
                           "installed from requirements.txt; restart the kernel and run the notebook again.")


def run_program(program, *args):
    """The notebooks' way to run a script of this repository: with this interpreter, its output printed
    as it comes; CalledProcessError if it fails. (Ranks spawned from a notebook's kernel would re-import
    its __main__, which a notebook does not have, so a run is a process of its own.)"""
    cmd = [sys.executable, "-u", program, *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="")
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)



# How a command knows it runs under torchrun (distributed_muon_dtensor.py's demo, examples/).
def under_torchrun():
    """Whether this process is one rank started by torchrun: it sets RANK, WORLD_SIZE and LOCAL_RANK."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


# =============================================================================
# 11. Training checks: a real training against one process
# =============================================================================
# A training with real forward and backward passes splits some fp32 sums over
# ranks that the same model in one process computes whole: TP's partial products,
# FSDP2's partial sums over its ranks' tokens. Where the ranks' association is
# known, the one-process reference performs the same sums and every comparison is
# torch.equal: examples/train_gpt.py on Gloo for any TP (its TP all-reduces add
# every element's TP terms left to right in rank order, gpt.tp_all_reduce, and its
# reference computes TP's pieces apart and adds them in that order, gpt.GPT's
# as_tp), and under NCCL for TP <= 2 (two terms: a + b == b + a whatever order
# NCCL takes). Where it is not (NCCL's all-reduce of TP > 2 terms adds in its own
# order; dtensor_demo.py --train and examples/train_gpt_dtensor.py --verify, FSDP2
# x TP), the gradients cannot have the one process's bits, and these commands
# check three things (each names the sums it reorders: examples/train_gpt.py
# section 3, dtensor_demo.py section 7):
#
#   replay     torch's optimizers fed the ranks' own total gradients give every
#              rank's weights: bit for bit (but for train_gpt.py's stated opt-ins,
#              NCCL's DP order and --tp-newton-schulz gram, held to their bounds).
#   gradients  at the ranks' own weights, the ranks' gradients and losses against
#              the same computation in float64: within the bound below.
#   trained    both runs free-running from the same start: the gap of their losses
#              (loss_drift), reported beside the chaos floor, the gap of the same
#              one-process run started one ulp away (one_ulp_up), as a ratio; never
#              a verdict. A training amplifies any difference chaotically, so a
#              bound on the gap would fail correct runs, not bugs.
#
# The bound (bound_ratio <= 1 passes):
#   1. A sum of k fp32 terms, in any order, is within gamma(k - 1) * sum |terms| of
#      the exact sum, gamma(m) = m u / (1 - m u) (Higham, "Accuracy and Stability of
#      Numerical Algorithms", 2002, section 4.2). Split into p partial sums that are
#      then added, it is gamma(k / p + p - 2) <= gamma(k - 1): a reordered sum has a
#      worst case no larger than the one process's.
#   2. How a step's data amplify each rounding (norms, softmax, the residual sums)
#      has no closed form, so that worst case is measured on the step: the one
#      process's fp32 error against float64 (u = 2**-53: its own error is 2**-29 of
#      fp32's), e_one = max |G_fp32 - G_fp64| per tensor.
#   3. The ranks' e_ranks = max |G_ranks - G_fp64| is another draw of the same worst
#      case, in another order: held to REALIZED_FACTOR x e_one, plus one reordered
#      reduction of the step's n terms adding up to the largest entry, n u max |G_fp64|
#      (which keeps the bound above zero where the one process happens to round
#      well). A loss: the same, with the n tokens it is the mean of.
# A lost all-reduce or a wrong split moves a gradient by a fraction of itself, far
# beyond the bound: the commands' tests break one and see FAIL.
UNIT_ROUNDOFF = 2.0**-24  # fp32's u (a 24-bit significand): a rounding moves a result by at most this fraction of it
REALIZED_FACTOR = 4  # step 3's factor, the one part not derived: two orders' errors are two draws of the same rounding,
#                      their largest entries 2x apart at most in the runs measured (notes/09: TP = 2 against the
#                      plain model, before its reference took the ranks' association; TP = 4 under Gloo's own
#                      all-reduce order, before train_gpt.py's TP all-reduce took rank order); 4 leaves room for
#                      that and stays far below what a bug does. Used only where the association is unknown
#                      (above): FSDP2 x TP and NCCL's TP > 2.


def bound_ratio(ranks_err, one_err, n, scale):
    """The ranks' error against float64 over its bound (step 3 above; <= 1 passes): one_err is the one
    process's error on the same step, n the terms of one reordered reduction, scale its largest float64 entry
    (or the loss). A zero bound holds only a zero error."""
    bound = REALIZED_FACTOR * one_err + n * UNIT_ROUNDOFF * scale
    return ranks_err / bound if bound > 0 else (0.0 if ranks_err == 0 else math.inf)


def loss_drift(losses, reference_losses):
    """The largest relative difference of two runs' losses ([[loss of each micro-batch] per step])."""
    return max(abs(a - b) / b for step, ref in zip(losses, reference_losses) for a, b in zip(step, ref))


def one_ulp_up(tensor):
    """Entry 0 of `tensor` one ulp up (toward +inf), in place: where the chaos floor's run starts."""
    with torch.no_grad():
        first = tensor.view(-1)[:1]
        first.copy_(torch.nextafter(first, torch.full_like(first, math.inf)))
