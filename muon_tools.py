"""The runner: the lesson's demo run set up, torch's reference, the report, the launcher, the command line.

distributed_muon_cpu.py is the lesson (sections 1-6: the gather flow, its optimizer and its run) and the core of
the library, distmuon/ (distmuon/owners.py its section 7, the owner and comm-free strategies; distmuon/large_runs.py
its section 8, what large runs add). What is here is what a command needs around them, and nothing a reader of
the algorithm must read: it continues the lesson's numbering. The library imports nothing from it.

    9. The run's settings (RunConfig, the models of --model, the optimizer of --strategy and the options),
       torch's reference (reference_params) and the bounds of the two opt-ins that are not bit for bit
    10. Accounting (bytes per phase, Newton-Schulz FLOPs, redundancy, balance) and the report
    11. Main: the launcher (start, watch and stop the ranks; run_under_torchrun under torchrun) and the
        command line
    12. Training checks: how a real training is checked against one process (the bound on its
        gradients, the chaos floor), for examples/train_gpt.py and dtensor_demo.py alike

The launcher (spawn_ranks, run_under_torchrun, exit_code, RankFailure; its forkserver and janitor are in
muon_forkserver.py, without torch, for a command's first lines to start), the table formatting
(format_table, human_bytes), the parser (OneLineParser) and the checks of a command's options
(check_launch, check_writable, flag) serve every command of the repository: distributed_muon.py,
distmuon/dtensor/, dtensor_demo.py, examples/ and benchmarks/ import them from here, and the
training checks (bound_ratio, loss_drift, one_ulp_up) too. `python distributed_muon_cpu.py` runs main()
below; `torchrun ... distributed_muon.py` runs main_under_torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import importlib.util
import inspect
import json
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, fields, replace
from unittest import mock

import torch
import torch.distributed as dist

import distributed_muon_cpu as dm
from distributed_muon_cpu import (D_MODEL, NS_COEFFICIENTS, NS_EPS, NS_STEPS, N_LAYERS, ParamSpec, adjusted_lr,
                                  dp_rank_grads, initial_params, newton_schulz, plan_grid, transformer_specs)
import distmuon.checks as mc
from distmuon.checks import ADJUST_LR_FNS, NS_COEFFICIENT_CHOICES, TORCH_OPTIONS, check_grid, check_hyperparameters
from muon_forkserver import remove_at_exit, start_method, stop_forkserver
from distmuon.owners import (BATCHED_NS_BOUND, OPTIMIZERS, OVERLAP_DEFAULT, STRATEGIES, check_owner_options,
                             load_balance)
from distmuon.large_runs import (NS_BLOCKS, TP_NEWTON_SCHULZ, LargeRuns, RowLayout, check_large_run_options,
                                 gram_eligible, newton_schulz_flops_of)


# =============================================================================
# 9. The run's settings, torch's reference, and the bounds of the two opt-ins
# =============================================================================
# The run of the lesson's section 6 (run_rank), set up from the command line: its
# settings (RunConfig), its model (--model), its optimizer (the strategy, and the
# options of sections 7 and 8), and its reference: PyTorch's own single-device
# torch.optim.Muon and torch.optim.AdamW on the full parameters, fed the sum of
# every DP rank's gradient: an independent implementation, not the lesson's code
# path. Rank 0 compares every rank's piece with it (check_against_torch). No
# tolerance is needed by default: the only cross-rank reduction that changes a
# value is the gradient sum, exact by construction (section 6; QK-clip's maxima
# are a MAX, exact in any order); everything else is elementwise on shards or one
# Newton-Schulz on the same full bf16 matrix with the same thread count. Two
# exceptions are choices, each held to a bound instead: batched_ns (section 7)
# and tp_newton_schulz="gram" (section 8.3's newton_schulz_tp sums the Gram
# matrix over ranks).

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
    normuon: bool = False  # the matrices take NorMuon (distmuon/normuon.py) instead of Muon: owner or comm-free
    model: str = "transformer"  # one of MODELS: the transformer of section 6, lopsided_specs() or thin_specs()
    layers: int = N_LAYERS  # transformer layers of the demo model (5 Muon matrices each)
    d_model: int = D_MODEL  # the demo transformer's width: its matrices are d x d to 4d x d
    overlap: int = 0  # owner / comm-free: K >= 1 pipelines the step, Newton-Schulz K units behind (section 7)
    batched_ns: bool = False  # owner / comm-free: same-shape matrices in one call (not bitwise torch's)
    ns_coefficients: str = "jordan"  # one of NS_COEFFICIENT_CHOICES (section 1)
    ns_blocks: str = "whole"  # one of NS_BLOCKS: the fused QKV whole, by blocks or by heads (distmuon/large_runs.py)
    tp_newton_schulz: str = "gather"  # gather: "gram" orthogonalizes eligible TP pieces where they lie (distmuon/large_runs.py)
    qk_clip_tau: float = None  # a number > 0: QK-clip after every step, with dp_rank_max_logits (distmuon/large_runs.py)
    timeout_s: float = TIMEOUT_S  # a silent rank or a stuck collective ends the run after this long
    missing_grads: tuple = ()  # (name, dp_rank or -1 for all, step): gradients that are None (tests)
    fail_rank: int = -1  # for testing failure handling: this rank raises at step 1
    backend: str = "gloo"  # distributed_muon.py's --backend: Gloo (CPU tensors), or NCCL on GPUs under torchrun
    device: str = "cpu"  # distributed_muon.py's --device: "cpu", or "cuda" (a GPU per rank) under torchrun


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
# A world this large on one machine is a typo, not a plan: every rank is a Python process with torch loaded (its
# memory: notes/07-pitfalls.md). The demo's gradients stay exact in float32 far beyond it (the lesson's section 6).
MAX_WORLD = 64
N_HEADS = 8  # the demo transformer's attention heads: its fused QKV's row layout (section 8's blocks and QK-clip)
FUSED_QKV = "attn.qkv.weight"  # the demo's fused QKV matrices end so: laid out head by head, as Megatron's


def demo_specs(cfg):
    if cfg.model == "transformer":
        return transformer_specs(d=cfg.d_model, n_layers=cfg.layers)
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
    muon = dict(algorithm="normuon" if cfg.normuon else "muon", lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                nesterov=True, ns_steps=cfg.ns_steps, adjust_lr_fn=cfg.adjust_lr_fn,
                ns_coefficients=cfg.ns_coefficients)
    # One lr and weight decay for Muon and AdamW (Moonlight's practice with
    # match_rms_adamw); torch's default betas and eps; no decay on norms and biases.
    adamw = dict(algorithm="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8)
    return {"muon": adamw if cfg.baseline else muon, "adamw": adamw,
            "adamw_no_wd": dict(adamw, weight_decay=0.0)}


def transformer_row_layouts(specs, heads=N_HEADS):
    """{name: RowLayout} of the demo's fused QKV matrices ((3d, d): q, k and v of each head, d / heads rows each),
    laid out head by head as Megatron's are (so that a column-parallel split gives each TP rank whole heads)."""
    return {s.name: RowLayout((s.global_shape[1] // heads,) * 3, heads, ("q", "k", "v"))
            for s in specs if s.name.endswith(FUSED_QKV)}


def dp_rank_max_logits(specs, seed, step, dp_rank):
    """{fused QKV name: the largest logit of each of its N_HEADS heads in DP rank dp_rank's forward at `step`}
    (float32): for section 8's QK-clip, what a forward pass would report, drawn as the gradients are. Head h's lies
    in [0.75, 1.25] x 25 (h + 1): with tau = 100 the first three heads never clip, the last three always do, and the
    two between depend on the step and the batch."""
    g = torch.Generator().manual_seed((seed * 100_003 + step) * 1_009 + dp_rank + 1)
    return {s.name: 25 * (0.75 + 0.5 * torch.rand(N_HEADS, generator=g)) * torch.arange(1, N_HEADS + 1)
            for s in specs if s.name.endswith(FUSED_QKV)}


def computed_here(max_logits, tp_rank, tp):
    """What a rank reports: its TP rank's heads (the demo's QKV is split by rows), -inf for the others."""
    out = {}
    for name, s in max_logits.items():
        heads = s.numel() // tp
        out[name] = torch.full_like(s, -math.inf)
        out[name][tp_rank * heads:(tp_rank + 1) * heads] = s[tp_rank * heads:(tp_rank + 1) * heads]
    return out


def demo_row_layouts(specs, cfg):
    """The fused QKV's layout when a run asks for blocks or QK-clip (none otherwise: torch's run)."""
    return transformer_row_layouts(specs) if cfg.ns_blocks != "whole" or cfg.qk_clip_tau is not None else {}


def build_optimizer(specs, cfg, grid, params):
    """The demo's optimizer for cfg.strategy over this rank's TP pieces `params` ({name: tensor})."""
    groups = [dict(h, params=[(s.name, params[s.name]) for s in specs if s.group == g])
              for g, h in group_hyperparameters(cfg).items()]
    options = {} if cfg.strategy == "gather" else dict(overlap=cfg.overlap, batched_ns=cfg.batched_ns)
    row_layouts = demo_row_layouts(specs, cfg)
    if row_layouts or cfg.tp_newton_schulz != "gather":  # section 8's options: torch's run without them
        options["large_runs"] = LargeRuns(row_layouts=row_layouts, ns_blocks=cfg.ns_blocks,
                                          tp_newton_schulz=cfg.tp_newton_schulz, qk_clip_tau=cfg.qk_clip_tau)
    return OPTIMIZERS[cfg.strategy]([g for g in groups if g["params"]], grid=grid, bucket_size=cfg.bucket_size,
                                    tp_split_dims={s.name: s.tp_split_dim for s in specs if s.tp_split_dim >= 0},
                                    **options)


def after_demo_step(cfg, specs, build, step, opt, out):
    """What the runner adds to the lesson's run_steps after each step (its after_step, with cfg, specs and the
    build given): section 8's QK-clip with the demo's maxima; halfway, a resume from a checkpoint (a fresh optimizer
    loads this rank's state_dict: were the state lost, the momentum would restart and the comparison with torch
    would fail); and --fail-rank's failure, how the tests make a rank fail. Returns the optimizer to go on with."""
    grid = opt.grid
    if grid.rank == cfg.fail_rank:
        raise RuntimeError(f"injected failure on rank {grid.rank} at step {step} (--fail-rank)")
    clipped = out.setdefault("qk_clip", [])
    if cfg.qk_clip_tau is not None:
        max_logits = dp_rank_max_logits(specs, cfg.seed, step, grid.dp.rank)
        clipped.append(opt.clip_qk_(computed_here(max_logits, grid.tp.rank, grid.tp.size)))
    if step == (cfg.steps + 1) // 2:
        fresh = build(grid, dict(opt.param_by_name))
        fresh.load_state_dict(opt.state_dict())
        fresh.ledger, opt = opt.ledger, fresh
    return opt


def after_step(cfg, specs, build):
    """after_demo_step for this run, as the lesson's run_steps calls it (picklable: it travels to the ranks)."""
    return functools.partial(after_demo_step, cfg, specs, build)


def plan_optimizer(cfg, rank=0, specs=None):
    """The optimizer rank `rank` will build (for the run's model, or `specs`), built here on a grid without
    process groups. Its layout (buckets, dist_meta) and owners depend on shapes alone, so the launcher
    prints them from the very code every rank runs, before any rank starts.
    """
    specs, grid = specs or demo_specs(cfg), plan_grid(cfg.dp, cfg.tp, rank)
    start = initial_params(specs, cfg.seed)
    return build_optimizer(specs, cfg, grid, {s.name: dm.rank_piece(start[s.name], s, grid, "cpu") for s in specs})


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
        unknown = set(options) - set(mc.OPTIONS["normuon"])
        if unknown:
            raise TypeError(f"NorMuonReference takes no {', '.join(sorted(unknown))}")
        super().__init__(params, dict(mc.OPTIONS["normuon"], **options))

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
    checks = dm.check_against_torch(specs, results, reference, cfg.tp, initial_params(specs, cfg.seed))
    return bound(cfg, checks, device), time.perf_counter() - t1


def rank_program(cfg, run_rank=dm.run_rank):
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
    return dm.run_steps(cfg, specs, build, grid, device, after_step(cfg, specs, build))


def verdict(checks, reference="torch"):
    """'PASS: 26/26 parameters bit-identical to torch' (or FAIL), with those within a derived bound
    (--batched-ns, --tp-newton-schulz gram) said apart; reference: what they were compared with."""
    n_same, n_within = sum(c["identical"] for c in checks), sum(c["ok"] and not c["identical"] for c in checks)
    within = f", {n_within} within their derived bound" if n_within else ""
    passed = all(c["ok"] for c in checks)
    return passed, (f"{'PASS' if passed else 'FAIL'}: {n_same}/{len(checks)} parameters bit-identical to "
                    f"{reference}{within}")


# =============================================================================
# 10. Accounting
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
# (section 7) give each matrix one owner instead: redundancy 1, and max/mean
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
    # and those of the options of section 8 a run took ("TP Gram", "QK-clip maxima", ...), as they came
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


def rounded_parts(parts, digits=0):
    """{name: value} rounded to `digits` decimals so that they add up to their rounded sum, as a printed line
    "total = a + b + c" must: each is rounded down, then the largest remainders up (Hare's method). Rounding
    each alone can miss by a unit per part."""
    unit = 10 ** digits
    floors = {k: math.floor(v * unit) for k, v in parts.items()}
    short = round(sum(parts.values()) * unit) - sum(floors.values())
    for k in sorted(parts, key=lambda k: floors[k] - parts[k] * unit)[:short]:
        floors[k] += 1
    return {k: v if digits == 0 else v / unit for k, v in floors.items()}


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def format_grid(dp, tp):
    """The rank layout as a small table."""
    grid = torch.arange(dp * tp).view(dp, tp)
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
    whole = " (Muon matrices are sharded whole, outside the buckets)" if plan.strategy.name == "comm-free" else ""
    print_fn(f"[3] Virtual buffer: {n_buffers} param groups, {len(buckets)} buckets of <= {cfg.bucket_size:,} "
             f"elements, {used:,} TP-local elements + {padded - used} padding per rank{whole}")
    if explain:
        print_fn(format_buffer_map(plan.layout))
    if plan.owners:
        per_rank, balance = load_balance(plan.strategy.ns_flops, plan.owners, world)
        print_fn(f"[7] Owners: {len(plan.owners)} matrices on {world} ranks by longest-processing-time over "
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
    passed, summary = verdict(checks, "NorMuon's reference and torch" if cfg.normuon else "torch")
    reference_name = ("torch.optim.AdamW" if cfg.baseline else
                      "NorMuon's reference / torch.optim.AdamW" if cfg.normuon else "torch.optim.Muon / torch.optim.AdamW")
    print_fn(f"[6] Every rank's piece against {reference_name} on one device "
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
        print_fn(f"[8] QK-clip, tau {cfg.qk_clip_tau:g}: heads clipped per step "
                 f"{', '.join(f'{len(c)}/{heads}' for c in clipped)} (one MAX all-reduce of the per-head maxima)\n")

    table, same_every_step, flops = account(cfg, results)
    gloo_note = "; on Gloo the reduce-scatter is an all-to-all and a local sum" if backend == "gloo" else ""
    print_fn(f"[10] Bytes per step: ring counts for all-gather and reduce-scatter, exact counts for all-to-all "
             f"({'the same every step' if same_every_step else 'last step; steps differ'}{gloo_note})")
    rows = [[phase, t["axis"], t["dtype"], human_bytes(max(t["sent"])), human_bytes(max(t["received"])),
             human_bytes(sum(t["sent"]))] for phase, t in table.items()]
    max_sent, all_sent = total_bytes(table)
    max_received, _ = total_bytes(table, "received")
    rows.append(["total", "", "", human_bytes(max_sent), human_bytes(max_received), human_bytes(all_sent)])
    print_fn(format_table(["phase", "axis", "dtype", "sent/rank (max)", "received/rank (max)", "sent, all ranks"],
                          rows, ["<", "<", "<", ">", ">", ">"]) + "\n")

    if flops["single_device"]:
        print_fn(f"[10] Newton-Schulz FLOPs per step: single device {flops['single_device'] / 1e9:.3f} GFLOP; "
                 f"per rank {', '.join(f'{f / 1e9:.3f}' for f in flops['per_rank'])} GFLOP")
        why = ("every TP peer, and every DP rank whose shard touches a matrix, orthogonalizes it"
               if cfg.strategy == "gather" else "each matrix is orthogonalized once, by its owner")
        print_fn(f"    redundancy = sum over ranks / single device = {flops['redundancy']:.2f} "
                 f"(upper bound DP x TP = {world}; {why}); max/mean per rank = {flops['max_over_mean']:.2f}\n")
    state = [r["state_bytes"] for r in results]
    print_fn(f"[10] Optimizer state per rank: max {human_bytes(max(state))}, min {human_bytes(min(state))}")

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
# 11. Main: the launcher and the command line
# =============================================================================
# The launcher checks the arguments and plans the layout (before starting any
# rank), starts one process per rank and watches them, then prints the report.
# Like torchrun, it tells each process who it is (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT), stops every rank on Ctrl-C or SIGTERM, and names the
# rank that failed, died or stopped responding. What a rank returns reaches the
# launcher through a temporary folder: the lesson's run_rank returns its report
# on rank 0 (every rank's results, gathered there, and the check against torch).
# Under torchrun (distributed_muon.py, and the examples' --backend nccl) there is
# no launcher of ours: run_under_torchrun, below, does in each process what can
# be done there.

def one_line(error):
    """An exception as one line, 'Type: message', whatever newlines its message holds."""
    return " ".join(f"{type(error).__name__}: {error}".split())


class WriteError(OSError):
    """An output that could not be written (a full disk, a folder gone): one line, exit 1 (exit_code)."""


def umask():
    """This process's umask (the permissions a new file does not get)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path, write):
    """Write the file `path` whole or not at all: write(f) fills a temporary file beside it (binary), which then
    replaces it in one rename, so that no reader (the launcher, a user) ever sees half a file and a failed write
    leaves what `path` held before as it was. A link is followed (its target replaced); a path that is not a
    regular file (/dev/stdout, a pipe) is written straight. WriteError (one line) if it cannot be written."""
    real = os.path.realpath(path)
    partial, straight = None, os.path.exists(real) and not os.path.isfile(real)
    try:
        if straight:
            with open(real, "wb") as f:
                write(f)
            return
        fd, partial = tempfile.mkstemp(prefix=f".{os.path.basename(real)}.", suffix=".partial",
                                       dir=os.path.dirname(real))
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(partial, os.stat(real).st_mode & 0o7777 if os.path.exists(real) else 0o666 & ~umask())
        os.replace(partial, real)
    except OSError as e:
        kept = "; the file there before is unchanged" if not straight and os.path.exists(real) else ""
        raise WriteError(f"{path} could not be written: {e.strerror or e}{kept}") from None
    finally:
        if partial is not None and os.path.exists(partial):
            os.remove(partial)


def save_figure(fig, path, **savefig):
    """A matplotlib figure into `path` (its format the path's extension, PNG without one), atomically."""
    kind = os.path.splitext(path)[1][1:].lower() or "png"
    write_atomically(path, lambda f: fig.savefig(f, format=kind, **savefig))


HEARTBEAT_S = 0.5  # how often a rank says it is alive


def end_if_orphaned(launcher, folders, wait_s=0.0):
    """End this rank if the launcher is gone (start_heartbeat), removing the launcher's temporary folders first.
    A rank also looks once it has written its last file there (its result, or its error, which a peer's going
    may cause): every rank removes them after its last write, so the last one out leaves nothing."""
    if launcher.poll(wait_s):
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)


def start_heartbeat(heartbeats, rank, launcher, folders):
    """A thread that writes the time into heartbeats[rank] every HEARTBEAT_S.

    It beats while the rank computes or waits in a collective, and stops only
    when the whole process does (SIGSTOP, a debugger, swapped out): that is how
    the launcher tells the rank that stopped from the peers waiting for it.
    `launcher` is the read end of a pipe whose write end only the launcher holds:
    it becomes readable (end of file) when the launcher is gone, even killed by
    SIGKILL, and then the rank ends itself rather than run on as an orphan. A
    launcher killed so cleans up nothing: the ranks remove its temporary `folders`
    (the run's, and multiprocessing's, where the forkserver's socket lies).
    """
    def beat():
        while True:
            end_if_orphaned(launcher, folders, HEARTBEAT_S)  # nothing is ever sent: it times out, or ends all
            heartbeats[rank] = time.monotonic()

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()


def name_process(title):
    """Show `title` in ps and top (Linux's prctl PR_SET_NAME); elsewhere do nothing."""
    try:
        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME, at most 15 bytes
    except (OSError, AttributeError):
        pass


def rank_process(rank, body, program, cfg, port, out_dir, heartbeats, launcher, folders):
    """One spawned rank, told who it is as torchrun tells it. body: body(rank, cfg, "cpu") once this
    process has joined the Gloo world; or program: program(), which joins and leaves by itself (the
    lesson's run_rank). What it returns is written to out_dir.

    Nothing is printed here: a failure is written to rank<R>.error (time, one
    line, traceback) and the launcher reports it once, for the whole run.
    """
    # Ctrl-C in a terminal sends SIGINT to every process of the job; the launcher
    # alone decides what happens next (it stops every rank and cleans up).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process(f"muon rank {rank}")
    start_heartbeat(heartbeats, rank, launcher, folders)
    torch.set_num_threads(1)  # same thread count everywhere, as in torch's reference (section 9)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.dp * cfg.tp),
                      LOCAL_WORLD_SIZE=str(cfg.dp * cfg.tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if program is not None:
            result = program()
        else:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
            result = body(rank, cfg, "cpu")
            dist.destroy_process_group()
        write_atomically(os.path.join(out_dir, f"rank{rank}.pt"), lambda f: torch.save(result, f))
    except BaseException as e:
        # When one rank dies its peers fail too ("connection closed"). The time
        # lets the launcher name the rank that failed first: the cause.
        text = f"{time.time()!r}\n{one_line(e)}\n{traceback.format_exc()}"
        with contextlib.suppress(OSError):  # the launcher died and its folder went with it: nobody to tell
            write_atomically(os.path.join(out_dir, f"rank{rank}.error"), lambda f: f.write(text.encode()))
        end_if_orphaned(launcher, folders)
        os._exit(1)  # no teardown that could wait on a dead peer
    end_if_orphaned(launcher, folders)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


# How a rank's error says that another rank found the problem: the optimizers vote, then the ranks that found
# it raise the details and every other one raises "rank R refused ... (it raised why); nothing changed"
# (distributed_muon_cpu.py's and distmuon/dtensor's refused step, clip_qk_ in distmuon/large_runs.py and
# distmuon/dtensor/).
HEARSAY = "(it raised why)"


def hearsay(error):
    """Whether a rank's one-line error only says that another rank found the problem (HEARSAY)."""
    return HEARSAY in error


def blame(exits, out_dir):
    """The RankFailure that names the cause, once some rank has exited abnormally.

    exits: [(rank, exit code)] in the order the launcher saw them end. A rank
    killed by a signal is the cause (its peers then fail with "connection
    closed"); otherwise the rank whose error was written first is, unless it is
    hearsay (another rank found the problem): after a vote every rank raises at
    once, in any order, and the first error that gives the details is the cause.
    """
    for rank, code in exits:
        if code < 0:
            return RankFailure(f"rank {rank} was killed by {signal.Signals(-code).name}")
    errors = rank_errors(out_dir)
    if errors:
        errors.sort(key=lambda e: hearsay(e[2]))  # stable: the details first, each kind by time
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
    launcher waits ERRORS_LAND_S for their errors, to name the first, and while
    every error so far is hearsay (another rank found the problem), up to
    timeout_s for the rank that found it); so does a rank whose heartbeat is older
    than timeout_s.
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
            def waiting_for_the_details():
                errors = rank_errors(out_dir)
                return time.monotonic() < now + timeout_s and errors and all(hearsay(e[2]) for e in errors)

            while (any(p.exitcode is None for p in procs)
                   and (time.monotonic() < now + ERRORS_LAND_S or waiting_for_the_details())):
                multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=POLL_S)
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


def spawn_ranks(cfg, body=None, program=None):
    """Run body(rank, cfg, "cpu") on cfg.dp x cfg.tp ranks, each joined to the Gloo world first; or
    program(), which joins by itself as under torchrun (rank_program: the lesson's run_rank). Returns
    what each returned, in rank order, or raises RankFailure naming the rank at fault.

    body and program must be importable by name, as any multiprocessing target (a functools.partial of
    one is). cfg needs dp, tp and timeout_s. Whatever ends the run (success, a failure, Ctrl-C or SIGTERM
    in the launcher), every rank is stopped and the temporary folder removed before this returns.
    """
    if (body is None) == (program is None):
        raise ValueError("spawn_ranks runs a body or a program: give one of them")
    context = multiprocessing.get_context(start_method())
    world = cfg.dp * cfg.tp
    heartbeats = context.Array("d", world, lock=False)  # shared memory: one time per rank
    with tempfile.TemporaryDirectory(prefix="distributed-muon-") as out_dir:
        remove_at_exit(out_dir)
        launcher, alive = context.Pipe(duplex=False)  # the ranks watch `launcher`; `alive` stays here
        folders = (out_dir, multiprocessing.util.get_temp_dir())  # what the ranks remove if the launcher is killed
        args = (body, program, cfg, free_port(), out_dir, heartbeats, launcher, folders)
        procs = [context.Process(target=rank_process, args=(rank,) + args, name=f"rank {rank}")
                 for rank in range(world)]
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


def worker_process(rank, fn, launcher, folders, *args):
    """A benchmark's worker (run_processes): fn(rank, *args), ended by a thread of its own, the launcher's
    temporary folders removed, once the launcher is gone (killed by SIGKILL too), as a rank is (start_heartbeat)."""
    def watch():
        while True:
            end_if_orphaned(launcher, folders, HEARTBEAT_S)

    threading.Thread(target=watch, daemon=True, name="launcher watch").start()
    fn(rank, *args)


def run_processes(fn, args, nprocs, folders=()):
    """fn(rank, *args) in nprocs processes started as the ranks are (start_method), for the benchmarks' workers,
    which join their process group themselves: wait for every one; the first that fails ends the run
    (RankFailure naming it; its traceback is on stderr). Whatever ends it (a failure, Ctrl-C, SIGTERM), every
    process is stopped before this returns; a launcher killed outright, the workers end themselves and remove
    `folders` (the caller's temporary ones) and multiprocessing's."""
    context = multiprocessing.get_context(start_method())
    remove_at_exit(*folders)
    launcher, alive = context.Pipe(duplex=False)  # the workers watch `launcher`; `alive` stays here
    folders = tuple(folders) + (multiprocessing.util.get_temp_dir(),)
    procs = [context.Process(target=worker_process, args=(rank, fn, launcher, folders) + tuple(args),
                             name=f"rank {rank}") for rank in range(nprocs)]
    try:
        for p in procs:
            p.start()
        while any(p.exitcode is None for p in procs):
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=POLL_S)
            failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                rank, code = failed[0]
                raise RankFailure(f"rank {rank} " + (f"was killed by {signal.Signals(-code).name}" if code < 0
                                                     else f"exited with code {code}"))
    finally:
        stop(procs)
        alive.close()


# The command line: its checks, made before any rank starts, then its parser and main().
# The shortest --timeout a run can live with: a rank's first heartbeat comes HEARTBEAT_S after it starts, and every
# rank must join the world (init_process_group, whose wait --timeout bounds too) before any step. Measured here (2
# cores, idle; the launcher's clock starts once every rank is started): 8 ranks joined 0.35 s after it, 16 ranks
# 0.7 s, 32 ranks 1.4 s and 64 (MAX_WORLD) 2.9 s; the default run failed at --timeout 0.6 (a rank's first heartbeat
# late) and passed at 1. 5 s covers MAX_WORLD's start with room for a loaded machine; below it a run died in its
# first second, each rank printing c10d's timeout (22 lines at --timeout 0.001).
MIN_TIMEOUT_S = 5.0
# The longest: torch.distributed counts a deadline in int64 nanoseconds of the steady clock (292 years): here a timeout
# of 1e10 s ended init_process_group at once ('timed out after 10000000000000ms'), 8.64e13 s (datetime.timedelta's
# largest) was an invalid Gloo timeout, 1e30 s no timedelta at all (OverflowError on every rank); 1e9 s worked.
MAX_TIMEOUT_S = 1e9


def check_launch(timeout_s, fail_rank=-1, world=1):
    """The launcher's own options, shared by every command that launches ranks (ValueError, one line)."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"--timeout must be > 0 seconds and finite (got {timeout_s})")
    if timeout_s < MIN_TIMEOUT_S:
        raise ValueError(f"--timeout {timeout_s:g} is below the {MIN_TIMEOUT_S:g} s the ranks may need to start and "
                         f"join the world (up to {MAX_WORLD} ranks on this machine; 2.9 s measured for 64): the run "
                         f"would end before its first step")
    if timeout_s > MAX_TIMEOUT_S:
        raise ValueError(f"--timeout {timeout_s:g} is above {MAX_TIMEOUT_S:g} s (31 years), the longest "
                         f"torch.distributed can count from now: its ranks would fail to join")
    if not -1 <= fail_rank < world:
        raise ValueError(f"--fail-rank must name a rank in [0, {world}) (got {fail_rank})")


def is_code_file(path):
    """Whether `path` is a file of the code this process runs: its script, or a module it has imported (only the
    files of the same name are resolved: thousands of modules are loaded with torch)."""
    real = os.path.realpath(path)
    files = [sys.argv[0] if sys.argv else ""] + [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    return any(isinstance(f, str) and os.path.basename(f) == os.path.basename(real) and os.path.realpath(f) == real
               for f in files)


def check_not_input(path, option, inputs=None):
    """Nothing a command writes may be one of its inputs: a ValueError (one line) if `path`, which the command
    will write (a file, or a folder it writes into), is one of `inputs` ({what it is: its path}, the files or
    folders it reads), or a file of the code it runs (its script, a module it imported: --json muon_tools.py)."""
    real = os.path.realpath(path)
    for what, given in (inputs or {}).items():
        if given and os.path.realpath(given) == real:
            raise ValueError(f"{option} {path} is {what}, which this command reads: it would write over its own "
                             f"input")
    if is_code_file(real):
        raise ValueError(f"{option} {path} is a file of the code this command runs: it would write over it")


def check_outputs(outputs):
    """Each output of a command names its own file: {option: path} (None or "": not given), a ValueError
    (one line) for two that are the same file (the second written over the first)."""
    seen = {}
    for option, path in outputs.items():
        if path:
            real = os.path.realpath(path)
            if real in seen:
                raise ValueError(f"{option} {path} is also {seen[real]}: one output would be written over the other")
            seen[real] = f"{option} {path}"


def check_writable(path, option="--json", folder=False, inputs=None):
    """Raise ValueError (one line) unless `path`, a file the run will write (or with folder=True, a folder it
    will write into, made with any missing parents), can be written: checked before any rank starts by
    creating it, since only that tells (as root, os.access says yes even to /proc). What this creates it
    removes at once, so that nothing is left however the run ends (whoever writes it creates it again); a
    file already there is opened for appending, not changed. Every rank of a torchrun job may check the
    same path: each removes only what it created (O_EXCL). Nor may it be an input (check_not_input: `inputs`,
    and the code this process runs)."""
    check_not_input(path, option, inputs)
    parent = os.path.dirname(os.path.abspath(path))
    if not folder and os.path.isdir(path):
        raise ValueError(f"{option} {path} is a directory")
    if folder and os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"{option} {path} is not a folder")
    if not folder and not os.path.isdir(parent):
        raise ValueError(f"{option} {path}: the folder {parent} does not exist")
    made = []  # the folders this makes, deepest first
    try:
        if folder:
            missing = os.path.abspath(path)
            while not os.path.lexists(missing):
                made.append(missing)
                missing = os.path.dirname(missing)
            os.makedirs(path, exist_ok=True)
            path_in = os.path.join(path, f".probe-{os.getpid()}")
            os.close(os.open(path_in, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            os.remove(path_in)
        else:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
                os.remove(path)
            except FileExistsError:
                with contextlib.suppress(FileNotFoundError):  # a peer's probe, removed since: it could be made
                    os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
    except OSError as e:
        raise ValueError(f"{option} {path} cannot be written: {e.strerror}") from None
    finally:
        for folder_made in made:
            with contextlib.suppress(OSError):
                os.rmdir(folder_made)


def read_checkpoint(path, step, option="--resume"):
    """The state_dict_metadata of the torch.distributed.checkpoint folder `path` a run resumes from after step
    `step`, checked before any rank starts (ValueError, one line): its .metadata there and readable; every file it
    names there, each long enough for what it holds there (a copy or a save that did not finish); and the step its
    optimizer saved (AdamW's `step` counters, a few scalars read from the files) equal to `step`."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"{option} {path}: no torch.distributed.checkpoint there (no .metadata)")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 (whatever the reader raises on a file that is not DCP's metadata)
        raise ValueError(f"{option} {path}: its .metadata cannot be read ({one_line(e)})") from None
    needed = {}  # file: the bytes it must hold at least
    for item in metadata.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        held = os.path.getsize(file) if os.path.isfile(file) else None
        if held is None or held < size:
            raise ValueError(f"{option} {path}: its file {name} " + ("is missing" if held is None else
                             f"holds {held:,} bytes, its .metadata says {size:,} at least") +
                             ": a copy or a save that did not finish")
    counters = {k: torch.zeros(()) for k, m in metadata.state_dict_metadata.items()
                if k.startswith("optim.state.") and k.endswith(".step") and tuple(getattr(m, "size", (1,))) == ()}
    if counters:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
                dcp.load(counters, checkpoint_id=path, no_dist=True)
        except Exception as e:  # noqa: BLE001 (whatever DCP raises on a file it cannot read)
            raise ValueError(f"{option} {path}: its files cannot be read ({one_line(e)})") from None
        saved = sorted({int(t.item()) for t in counters.values()})
        if saved != [step]:
            raise ValueError(f"{option}-step {step}: {path} was saved after step {saved[0]} (its optimizer's step "
                             f"counters): resume with {option}-step {saved[0]}" if len(saved) == 1 else
                             f"{option} {path}: its optimizer's step counters disagree "
                             f"({', '.join(map(str, saved))}): not one training's checkpoint")
    return metadata.state_dict_metadata


def check_checkpoint_model(path, saved, shapes, hint="", option="--resume"):
    """The model a checkpoint holds (`saved`: read_checkpoint's) against this run's, {parameter name: shape}:
    none missing or extra, each of its size (ValueError, one line). hint: the flags that change the model."""
    where = f"{option} {path}: its checkpoint"
    held = {k.removeprefix("model."): tuple(m.size) for k, m in saved.items() if k.startswith("model.")}
    for name, shape in shapes.items():
        if name not in held:
            raise ValueError(f"{where} has no {name}: it was saved from another model{f' ({hint}?)' if hint else ''}")
        if held[name] != shape:
            raise ValueError(f"{where}'s {name} is {held[name]}, this run's {shape}: resume with the sizes it was "
                             f"saved with")
    extra = sorted(set(held) - set(shapes))
    if extra:
        raise ValueError(f"{where} holds {extra[0]}, which this run's model has not: it was saved from another model"
                         f"{f' ({hint}?)' if hint else ''}")


# How a command knows it runs under torchrun (distmuon/dtensor/'s demo, examples/).
def under_torchrun():
    """Whether this process is one rank started by torchrun: it sets RANK, WORLD_SIZE and LOCAL_RANK."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def add_backend_flags(p):
    """--backend and --device, for a command that also runs under torchrun (backend_flags says what they mean)."""
    p.add_argument("--backend", choices=["nccl", "gloo"],
                   help="under torchrun: nccl (default) or gloo; without torchrun the ranks are Gloo's")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   help="under torchrun: cuda (default, a GPU per rank) or cpu; without torchrun the CPU")


def backend_flags(args):
    """(backend, device) of a command with add_backend_flags: under torchrun the flags (NCCL on GPUs unless they
    say otherwise); without it, spawned Gloo ranks on the CPU, the only thing they run, and a ValueError for a
    flag that asks for more (it would be ignored)."""
    if under_torchrun():
        return args.backend or "nccl", args.device or "cuda"
    asked = [f"--{name} {value}" for name, value, spawned in (("backend", args.backend, "gloo"),
                                                              ("device", args.device, "cpu"))
             if value not in (None, spawned)]
    if asked:
        raise ValueError(f"{' '.join(asked)} needs torchrun (torchrun --standalone --nproc-per-node N "
                         f"{os.path.basename(sys.argv[0])} ...): without it the ranks are Gloo's, on the CPU")
    return "gloo", "cpu"


def host_memory():
    """This machine's physical memory in bytes (what `free` calls total): the budget the commands check
    the sizes of a run against before starting it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def flag(argument):
    """The command-line flag of a keyword argument: bucket_size -> --bucket-size."""
    return "--" + argument.replace("_", "-")


MAX_LAYERS = 24  # 24 layers: 4.9 M parameters at d = 128, every rank holds them all; more is a typo on a laptop
# Every rank draws every full parameter and gradient (float32), and the launcher's reference holds them too:
# 16 Mi parameters are 64 MiB a copy (d = 256 with 20 layers is 16.0 M; d = 1024 with 1 layer 13.6 M).
MAX_DEMO_PARAMETERS = 16 * 2**20



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


FLOAT32_MAX = torch.finfo(torch.float32).max
TORCH_ADAMW_BETAS = TORCH_OPTIONS["adamw"]["betas"]


def check_step_numbers(name, groups, muon_shapes):
    """The numbers a float32 step cannot survive, refused before any rank starts (ValueError, one line; `name`
    spells an option: a flag). groups: the options of a run's param groups (algorithm, lr, weight_decay; a Muon
    group's adjust_lr_fn, an AdamW group's betas, torch's default if absent); muon_shapes: the full shapes of the
    matrices Muon steps (a block of --ns-blocks is never adjusted above its whole matrix).

    torch's step hands two scalars to float32 kernels that refuse one float32 cannot hold ("value cannot be
    converted to type float without overflow", on every rank): Muon's adjusted lr (lr x its shape's factor:
    adjusted_lr) and AdamW's step size lr / (1 - beta1^step), largest at step 1. Those are refused, the largest
    first. And decoupled weight decay multiplies every weight by 1 - lr x weight_decay at every step: at
    lr x weight_decay = 1 that erases the weights, above it flips their signs (and above 2 grows them until
    they overflow), which is no decay: lr x weight_decay >= 1 is refused too."""
    scalars = []
    for group in groups:
        lr = group["lr"]
        if group["algorithm"] in mc.ORTHOGONALIZED:  # NorMuon's update keeps Muon's norm, and takes its lr so
            fn, who = group.get("adjust_lr_fn") or "original", "NorMuon" if group["algorithm"] == "normuon" else "Muon"
            scalars += [(adjusted_lr(lr, fn, shape), adjusted_lr(1.0, fn, shape),
                         f"{who}'s lr of a {shape[0]}x{shape[1]} matrix ({fn})", lr) for shape in muon_shapes]
        else:
            beta1 = group.get("betas", TORCH_ADAMW_BETAS)[0]
            scalars.append((lr / (1 - beta1), 1 / (1 - beta1), f"AdamW's first step size lr / (1 - beta1 {beta1:g})",
                            lr))
    if scalars:
        value, factor, what, lr = max(scalars, key=lambda s: s[:2])
        if not value <= FLOAT32_MAX:
            raise ValueError(f"{name('lr')} {lr:g} overflows float32 in the step: {what} is {factor:.3g} x lr = "
                             f"{value:.3g}, more than float32's largest number ({FLOAT32_MAX:.3g}); torch's step "
                             f"would fail converting it on every rank")
    for group in groups:
        lr, weight_decay = group["lr"], group["weight_decay"]
        if lr * weight_decay >= 1:
            raise ValueError(f"{name('lr')} {lr:g} x {name('weight_decay')} {weight_decay:g} = {lr * weight_decay:g} "
                             f"is >= 1: every step multiplies each weight by 1 - lr x weight_decay = "
                             f"{1 - lr * weight_decay:g}, which erases it (at 0) or flips its sign (below 0) instead "
                             f"of decaying it toward 0")


# What only Muon reads: with --baseline (AdamW for every parameter) a value other than the default changes nothing.
MUON_ONLY = ("momentum", "ns_steps", "adjust_lr_fn", "ns_coefficients", "tp_newton_schulz")


def check_seed(seed, option="--seed"):
    """A seed every generator of a run takes: in [0, 2**32) (torch's manual_seed takes less than 2**64, and a run
    derives its batches' seeds from it: examples/stdlib_text.py multiplies it by 1,000,003)."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"{option} must be in [0, 2**32) (got {seed})")


def check_topology(dp, tp, world=None):
    """The lesson's grid check (every factor named), and at most MAX_WORLD ranks on this machine."""
    check_grid(dp, tp, world)
    if dp * tp > MAX_WORLD:
        raise ValueError(f"DP {dp} x TP {tp} = {dp * tp} ranks is more than {MAX_WORLD} on one machine")


def validate(cfg, specs):
    """Every check that can be made before spawning; raises ValueError with one line.
    The optimizer's own rules are its own functions, spelled with the flags' names."""
    check_topology(cfg.dp, cfg.tp)
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1 (got {cfg.steps})")
    check_seed(cfg.seed)
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
    muon_only = [f"{flag(k)} {getattr(cfg, k)}" for k in MUON_ONLY if getattr(cfg, k) != getattr(RunConfig, k)]
    if cfg.baseline and muon_only:
        raise ValueError(f"--baseline runs AdamW for every parameter: {', '.join(muon_only)} would change nothing "
                         f"(Muon's options)")
    if cfg.model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)} (got {cfg.model!r})")
    for size in ("layers", "d_model"):
        if cfg.model != "transformer" and getattr(cfg, size) != getattr(RunConfig, size):
            raise ValueError(f"{flag(size)} sizes --model transformer: --model {cfg.model} has shapes of its own "
                             f"(got {flag(size)} {getattr(cfg, size)})")
    if not 1 <= cfg.layers <= MAX_LAYERS:
        raise ValueError(f"--layers must be in [1, {MAX_LAYERS}] (got {cfg.layers})")
    if cfg.d_model < N_HEADS or cfg.d_model % N_HEADS:
        raise ValueError(f"--d-model must be a positive multiple of the demo's {N_HEADS} heads (got {cfg.d_model})")
    n_parameters = sum(math.prod(s.global_shape) for s in specs)
    if n_parameters > MAX_DEMO_PARAMETERS:
        raise ValueError(f"--d-model {cfg.d_model} x --layers {cfg.layers}: {n_parameters:,} parameters, more than the "
                         f"{MAX_DEMO_PARAMETERS:,} a laptop's ranks can each hold whole")
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
    if cfg.normuon and (cfg.strategy not in ("owner", "comm-free") or cfg.baseline):
        raise ValueError(f"--normuon applies to --strategy owner or comm-free, whose owner holds each matrix's rows "
                         f"(got {'--baseline' if cfg.baseline else '--strategy ' + cfg.strategy})")
    if cfg.normuon and cfg.ns_blocks != "whole":
        raise ValueError(f"--ns-blocks {cfg.ns_blocks} applies to Muon's matrices: NorMuon normalizes the rows of the "
                         f"whole matrix")
    if cfg.normuon and cfg.batched_ns:
        raise ValueError("--batched-ns applies to Muon's matrices: NorMuon divides each row by its own RMS, which can "
                         "magnify the batched call's rounding beyond the bound derived for Muon's update")
    if cfg.overlap and cfg.strategy not in ("owner", "comm-free"):
        raise ValueError(f"--overlap applies to --strategy owner or comm-free (got {cfg.strategy})")
    if cfg.batched_ns and cfg.strategy not in ("owner", "comm-free"):
        raise ValueError(f"--batched-ns applies to --strategy owner or comm-free (got {cfg.strategy})")
    check_step_numbers(flag, group_hyperparameters(cfg).values(),
                       [s.global_shape for s in specs if s.group == MUON_GROUP])
    check_launch(cfg.timeout_s, cfg.fail_rank, cfg.dp * cfg.tp)
    names = {s.name for s in specs}
    for name, rank, step in cfg.missing_grads:
        if name not in names or not -1 <= rank < cfg.dp or not 1 <= step <= cfg.steps:
            raise ValueError(f"missing gradient ({name}, DP rank {rank}, step {step}) names no parameter, "
                             f"DP rank or step of this run")
    check_tp_divides(specs, cfg.tp)
    for layout in demo_row_layouts(specs, cfg).values():  # the optimizer's own refusal, made before anything starts
        layout.tp_piece(cfg.tp)


def run(cfg, explain=False, print_fn=print):
    """Plan, start the ranks on this machine (the lesson's run_rank on each), report; returns the results dict."""
    if (cfg.backend, cfg.device) != ("gloo", "cpu"):
        raise ValueError(f"this launcher starts Gloo ranks on the CPU (got backend {cfg.backend}, device "
                         f"{cfg.device}): GPUs need torchrun, with distributed_muon.py")
    validate(cfg, demo_specs(cfg))
    start_method()  # the ranks' forkserver (a command's first lines started it already) imports torch meanwhile
    plan = plan_optimizer(cfg)
    print_header(cfg, plan, "CPU", "Gloo", explain, print_fn)
    t0 = time.perf_counter()
    out = spawn_ranks(cfg, program=rank_program(cfg))[0]  # rank 0's: every rank's results, and the check
    seconds = time.perf_counter() - t0
    return report(cfg, plan, out["ranks"], bound(cfg, out["checks"]), seconds - out["reference_s"],
                  out["reference_s"], print_fn=print_fn)


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

    def _get_values(self, action, arg_strings):
        # argparse converts what the command line gave here (a default never comes through): an empty value,
        # what an unset shell variable gives (--json $OUT), would be taken for "none" or for a path
        if action.option_strings and "" in arg_strings:
            self.error(f"argument {'/'.join(action.option_strings)}: an empty value")
        return super()._get_values(action, arg_strings)


def build_parser(description, launcher="spawn", one_run=True):
    """The command line. launcher "torchrun" (distributed_muon.py) takes DP from the world size by default.
    one_run=False: the command runs every strategy and the baseline itself (benchmarks/compare.py), and offers
    no --strategy and no --baseline."""
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
    if one_run:
        p.add_argument("--strategy", default=d.strategy, choices=STRATEGIES,
                       help="gather (default): every rank that touches a matrix orthogonalizes it; owner: one rank "
                            "per matrix, all-to-all exchanges; comm-free: matrices sharded whole across DP")
        p.add_argument("--baseline", action="store_true",
                       help="run the AdamW ZeRO-1 baseline instead: every parameter takes AdamW, no Muon")
        p.add_argument("--normuon", action="store_true",
                       help="the matrices take NorMuon (arXiv 2510.05491: each row of Muon's update normalized by its "
                            "own second moment), checked against a single-device reference; owner or comm-free")
    p.add_argument("--model", default=d.model, choices=MODELS,
                   help="transformer (default): section 6's model; lopsided: one huge matrix among small ones; "
                        "thin: matrices with a small side (600x6, 64x1, 97x5, ...)")
    p.add_argument("--layers", type=int, default=d.layers, help="layers of --model transformer (default %(default)s)")
    p.add_argument("--d-model", type=int, default=d.d_model,
                   help=f"width of --model transformer, a multiple of its {N_HEADS} heads (default %(default)s)")
    p.add_argument("--overlap", type=int, nargs="?", const=OVERLAP_DEFAULT, default=d.overlap, metavar="K",
                   help="owner, comm-free: pipeline the step bucket by bucket, Newton-Schulz K units behind "
                        f"the gradient reductions (section 7; K = {OVERLAP_DEFAULT} if omitted; default off)")
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
    if launcher == "torchrun":
        p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl", help="(default %(default)s)")
        p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="(default %(default)s)")
    return p


def config_from_args(a):
    """The RunConfig the parsed arguments describe (every field is a flag of the same name)."""
    return RunConfig(**{f.name: getattr(a, f.name) for f in fields(RunConfig) if hasattr(a, f.name)})


def write_json(path, results):
    """`results` as JSON into `path` (if given), atomically (write_atomically)."""
    if path:
        write_atomically(path, lambda f: f.write(json.dumps(results, indent=1).encode()))


def leave(code, line=""):
    """End this process now, without Python's interpreter shutdown: `line` on stderr, what is buffered flushed
    (an interrupted command, below, and a torchrun process, run_under_torchrun, each say why)."""
    if line:
        print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def not_under_torchrun(torchrun_command=None):
    """What a command meant for python says under torchrun (exit_code): one line; torchrun_command, the
    command to run under torchrun instead, if there is one."""
    script = os.path.basename(sys.argv[0])
    instead = f"; under torchrun, run {torchrun_command}" if torchrun_command else ""
    return (f"{script} runs with python, not under torchrun (RANK, WORLD_SIZE and LOCAL_RANK are set): torchrun "
            f"would run a copy of the whole command in each of its processes; run python {script}{instead}")


# How a command ends when the reader of its stdout has gone (`| head -1`): as a shell reports a command that
# SIGPIPE ended (128 + 13), quietly; under `set -o pipefail` the pipeline then says the command did not finish
CLOSED_STDOUT = 128 + signal.SIGPIPE


def stdout_closed():
    """Whether stdout is a pipe whose reading end is closed (poll reports POLLERR on the writing end)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLERR)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):  # no stdout, or one without a file descriptor (a test's capture)
        return False


def closed_stdout(command):
    """How exit_code ends once stdout's reader has gone: what is still buffered goes nowhere (not into a
    traceback at Python's exit), a command's forkserver is stopped, and the code is CLOSED_STDOUT."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if command:
        stop_forkserver()
    return CLOSED_STDOUT


def exit_code(work, show_traceback=False, torchrun_command=None):
    """Run work() the way a command should end: its return code, or one line on stderr and
    2 (a bad flag, path or config), 1 (a rank failed, an output could not be written), 130 (Ctrl-C) or 143
    (SIGTERM); or, quietly, CLOSED_STDOUT (141) when the reader of its stdout has gone.

    A command blocks SIGINT in its first lines, before it imports torch (seconds): a Ctrl-C
    then waits, and is delivered here, where it ends the command as any Ctrl-C does, not as
    a traceback out of torch's import. On the way out the mask is put back as it was: a
    command's Ctrl-C after work() waits for its end, and is dropped.

    exit_code is how a command meant for python ends (one that runs under torchrun, a rank per process, ends
    through run_under_torchrun instead): started under torchrun, it says so (rank 0 alone, as OneLineParser
    does) and exits 2 before work(): no copy of it starts ranks or writes anything, and a forkserver's start
    was skipped (muon_forkserver.start_command). torchrun_command: the command for torchrun, if there is one.
    """
    command = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ())  # blocked by a command's first lines
    if command and under_torchrun():
        if os.environ["RANK"] == "0":
            print(f"error: {not_under_torchrun(torchrun_command)}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, raise_interrupted)  # SIGTERM cleans up as Ctrl-C does
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # inside the try: one may be waiting
        code = work()
        sys.stdout.flush()  # here, where a closed stdout is caught, not in Python's teardown
        return code
    except RankFailure as e:
        if stdout_closed():  # the rank printing the run's lines found stdout's reader gone
            return closed_stdout(command)
        print(f"error: {e}", file=sys.stderr)
        if show_traceback:
            print(e.traceback, file=sys.stderr, end="")
        return 1
    except BrokenPipeError:
        if not stdout_closed():  # another pipe than stdout: a failure like any other
            raise
        return closed_stdout(command)
    except WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        if command:  # a forkserver started for ranks that will not come (by the command's first lines, or run())
            stop_forkserver()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as e:
        # 130 = 128 + SIGINT, 143 = 128 + SIGTERM, as shells and torchrun report them
        code, line = (130, "error: interrupted (SIGINT)") if isinstance(e, KeyboardInterrupt) else \
            (143, "error: terminated (SIGTERM)")
        line += "; every rank stopped, temporary files removed"
        if command:  # its ranks stopped and its folders removed, it ends now, and so does its forkserver
            stop_forkserver()  # (which may still import torch: 15 s here) rather than after Python's teardown
            leave(code, line)
        print(line, file=sys.stderr)  # an importer's process (a test's) just gets the code
        return code
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
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

    return exit_code(work, args.traceback, torchrun_command="distributed_muon.py, the lesson's twin for torchrun")


# Under torchrun: each process is a rank already, started and told who it is by torchrun. What our launcher
# does for a run (check the flags before any rank starts, report once) is done in every process, by rank 0
# where once is enough: distributed_muon.py's command, and examples/train_gpt.py's and dtensor_demo.py's
# under torchrun.
def environment():
    """RANK, WORLD_SIZE, LOCAL_RANK from torchrun, or a ValueError saying how to launch."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v not in os.environ]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set: launch with torchrun --standalone "
                         f"--nproc-per-node N {os.path.basename(sys.argv[0])}")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def check_devices(backend, device_kind, local_rank=0):
    """The backend and device flags, and a GPU for LOCAL_RANK local_rank (ValueError)."""
    if backend == "nccl" and device_kind != "cuda":
        raise ValueError("NCCL needs --device cuda; on CPUs use --backend gloo --device cpu")
    if device_kind == "cuda" and torch.cuda.device_count() <= local_rank:
        raise ValueError(f"no CUDA device for LOCAL_RANK {local_rank} here ({torch.cuda.device_count()} GPUs): "
                         f"use --backend gloo --device cpu")


def rank_device(device_kind, local_rank):
    """This process's device: its GPU, "cuda:LOCAL_RANK", or "cpu"."""
    return f"cuda:{local_rank}" if device_kind == "cuda" else "cpu"


def join_world(backend, device_kind, local_rank, timeout_s):
    """Bind this process to its GPU (cuda:LOCAL_RANK) or the CPU and join torchrun's world; returns the device."""
    device = rank_device(device_kind, local_rank)
    if device_kind == "cuda":
        torch.cuda.set_device(device)
    # device_id binds the NCCL communicator to this rank's GPU up front (else NCCL guesses it from the rank).
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device(device) if device_kind == "cuda" else None)
    return device


def run_under_torchrun(backend, device_kind, prepare, body, finish, show_traceback=False, program=None):
    """What every torchrun entry point of the project does (distributed_muon.py's, examples/train_gpt.py's and
    dtensor_demo.py's), around its own parts:

      prepare(world) -> cfg: every check that can be made before joining; a ValueError is the same
          on every rank, so rank 0 alone prints it (exit 2). cfg.timeout_s bounds every collective.
      body(cfg, rank, device) -> this rank's result, gathered at rank 0 (gather_object), run once this
          process has joined the world; or program(cfg) -> rank 0's result (None on the others), which
          joins, gathers and leaves by itself (the lesson's run_rank): give body=None then.
      finish(cfg, result, device, seconds) -> the exit code; rank 0 only, after every rank's part.

    Before joining, a refusal returns 2 (a rank without its GPU says so itself). Once joined, the
    process ends here, with os._exit (below): 0, or finish's code on rank 0. An error in a rank's
    part is printed by that rank, in one line naming it (exit 1); no teardown then: the peers may
    be waiting in a collective, and torchrun stops them.
    """
    # torchrun hands a Ctrl-C on to every rank (SIGINT; SIGKILL 30 s later). The command's first lines blocked
    # it while torch imported (exit_code's docstring): from here it ends the rank at once, rank 0 saying so.
    signal.signal(signal.SIGINT, lambda *_: leave(130, "error: interrupted (SIGINT)"
                                                       if os.environ.get("RANK", "0") == "0" else ""))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        rank, world, local_rank = environment()
        cfg = prepare(world)
        check_devices(backend, device_kind)  # the flags, and a GPU at all: the same on every rank
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        check_devices(backend, device_kind, local_rank)  # this rank's own GPU
    except ValueError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr)
        return 2
    device = rank_device(device_kind, local_rank) if program else join_world(backend, device_kind, local_rank,
                                                                              cfg.timeout_s)
    try:
        t0 = time.perf_counter()
        if program:
            result = program(cfg)
        else:
            mine, result = body(cfg, rank, device), [None] * world if rank == 0 else None
            dist.gather_object(mine, result, dst=0)
        seconds = time.perf_counter() - t0
    except Exception as e:
        print(f"error: rank {rank} failed: {one_line(e)}", file=sys.stderr, flush=True)
        if show_traceback:
            traceback.print_exc()
        code = 1
    else:
        try:
            code = finish(cfg, result, device, seconds) if rank == 0 else 0
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    # End the process without Python's interpreter shutdown, as multiprocessing ends a forked rank.
    # destroy_process_group does not stop every Gloo worker thread: DTensor's caches still hold the
    # mesh's process groups. A worker that has just finished this rank's last collective
    # (gather_object's gather, on every rank but 0, which leaves at once) may drop that work's
    # tensors only after the main thread began shutting the interpreter down; freeing them takes
    # the GIL, Python then ends the thread (pthread_exit), and unwinding through the work's
    # destructor calls std::terminate: "terminate called without an active exception", exit -6
    # (a core dump showed exactly this stack; pytorch/pytorch PR 179291 describes the same crash). Without
    # the shutdown, no thread can meet it.
    leave(code)


def main_under_torchrun(module, argv=None):
    """distributed_muon.py's command, in each process torchrun started: the flags (rank 0 says what is
    wrong, exit 2), the plan (rank 0 prints it), the run_rank of `module` (distributed_muon: the lesson's twin for
    GPUs, imported here by name, as its command starts before it defines run_rank), and the report (rank 0). DP is
    the world size / TP unless --dp says otherwise."""
    run_rank = importlib.import_module(module).run_rank
    args = build_parser("Distributed Muon on GPUs (NCCL, one process per GPU, launched with torchrun), "
                        "checked bit for bit against torch.optim.Muon / AdamW on the same device.",
                        launcher="torchrun").parse_args(argv)
    backend = {"gloo": "Gloo", "nccl": "NCCL"}[args.backend]

    def prepare(world):
        if args.dp is None:
            if world % args.tp:
                raise ValueError(f"TP {args.tp} does not divide the world size {world}")
            args.dp = world // args.tp
        cfg = config_from_args(args)
        check_topology(cfg.dp, cfg.tp, world)
        validate(cfg, demo_specs(cfg))
        if args.json:
            check_writable(args.json)
        return cfg

    def program(cfg):
        if os.environ["RANK"] == "0":  # the layout every rank builds, printed once
            print_header(cfg, plan_optimizer(cfg), "GPU" if cfg.device == "cuda" else "CPU", backend, args.explain,
                         print)
        return rank_program(cfg, run_rank)()

    def finish(cfg, out, device, seconds):
        gpu = torch.cuda.get_device_name(device) if cfg.device == "cuda" else None
        if gpu:
            print(f"device: {gpu}\n")
        results = report(cfg, plan_optimizer(cfg), out["ranks"], bound(cfg, out["checks"], device),
                         seconds - out["reference_s"], out["reference_s"], backend=cfg.backend)
        results["launcher"] = dict(backend=cfg.backend, device=cfg.device, gpu=gpu)
        write_json(args.json, results)
        return 0 if results["passed"] else 1

    return run_under_torchrun(args.backend, args.device, prepare, None, finish, args.traceback, program)


# The notebooks' helpers.
def notebook_requirements():
    """The notebooks' setup: install requirements.txt when this torch has no torch.optim.Muon (the
    reference, torch >= 2.9) or matplotlib is missing. A torch already imported stays loaded until
    the kernel restarts, so a new one asks for a restart."""
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


def show_source(*objects):
    """Print each function's, method's or class's source as its file has it, under the file's name and the
    lines: what a notebook runs next is the script's own code, not a copy."""
    for obj in objects:
        lines, first = inspect.getsourcelines(obj)
        print(f"# {os.path.basename(inspect.getsourcefile(obj))}, lines {first}-{first + len(lines) - 1}")
        print("".join(lines))


def on_thread_ranks(dp, tp, fn, timeout_s=TIMEOUT_S):
    """[fn(grid) for every rank of a DP x TP world, in rank order], each rank a thread of this process and
    each axis of its grid a real Gloo process group, made from one in-memory store (no torch.distributed
    world is joined): how a notebook runs a function of the lesson that every rank calls at once, the
    gather flow among them. The first error of any rank is raised."""
    store, results, errors = dist.HashStore(), [None] * (dp * tp), []

    def rank(r):
        try:
            plan = plan_grid(dp, tp, r)
            group = {a.name: dist.ProcessGroupGloo(dist.PrefixStore(f"{a.name} {a.ranks}", store), a.rank, a.size,
                                                   datetime.timedelta(seconds=timeout_s))
                     for a in (plan.dp, plan.tp, plan.world)}
            results[r] = fn(replace(plan, dp=replace(plan.dp, group=group["DP"]),
                                    tp=replace(plan.tp, group=group["TP"]),
                                    world=replace(plan.world, group=group["world"])))
        except Exception as e:  # noqa: BLE001  (raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank {r}") for r in range(dp * tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# =============================================================================
# 12. Training checks: a real training against one process
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
