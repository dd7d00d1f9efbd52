"""Section 9, first half: the run's settings (RunConfig), the models of --model, the optimizer of --strategy and
its options (build_optimizer, plan_optimizer), the demo's row layouts and QK-clip maxima."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

import distributed_muon_cpu
from distmuon.large_runs import LargeRuns, RowLayout
from distmuon.owners import OPTIMIZERS, strategy_class
from distributed_muon_cpu import D_MODEL, NS_STEPS, N_LAYERS, ParamSpec, initial_params, plan_grid, transformer_specs


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
    strategy: str = "gather"  # one of distmuon.owners.OPTIMIZERS
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
    muon = dict(algorithm="normuon" if cfg.normuon else "muon", lr=cfg.lr, weight_decay=cfg.weight_decay,
                momentum=cfg.momentum,
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
    options = {k: getattr(cfg, k) for k in strategy_class(cfg.strategy).own_options}  # --overlap, --batched-ns
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
    return build_optimizer(specs, cfg, grid, {s.name: distributed_muon_cpu.rank_piece(start[s.name], s, grid, "cpu") for s in specs})
