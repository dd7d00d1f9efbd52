"""Section 11, the command line's checks, made before any rank starts: the launcher's options, torchrun's
environment and flags, the sizes, hyperparameters and step numbers of a run (validate)."""

from __future__ import annotations

import math
import os
import sys

import torch

from distmuon import checks
from distmuon.checks import NS_COEFFICIENT_CHOICES, TORCH_OPTIONS, check_grid, check_hyperparameters
from distmuon.large_runs import check_large_run_options
from distmuon.owners import OPTIMIZERS, check_owner_options, strategies_where, strategy_class
from distributed_muon_cpu import adjusted_lr
from muon_tools.settings import (MAX_WORLD, MODELS, MUON_GROUP, N_HEADS, RunConfig, check_tp_divides, demo_row_layouts,
                                 group_hyperparameters)


# The command line: its checks, made before any rank starts, then its parser and main().
# The shortest --timeout a run can live with: a rank's first heartbeat comes HEARTBEAT_S after it starts, and every
# rank must join the world (init_process_group, whose wait --timeout bounds too) before any step: 5 s covers
# MAX_WORLD's start with room for a loaded machine (the join times: notes/measured/from_code_comments.md).
MIN_TIMEOUT_S = 5.0
# The longest: torch.distributed counts a deadline in int64 nanoseconds of the steady clock (292 years), and larger
# timeouts fail at the join (what each did: notes/measured/from_code_comments.md).
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



def either(names):
    """'a', 'a or b', 'a, b or c': the strategies that take something, as a refusal names them."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def strategies_taking(option):
    """'owner or comm-free': the strategies whose own_options hold `option` (a keyword: overlap, batched_ns)."""
    return either(strategies_where(lambda s: option in s.own_options))


def check_large_run_flags(*, ns_coefficients, ns_blocks, tp_newton_schulz, qk_clip_tau, strategy):
    """--ns-coefficients, --ns-blocks, --tp-newton-schulz and --qk-clip, by the optimizers' own checks spelled
    as flags, and the one combination only a strategy refuses (at construction, after the ranks started):
    the Gram form with an owner strategy. examples/train_gpt.py's command line checks them here too."""
    check_large_run_options(lambda k: "--qk-clip" if k == "qk_clip_tau" else flag(k), ns_blocks=ns_blocks,
                            tp_newton_schulz=tp_newton_schulz, qk_clip_tau=qk_clip_tau)
    if ns_coefficients not in NS_COEFFICIENT_CHOICES:
        raise ValueError(f"--ns-coefficients must be one of {', '.join(NS_COEFFICIENT_CHOICES)} "
                         f"(got {ns_coefficients!r})")
    if tp_newton_schulz != "gather" and strategy_class(strategy).orthogonalizes_once:
        gathering = either(strategies_where(lambda s: not s.orthogonalizes_once))
        raise ValueError(f"--tp-newton-schulz {tp_newton_schulz} applies to --strategy {gathering}: strategy "
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
        if group["algorithm"] in checks.ORTHOGONALIZED:  # NorMuon's update keeps Muon's norm, and takes its lr so
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
    if cfg.strategy not in OPTIMIZERS:
        raise ValueError(f"--strategy must be one of {', '.join(OPTIMIZERS)} (got {cfg.strategy!r})")
    if cfg.baseline and cfg.strategy != RunConfig.strategy:
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
    if cfg.normuon and (not strategy_class(cfg.strategy).holds_rows or cfg.baseline):
        got = "--baseline" if cfg.baseline else "--strategy " + cfg.strategy
        raise ValueError(f"--normuon applies to --strategy {either(strategies_where(lambda s: s.holds_rows))}, whose "
                         f"owner holds each matrix's rows (got {got})")
    if cfg.normuon and cfg.ns_blocks != "whole":
        raise ValueError(f"--ns-blocks {cfg.ns_blocks} applies to Muon's matrices: NorMuon normalizes the rows of the "
                         f"whole matrix")
    if cfg.normuon and cfg.batched_ns:
        raise ValueError("--batched-ns applies to Muon's matrices: NorMuon divides each row by its own RMS, which can "
                         "magnify the batched call's rounding beyond the bound derived for Muon's update")
    for option in ("overlap", "batched_ns"):  # the strategies' own options the runner has flags for
        if getattr(cfg, option) and option not in strategy_class(cfg.strategy).own_options:
            raise ValueError(f"{flag(option)} applies to --strategy {strategies_taking(option)} (got {cfg.strategy})")
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
