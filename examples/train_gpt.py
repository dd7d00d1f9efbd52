"""Train a small GPT on real text with distributed Muon under DP x TP, and check it against one process.

Launch recipes
--------------
    python examples/train_gpt.py                          # 8 Gloo ranks, DP=4 x TP=2, about a minute on 2 cores
    python examples/train_gpt.py --dp 2 --tp 2 --strategy owner --steps 100
    python examples/train_gpt.py --optimizer adamw         # AdamW ZeRO-1 on every parameter: the yardstick
    python examples/train_gpt.py --schedule warmup-cosine --lr 0.02   # warm-up, then cosine decay to 0.1 x lr
    python examples/train_gpt.py --dp 2 --tp 2 --steps 4 --verify   # against torch.optim.Muon + AdamW in one process
    python examples/train_gpt.py --steps 8 --profile traces/   # Chrome traces per rank (open in ui.perfetto.dev)
    python examples/train_gpt.py --qk-clip 5                   # QK-clip: heads whose logits pass 5 shrink
    python examples/train_gpt.py --ns-blocks blocks --ns-coefficients polar_express   # Q, K, V apart; Polar Express
    python examples/train_gpt.py --strategy gather --tp-newton-schulz gram   # Newton-Schulz without the TP gather
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --dp 4 --tp 2   # GPUs, NCCL
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --dp 2 --tp 2 --backend gloo --device cpu

The model is examples/gpt.py (Megatron-style TP), the text examples/stdlib_text.py (the
standard library's sources, bytes as tokens), the optimizer distributed_muon_cpu.py's
(DistributedMuon and its strategies, imported, not copied). The lesson's launcher runs the
ranks (mt.spawn_ranks): Ctrl-C, SIGTERM, a failing or silent rank end the run as there.

What a step does on each rank (DP rank d, TP rank t):
    batch     rows [d * B / DP, (d + 1) * B / DP) of the step's global batch of B windows
    forward   the TP model; f and g all-reduce activations over the TP group
    backward  of loss / DP, so that the optimizer's ReduceOp.SUM over DP gives the
              gradient of the mean loss over the whole batch
    step      the optimizer: ZeRO-1 gradient reduce-scatter over DP, Muon (or AdamW),
              parameter all-gather
Muon takes the hidden matrices (with adjust_lr_fn "match_rms_adamw", so one learning rate
serves Muon and AdamW, as in Moonlight, arXiv:2502.16982); AdamW takes the embeddings, norms
and biases. The learning rate is the same for every optimizer and constant by default;
--schedule warmup-cosine warms it up linearly over --warmup-steps, then decays it along a
cosine to MIN_LR_FRACTION of --lr at the last step (nanoGPT's schedule, karpathy/nanoGPT train.py).

What large runs add (the lesson's section 8), each off by default:
    --qk-clip TAU        QK-clip (Kimi K2, arXiv 2507.20534): every attention layer reports its heads'
                         largest logit of the step's forward (gpt.py, max_logits); after the step the
                         optimizer scales head h's rows of W_q and W_k by sqrt(min(1, TAU / S_h)), S_h
                         the largest over every rank (clip_qk_). The fused QKV's layout, head by head,
                         is gpt.qkv_row_layouts.
    --ns-blocks          whole (torch's), blocks (Q, K and V of the fused QKV orthogonalized apart) or
                         heads (each head's q, k and v apart).
    --ns-coefficients    jordan (torch's one quintic) or polar_express (one per iteration, arXiv 2505.16932).
    --tp-newton-schulz   gather (the TP gather) or gram (--strategy gather: a matrix TP splits along its
                         long side is orthogonalized where it lies, X X^T all-reduced once per iteration;
                         not torch's bits: --verify holds its replay to the lesson's gram_tolerance).
"""

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields, replace

# The profiler's C++ logger (kineto) prints lines at every start and stop of every rank, and an
# error when it finds no GPU; 6 is above its highest level (USDT = 5). It reads this when a profiler
# first starts: set here, before the ranks' forkserver starts, and by every process that imports this file.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import record_function  # noqa: E402

import distributed_muon_cpu as dm  # noqa: E402
import distmuon.checks as mc  # noqa: E402
import distmuon.large_runs as mlr  # noqa: E402
import distmuon.owners as mo  # noqa: E402
import muon_tools as mt  # noqa: E402
from muon_tools import bound_ratio, loss_drift, one_ulp_up  # noqa: E402
from examples.gpt import (GPT, GPTConfig, check_gpt, hidden_matrix_shapes, param_groups,  # noqa: E402
                          qkv_row_layouts)
from examples.stdlib_text import load_corpus  # noqa: E402

# =============================================================================
# 1. The run's configuration and its checks
# =============================================================================
OPTIMIZER_NAMES = ("muon", "normuon", "adamw")
SCHEDULES = ("constant", "warmup-cosine")
MIN_LR_FRACTION = 0.1  # where warmup-cosine ends, as a fraction of --lr (nanoGPT's min_lr = learning_rate / 10)
PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE = 2, 1, 3  # steps skipped, warmed up, then traced
TIMED_FROM_STEP = 3  # medians leave out the first steps (allocations, first-touch, Gloo's set-up)


@dataclass(frozen=True)
class TrainConfig:
    dp: int = 4
    tp: int = 2
    optimizer: str = "muon"  # "normuon": NorMuon on the matrices; "adamw": AdamW ZeRO-1 on every parameter (the baseline)
    strategy: str = "owner"  # one of mo.STRATEGIES (Muon only); owner: each matrix orthogonalized once
    steps: int = 120
    lr: float = 0.01
    schedule: str = "constant"  # or "warmup-cosine" (see lr_at)
    warmup_steps: int = 10  # warmup-cosine only: steps of the linear warm-up
    weight_decay: float = 0.1  # matrices and embeddings; none on norms and biases
    momentum: float = 0.95
    batch: int = 16  # windows per step, over all DP ranks
    context: int = 128
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    seed: int = 0  # of the initial weights and of the batches
    bucket_size: int = 1 << 16
    log_every: int = 20
    val_windows: int = 32
    timeout_s: float = mt.TIMEOUT_S
    profile: str = ""  # a folder for Chrome traces, one per rank ("" = no profiling)
    keep: bool = False  # return every rank's gradients and weights of every step (for verification)
    progress: bool = True  # rank 0 prints a progress line every log_every steps
    fail_rank: int = -1  # for tests: this rank raises at step 1
    qk_clip: float = None  # tau of QK-clip (None: off)
    ns_blocks: str = "whole"  # one of mlr.NS_BLOCKS: what Newton-Schulz sees of the fused QKV
    ns_coefficients: str = "jordan"  # one of mc.NS_COEFFICIENT_CHOICES
    tp_newton_schulz: str = "gather"  # one of mlr.TP_NEWTON_SCHULZ: gram orthogonalizes TP pieces where they lie

    def gpt(self):
        return GPTConfig(context=self.context, d_model=self.d_model, n_layers=self.layers,
                         n_heads=self.heads, seed=self.seed)


def validate(cfg, ranks_here=None):
    """Every check that can be made before any rank starts; ValueError with one line. ranks_here: how many
    of the ranks share this machine's memory (default all of them, as when spawned; 0: do not check)."""
    mt.check_topology(cfg.dp, cfg.tp)
    mt.check_seed(cfg.seed)
    for name in ("steps", "batch", "context", "d_model", "layers", "heads", "log_every", "val_windows"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.optimizer not in OPTIMIZER_NAMES:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZER_NAMES)} (got {cfg.optimizer!r})")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)} (got {cfg.schedule!r})")
    if cfg.schedule == "warmup-cosine" and not 0 <= cfg.warmup_steps < cfg.steps:
        raise ValueError(f"--warmup-steps must be >= 0 and below --steps {cfg.steps} (got {cfg.warmup_steps})")
    if cfg.schedule != "warmup-cosine" and cfg.warmup_steps != TrainConfig.warmup_steps:
        raise ValueError(f"--warmup-steps {cfg.warmup_steps} applies to --schedule warmup-cosine (got --schedule "
                         f"{cfg.schedule})")
    if cfg.strategy not in mo.STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(mo.STRATEGIES)} (got {cfg.strategy!r})")
    if cfg.optimizer == "normuon" and cfg.strategy not in ("owner", "comm-free"):
        raise ValueError(f"--optimizer normuon takes --strategy owner or comm-free, whose owner holds each matrix's "
                         f"rows (got --strategy {cfg.strategy})")
    check_large_run_options(cfg)
    mc.check_hyperparameters(mt.flag, bucket_size=cfg.bucket_size, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             momentum=cfg.momentum, adjust_lr_fn="match_rms_adamw")
    if cfg.lr == 0:
        raise ValueError("--lr must be > 0")
    mt.check_step_numbers(mt.flag, hyperparameters(cfg), hidden_matrix_shapes(cfg.gpt()))
    for name, n in (("batch", cfg.batch), ("val-windows", cfg.val_windows)):
        if n % cfg.dp:
            raise ValueError(f"DP {cfg.dp} does not divide --{name} {n}: every DP rank takes the same share")
    if cfg.profile and cfg.steps < PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE:
        raise ValueError(f"--profile traces steps {PROFILE_WAIT + PROFILE_WARMUP + 1} to "
                         f"{PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE}: --steps must be >= "
                         f"{PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE} (got {cfg.steps})")
    if cfg.profile:
        mt.check_writable(cfg.profile, "--profile", folder=True)  # the ranks make it (start_profiler)
    mt.check_launch(cfg.timeout_s, cfg.fail_rank, cfg.dp * cfg.tp)
    check_gpt(cfg.gpt(), cfg.tp)
    corpus = load_corpus()  # read here once, so that a missing standard library fails before any rank
    needed = cfg.val_windows * (cfg.context + 1)  # validation windows must not overlap: distinct text
    if needed > corpus.val.numel():
        raise ValueError(f"--val-windows {cfg.val_windows} x (--context {cfg.context} + 1) = {needed:,} bytes, more "
                         f"than the {corpus.val.numel():,}-byte validation text: its windows would overlap")
    check_memory(cfg, cfg.dp * cfg.tp if ranks_here is None else ranks_here)


def check_large_run_options(cfg):
    """--qk-clip, --ns-blocks, --ns-coefficients and --tp-newton-schulz: their values (the lesson's checks),
    that they are Muon's (NorMuon takes all but --ns-blocks: it normalizes the whole matrix's rows), and that gram
    goes with the gather strategy."""
    mt.check_large_run_flags(ns_coefficients=cfg.ns_coefficients, ns_blocks=cfg.ns_blocks,
                             tp_newton_schulz=cfg.tp_newton_schulz, qk_clip_tau=cfg.qk_clip, strategy=cfg.strategy)
    if cfg.optimizer == "normuon" and cfg.ns_blocks != "whole":
        raise ValueError(f"--optimizer normuon takes no --ns-blocks: NorMuon normalizes the rows of the whole matrix")
    if cfg.optimizer == "adamw":
        given = [flag for flag, on in (("--momentum", cfg.momentum != TrainConfig.momentum),
                                       ("--qk-clip", cfg.qk_clip is not None),
                                       ("--ns-blocks", cfg.ns_blocks != "whole"),
                                       ("--ns-coefficients", cfg.ns_coefficients != "jordan"),
                                       ("--tp-newton-schulz", cfg.tp_newton_schulz != "gather")) if on]
        if given:
            raise ValueError(f"--optimizer {cfg.optimizer} takes no {', '.join(given)}: momentum, QK-clip and "
                             f"Newton-Schulz options are Muon's")


def memory_lower_bound(cfg):
    """Bytes one rank certainly holds at once (fp32, 4 bytes a number); what it leaves out only adds:
      weights and gradients: gpt.py's P = vocab d + context d + layers (12 d^2 + 13 d) + 2 d parameters
          (qkv 3d^2, attention proj d^2, fc and proj 4d^2 each, their biases and two norms per layer);
          each rank keeps at least P / (DP x TP) of them, and as many gradients (here every rank keeps
          its TP part of all of them, FSDP2 in train_gpt_dtensor.py a DP shard of that; optimizer
          states and buckets come on top);
      activations the backward keeps, for the rank's batch / DP windows of context tokens: per layer and
          token the inputs of its four linear layers, d (qkv) + d / TP (attention proj) + d (fc) +
          4 d / TP (mlp proj), and per token the logits and their softmax, 2 x vocab.
    At the defaults (16 x 128 tokens, d 64, 4 layers, 4 x 2 ranks) that is 3.5 MiB a rank; the
    measured peak is far above it (each rank's torch, Gloo and the text)."""
    g, tp = cfg.gpt(), cfg.tp
    d = g.d_model
    params = g.vocab * d + g.context * d + g.n_layers * (12 * d * d + 13 * d) + 2 * d
    tokens = cfg.batch // cfg.dp * cfg.context
    per_token = g.n_layers * (2 * d + 5 * d // tp) + 2 * g.vocab
    return 4 * (2 * params // (cfg.dp * tp) + tokens * per_token)


def check_memory(cfg, ranks_here, budget=None):
    """Refuse, before any rank starts, sizes whose ranks_here ranks could not fit in `budget` bytes
    (default this machine's memory), by memory_lower_bound: a refused run could never have run here."""
    budget = mt.host_memory() if budget is None else budget
    need = ranks_here * memory_lower_bound(cfg)
    if need > budget:
        raise ValueError(f"--batch {cfg.batch} x --context {cfg.context} with --d-model {cfg.d_model} and --layers "
                         f"{cfg.layers} needs at least {mt.human_bytes(need)} on {ranks_here} ranks here, more than "
                         f"this machine's {mt.human_bytes(budget)} of memory")


def hyperparameters(cfg):
    """The three groups' hyperparameters: Muon (or AdamW) for matrices, AdamW for embeddings,
    AdamW without weight decay for norms and biases."""
    adamw = dict(algorithm="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), eps=1e-8)
    muon = dict(algorithm="normuon" if cfg.optimizer == "normuon" else "muon", lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=True,
                ns_steps=dm.NS_STEPS, adjust_lr_fn="match_rms_adamw")
    if cfg.ns_coefficients != "jordan":  # the group keeps the name; torch's default stays unnamed
        muon["ns_coefficients"] = cfg.ns_coefficients
    return (adamw if cfg.optimizer == "adamw" else muon), adamw, dict(adamw, weight_decay=0.0)


def lr_at(cfg, step):
    """The learning rate of step 1, 2, ..., cfg.steps: cfg.lr, or warmup-cosine's share of it."""
    if cfg.schedule == "constant":
        return cfg.lr
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decayed = 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps)))
    return cfg.lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * decayed)


def set_lr(optimizers, cfg, step):
    """Every group of every optimizer takes step's learning rate (one rate for all, as in hyperparameters)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)


def large_runs(cfg):
    """What --tp-newton-schulz, --ns-blocks and --qk-clip add, as the lesson's optimizers take it
    (distmuon.large_runs.LargeRuns); None at their defaults: torch's behaviour."""
    options = {}
    if cfg.tp_newton_schulz != "gather":
        options["tp_newton_schulz"] = cfg.tp_newton_schulz
    if cfg.ns_blocks != "whole":
        options["ns_blocks"] = cfg.ns_blocks
    if cfg.qk_clip is not None:
        options["qk_clip_tau"] = cfg.qk_clip
    return mlr.LargeRuns(row_layouts=qkv_row_layouts(cfg.gpt()), **options) if options else None


def build_optimizer(model, cfg, grid):
    # AdamW ZeRO-1 is the gather class with no Muon group: the lesson's baseline
    return mo.OPTIMIZERS["gather" if cfg.optimizer == "adamw" else cfg.strategy](
        param_groups(model, *hyperparameters(cfg)), grid=grid, tp_split_dims=model.tp_split_dims(),
        bucket_size=cfg.bucket_size, large_runs=large_runs(cfg))


def run_kind(cfg):
    return mt.BASELINE if cfg.optimizer == "adamw" else cfg.strategy


# =============================================================================
# 2. One rank's training
# =============================================================================

def train_rank(rank, cfg, device):
    """What every rank runs once the world is joined; returns its losses, timings, bytes (and with
    cfg.keep its gradients of every step and its final weights)."""
    torch.set_num_threads(1)  # as in the lesson: the reference pins the same count
    grid = dm.make_grid(cfg.dp, cfg.tp, rank)
    corpus = load_corpus()
    model = GPT(cfg.gpt(), grid.tp, dm.Ledger()).to(device)
    opt = build_optimizer(model, cfg, grid)
    model.record_max_logits(cfg.qk_clip is not None)
    profiler = start_profiler(cfg, rank)
    losses, val, ms = [], [], {"forward": [], "backward": [], "optimizer": [], "step": []}
    grads, weights = [], []  # with cfg.keep: each step's gradients and the weights they were taken at
    max_logits, clipped = [], []  # with --qk-clip: this rank's max logits of each step, the multipliers applied
    last_log = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        if rank == cfg.fail_rank:
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (--fail-rank)")
        x, y = (t.to(device) for t in corpus.batch(step, cfg.batch, cfg.context, cfg.seed, grid.dp.rank, cfg.dp))
        model.ledger.step = step
        t0 = clock(device)
        with record_function("forward"):
            loss = model(x, y)
        t1 = clock(device)
        with record_function("backward"):
            (loss / cfg.dp).backward()
        t2 = clock(device)
        if cfg.keep:  # --verify's copies: no part of a training step, and not timed
            grads.append(snapshot(model, grads=True))
            weights.append(snapshot(model))
        t3 = clock(device)
        with record_function("optimizer step"):
            set_lr([opt], cfg, step)
            opt.step()
            if cfg.qk_clip is not None:  # every rank, after the step: a collective
                max_logits.append(model.max_logits())
                clipped.append(opt.clip_qk_(max_logits[-1]))
        t4 = clock(device)
        opt.zero_grad(set_to_none=True)
        parts = dict(forward=t1 - t0, backward=t2 - t1, optimizer=t4 - t3)  # the step is their sum, exactly
        for key, seconds in dict(parts, step=sum(parts.values())).items():
            ms[key].append(seconds * 1e3)
        losses.append(loss.item())
        if profiler is not None:
            profiler.step()
        if step % cfg.log_every == 0 or step == cfg.steps:
            train_loss = dp_mean(losses[-1], grid, device)
            val.append((step, validation_loss(model, corpus, cfg, grid, device)))
            now = time.perf_counter()
            steps_done = step - (val[-2][0] if len(val) > 1 else 0)
            if rank == 0 and cfg.progress:
                print(progress_line(cfg, step, train_loss, val[-1][1], now - last_log, steps_done), flush=True)
            last_log = now
    if profiler is not None:
        profiler.stop()
    result = dict(rank=rank, losses=losses, val=val, ms=ms, ledger=asdict(opt.ledger),
                  model_ledger=asdict(model.ledger), state_bytes=opt.state_bytes(), owners=opt.owners,
                  max_logits=[{n: t.cpu() for n, t in m.items()} for m in max_logits], clipped=clipped)
    if cfg.keep:
        result.update(grads=grads, weights=weights, params=snapshot(model))
    return result


def snapshot(model, grads=False):
    """{name: a CPU copy of the parameter (or of its gradient)}: what verification reads back."""
    return {n: (p.grad if grads else p).detach().cpu().clone() for n, p in model.named_parameters()}


def train_each(rank, trainings, device):
    """Several trainings on one set of ranks (tests and benchmarks share a spawn): trainings.configs,
    one after the other, each on a fresh model and optimizer."""
    return [train_rank(rank, cfg, device) for cfg in trainings.configs]


@dataclass(frozen=True)
class Trainings:
    """What mt.spawn_ranks needs (dp, tp, timeout_s), for several TrainConfigs on the same grid."""
    configs: tuple
    dp: int
    tp: int
    timeout_s: float = mt.TIMEOUT_S


def train_many(configs):
    """Run TrainConfigs of one grid on one spawn of ranks: [(config, every rank's result)] in order."""
    dp, tp = configs[0].dp, configs[0].tp
    if any((c.dp, c.tp) != (dp, tp) for c in configs):
        raise ValueError("train_many runs configurations of one grid")
    for cfg in configs:
        validate(cfg)
    per_rank = mt.spawn_ranks(Trainings(tuple(configs), dp, tp, max(c.timeout_s for c in configs)), train_each)
    return [(cfg, [r[i] for r in per_rank]) for i, cfg in enumerate(configs)]


def clock(device):
    if device != "cpu":
        torch.cuda.synchronize()  # kernels run asynchronously: wait before reading the clock
    return time.perf_counter()


def dp_mean(value, grid, device):
    """Mean of a number over the DP ranks (for printing; not counted: it is no part of a step)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if grid.dp.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=grid.dp.group)
    return t.item() / grid.dp.size


@torch.no_grad()
def validation_loss(model, corpus, cfg, grid, device):
    """Mean loss over cfg.val_windows fixed windows, shared out over the DP ranks."""
    x, y = (t.to(device) for t in corpus.validation(cfg.val_windows, cfg.context, grid.dp.rank, cfg.dp))
    with model.uncounted():
        local = model(x, y).item()
    return dp_mean(local, grid, device)


def progress_line(cfg, step, train_loss, val_loss, seconds, steps_done):
    tokens = cfg.batch * cfg.context * steps_done
    return (f"step {step:>{len(str(cfg.steps))}}/{cfg.steps}  train {train_loss:6.3f}  val {val_loss:6.3f}  "
            f"{tokens / seconds:>9,.0f} tokens/s  {seconds / steps_done * 1e3:6.0f} ms/step")


def start_profiler(cfg, rank):
    """torch.profiler over steps PROFILE_WAIT + PROFILE_WARMUP + 1 ..., written as <profile>/rank<R>.json."""
    if not cfg.profile:
        return None
    path = os.path.join(cfg.profile, f"rank{rank}.json")
    os.makedirs(cfg.profile, exist_ok=True)
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=PROFILE_WAIT, warmup=PROFILE_WARMUP, active=PROFILE_ACTIVE, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(path))
    profiler.start()
    return profiler


# =============================================================================
# 3. The same training in one process, and the comparison
# =============================================================================
# The reference is this GPT in one process (no grid: f and g are identities), trained
# by torch.optim.Muon + torch.optim.AdamW. Each step it runs the DP ranks'
# micro-batches one after the other and accumulates loss / DP's gradients, so it
# sees exactly the batch the ranks see. With TP > 1 it computes TP's pieces apart
# and adds them where f and g do, in rank order (gpt.py, as_tp).
# Three comparisons:
#
#   replay     torch's optimizers fed the ranks' own gradients (TP pieces
#              concatenated, summed over DP in DP-rank order) give the ranks'
#              weights: the optimizer is exact. Checked, bit for bit.
#   gradients  at every step, the one process's loss and gradient at the ranks'
#              own weights (before that step) against the ranks': the TP model
#              computes what the plain model computes. Checked.
#   trained    both runs free-running from the same start. Checked bit for bit
#              where every sum has the ranks' association; otherwise reported
#              beside the chaos floor, never a verdict (below).
#
# Tolerance policy: which bits can differ, and why
#   * Bit for bit whenever every fp32 sum has the ranks' association: TP = 1 (the
#     same matmuls on the same micro-batches) or TP's sums in rank order (below),
#     and the DP sum in DP-rank order. The lesson's Gloo reduce-scatter adds the DP
#     ranks' contributions in rank order (distributed_muon_cpu.py section 2,
#     reduce_scatter and sum_in_order), as the one process accumulates its
#     micro-batches, so on Gloo any DP is exact; NCCL's ReduceOp.SUM has its own
#     order, exact only for DP <= 2 (a + b = b + a). Then replay, gradients and the
#     trained weights and losses are all torch.equal.
#   * The replay is bit for bit on every grid where the DP sum runs in rank order,
#     TP > 1 included: the optimizer never sees TP's reordering, only the gradients.
#     (NCCL with DP > 2: its order changes the moments' last bits, which Muon turns
#     into at most a different bf16 rounding inside Newton-Schulz per step; held to
#     the lesson's BATCHED_NS_BOUND of the update's largest entry per step.)
#   * --tp-newton-schulz gram (TP > 1) sums each Gram matrix over the TP ranks inside Newton-Schulz, which
#     torch does in one bf16 matmul: the replay of every matrix it orthogonalizes is held to the lesson's
#     bound (gram_tolerance, from torch's own bf16 error on each step's Newton-Schulz input), the rest bit for bit.
#   * TP splits sums: g adds the row-parallel layers' partial products (attention-out,
#     MLP-out) over the TP ranks, f's backward the column-parallel layers' input
#     gradients, where one plain process does one long matmul. On Gloo both
#     all-reduces add every element's TP terms left to right in rank order on every
#     rank (gpt.py, tp_all_reduce: the lesson's reduce-scatter, then an all-gather),
#     and the one process computes TP's pieces apart, with the ranks' shapes, and adds
#     them in the same order (the lesson's sum_in_order; gpt.py's FanOut for x's gradient, which
#     autograd would add in its own order). So any TP is as exact as TP = 1:
#     gradients, losses, trained weights, all torch.equal (measured on 1x2 to 2x4,
#     every strategy, AdamW, lr 0.1: notes/09). NCCL's all-reduce adds in its own
#     order: TP = 2 keeps the ranks' bits there (two terms, a + b == b + a), TP > 2
#     does not.
#   * NCCL with TP > 2: each step's gradients and losses are held, against float64,
#     to the bound derived in muon_tools.py (section 12; bound_ratio): REALIZED_FACTOR
#     x the one process's own fp32 error on the step, plus one reordered reduction,
#     n u of the largest entry, n = batch x context tokens (a micro-batch's loss: its
#     own tokens).
#     A missing all-reduce or a wrong split moves a gradient by a fraction of itself
#     (1e-1, not 1e-4): the tests break one and see it fail, on TP = 2 and TP = 4.
#   * Free-running with --tp-newton-schulz gram or NCCL's TP > 2 or DP > 2 orders, each
#     step's few different roundings change the next step's weights and so its
#     gradient, and a training amplifies any difference chaotically: one ulp on one
#     weight of the one-process run, with no distributed code at all, moves its
#     losses by as much within a few steps at lr 0.1 (figures in notes/09). So the
#     drift of the losses is reported beside that chaos floor (the
#     same one-process run with entry 0 of CHAOS_PARAM moved by one ulp), as a ratio,
#     and never fails a run: the replay and the gradients are what catch a bug.
CHAOS_PARAM = "blocks.0.attn.qkv.weight"  # the chaos floor moves its entry 0 by one ulp

# What large runs add has a reference of its own here, from the papers' equations and torch's optimizers
# (never the lesson's code): --ns-blocks, torch.optim.Muon on each block as a separate parameter (its
# rows copied out before the step and back after); --ns-coefficients polar_express, torch.optim.Muon
# with its Newton-Schulz swapped for the same torch ops taking one (a, b, c) per iteration; --qk-clip,
# after torch's step, head h's q and k rows times sqrt(min(1, tau / S_h)), S_h the largest logit of the
# step's forward over every micro-batch (the replay: over every rank's). All three are exact: the same
# ops on the same numbers, so the replay and TP = 1 stay bit for bit.

def reference_blocks(cfg, model):
    """{qkv weight name: [(row indices, a leaf tensor of those rows)]}: the matrices torch.optim.Muon sees
    apart under --ns-blocks (Q, K, V: one segment of every head; heads: each head's q, k, v alone)."""
    if cfg.ns_blocks == "whole" or cfg.optimizer != "muon":
        return {}
    g = cfg.gpt()
    hd = g.d_model // g.n_heads
    segments = [(h, s) for h in range(g.n_heads) for s in range(3)]  # the rows, head by head (gpt.Attention)
    if cfg.ns_blocks == "heads":
        groups = [[(h, s)] for h, s in segments]
    else:
        groups = [[(h, s) for h in range(g.n_heads)] for s in range(3)]
    out = {}
    for name in qkv_row_layouts(g):
        w = model.get_parameter(name)
        out[name] = []
        for group in groups:
            rows = torch.tensor([(3 * h + s) * hd + i for h, s in group for i in range(hd)], device=w.device)
            out[name].append((rows, w.detach()[rows].clone()))
    return out


class ReferenceOptimizers:
    """torch.optim.Muon + AdamW for the one-process GPT, with the reference of each --ns-blocks,
    --ns-coefficients and --qk-clip (above)."""

    def __init__(self, model, cfg):
        self.model, self.cfg, self.blocks = model, cfg, reference_blocks(cfg, model)
        groups = []
        for g in param_groups(model, *hyperparameters(cfg)):
            params = [p for n, p in g["params"] if n not in self.blocks]
            if g["algorithm"] == "muon":
                params += [t for pieces in self.blocks.values() for _, t in pieces]
            groups.append(dict(g, params=params))
        self.optimizers = mt.torch_optimizers(groups)
        # one (a, b, c) per iteration swapped into torch's Newton-Schulz; Jordan's one triple leaves torch's in place
        self.coefficients = (mc.ns_coefficients_of(cfg.ns_coefficients, dm.NS_STEPS)
                             if cfg.optimizer != "adamw" and cfg.ns_coefficients != "jordan" else dm.NS_COEFFICIENTS)
        # {matrix stepped whole: its Newton-Schulz input at each step}: what bounds --tp-newton-schulz gram's replay
        self.names, self.ns_inputs = {id(p): n for n, p in model.named_parameters()}, {}

    def step(self, step, max_logits=None):
        """Step `step`; with --qk-clip, then clip by max_logits ({qkv weight name: (heads,) S})."""
        set_lr(self.optimizers, self.cfg, step)
        with torch.no_grad():
            for name, pieces in self.blocks.items():
                w = self.model.get_parameter(name)
                for rows, t in pieces:
                    t.copy_(w[rows])
                    t.grad = w.grad[rows]
            with mt.torch_newton_schulz_per_iteration(self.coefficients), \
                    mt.ns_inputs_recorded(self.optimizers, self.names, self.ns_inputs):
                for opt in self.optimizers:
                    opt.step()
            for name, pieces in self.blocks.items():
                w = self.model.get_parameter(name)
                for rows, t in pieces:
                    w[rows] = t
                    t.grad = None
            if self.cfg.qk_clip is not None:
                self.clip_qk_(max_logits)

    def clip_qk_(self, max_logits):
        """Kimi K2's per-head QK-clip: head h's rows of W_q and W_k each times sqrt(min(1, tau / S_h))."""
        g, tau = self.cfg.gpt(), self.cfg.qk_clip
        hd = g.d_model // g.n_heads
        for name, maxima in max_logits.items():
            w = self.model.get_parameter(name)
            for h, s in enumerate(maxima.tolist()):
                mt.clip_rows_(w, slice(3 * h * hd, (3 * h + 2) * hd), s, tau)  # its q rows, then k rows


def reference_model(cfg, device):
    torch.set_num_threads(1)  # as every rank: bf16 matmul bits can depend on the thread count
    model = GPT(cfg.gpt(), as_tp=cfg.tp).to(device)  # TP's pieces apart, added in rank order (policy above)
    model.record_max_logits(cfg.qk_clip is not None)
    return model, ReferenceOptimizers(model, cfg)


def accumulate_gradients(model, cfg, step, device, max_logits=None):
    """loss / DP's gradients of DP rank 0's micro-batch, then rank 1's, ...: [loss of each micro-batch].
    max_logits: a dict to fill with each head's largest logit over the micro-batches (--qk-clip)."""
    corpus, losses = load_corpus(), []
    for d in range(cfg.dp):
        x, y = (t.to(device) for t in corpus.batch(step, cfg.batch, cfg.context, cfg.seed, d, cfg.dp))
        loss = model(x, y)
        (loss / cfg.dp).backward()  # accumulates in .grad: g_0 + g_1 + ..., in DP-rank order
        losses.append(loss.item())
        if max_logits is not None:
            for n, t in model.max_logits().items():
                max_logits[n] = torch.maximum(max_logits[n], t) if n in max_logits else t
    return losses


def ranks_max_logits(results, step):
    """{qkv weight name: (heads,)} of step (0-based): the largest over every rank's reported maxima."""
    out = {}
    for r in results:
        for n, t in r["max_logits"][step].items():
            out[n] = torch.maximum(out[n], t) if n in out else t
    return out


def reference(cfg, device="cpu", replay=None, nudge=False, replay_max_logits=None):
    """Train in one process: {"losses": [[loss of DP rank d's micro-batch] per step], "params"}.

    replay: the total gradient of every step ([{name: tensor}]) to use instead of computing one, and
    with --qk-clip replay_max_logits, the ranks' maxima of every step ([{name: (heads,)}]).
    nudge: start with entry 0 of CHAOS_PARAM one ulp larger (the chaos floor)."""
    model, optimizers = reference_model(cfg, device)
    if nudge:
        one_ulp_up(model.get_parameter(CHAOS_PARAM))
    losses = []
    for step in range(1, cfg.steps + 1):
        max_logits = {} if cfg.qk_clip is not None else None
        if replay is None:
            losses.append(accumulate_gradients(model, cfg, step, device, max_logits))
        else:
            for n, p in model.named_parameters():
                p.grad = replay[step - 1][n].to(device)
            if cfg.qk_clip is not None:
                max_logits = replay_max_logits[step - 1]
        optimizers.step(step, max_logits)
        model.zero_grad(set_to_none=True)
    return dict(losses=losses, params=snapshot(model), ns_inputs=optimizers.ns_inputs)


def param_specs(cfg):
    """The GPT's parameters as the lesson's ParamSpecs (name, global shape, TP split dim, group)."""
    full = GPT(cfg.gpt())
    split = full.tp_split_dims()
    groups = param_groups(full, {}, {}, {})
    group_of = {n: g for g, group in zip(("muon", "adamw", "adamw_no_wd"), groups) for n, _ in group["params"]}
    return [dm.ParamSpec(n, tuple(p.shape), split.get(n, -1), group_of[n]) for n, p in full.named_parameters()]


def full_tensors(cfg, pieces_of_rank, specs):
    """{name: full tensor} from the TP pieces of DP rank 0's row (every DP rank holds the same weights)."""
    return {s.name: torch.cat([pieces_of_rank(t)[s.name] for t in range(cfg.tp)], dim=s.tp_split_dim)
            if s.tp_split_dim >= 0 else pieces_of_rank(0)[s.name] for s in specs}


def total_gradients(cfg, results, specs):
    """[{name: full gradient summed over DP in DP-rank order}] per step, from every rank's TP pieces.

    Also the largest difference between TP ranks' copies of a replicated gradient (f and g make
    them equal, bit for bit: every TP rank runs the same ops on the same all-reduced values)."""
    by_rank = {r["rank"]: r["grads"] for r in results}
    totals, replica_diff = [], 0.0
    for step in range(cfg.steps):
        total = {}
        for d in range(cfg.dp):
            row = full_tensors(cfg, lambda t: by_rank[d * cfg.tp + t][step], specs)
            for s in specs:
                total[s.name] = row[s.name].clone() if d == 0 else total[s.name] + row[s.name]
                if s.tp_split_dim < 0:
                    copies = [by_rank[d * cfg.tp + t][step][s.name] for t in range(cfg.tp)]
                    replica_diff = max([replica_diff] + [(c - copies[0]).abs().max().item() for c in copies[1:]])
        totals.append(total)
    return totals, replica_diff


def load_weights(model, weights):
    with torch.no_grad():
        for n, w in weights.items():
            model.get_parameter(n).copy_(w)


def step_gradients(cfg, results, specs, totals, device, against_float64):
    """At each step, the one process's loss and gradients at the ranks' own weights against theirs.

    Returns the largest relative differences (losses; gradients, of the tensor's largest entry)
    and, against_float64, each side's largest error against the float64 computation and the
    largest ratio of the ranks' error to its bound (the policy's 3.: <= 1 passes)."""
    model, _ = reference_model(cfg, device)
    exact64 = GPT(cfg.gpt()).to(device).double() if against_float64 else None
    by_rank = {r["rank"]: r for r in results}
    out = dict(step_loss_max_rel_diff=0.0, grad_max_rel_diff=0.0)
    if against_float64:
        out.update(ranks_grad_err=0.0, one_process_grad_err=0.0, ranks_loss_err=0.0, one_process_loss_err=0.0,
                   bound_ratio=0.0)
    tokens = cfg.batch * cfg.context  # summed into every gradient of a step; a micro-batch's loss has / DP

    def worse(key, value):
        out[key] = max(out[key], value)

    for step in range(cfg.steps):
        weights = full_tensors(cfg, lambda t: by_rank[t]["weights"][step], specs)
        load_weights(model, weights)
        losses = accumulate_gradients(model, cfg, step + 1, device)
        ranks_losses = [by_rank[d * cfg.tp]["losses"][step] for d in range(cfg.dp)]
        worse("step_loss_max_rel_diff", max(abs(r - l) / l for r, l in zip(ranks_losses, losses)))
        for n, p in model.named_parameters():
            ref = p.grad.cpu()
            worse("grad_max_rel_diff", ((totals[step][n] - ref).abs().max() / ref.abs().max()).item())
        if against_float64:
            load_weights(exact64, weights)
            for r, l, l64 in zip(ranks_losses, losses, accumulate_gradients(exact64, cfg, step + 1, device)):
                worse("ranks_loss_err", abs(r - l64) / l64)
                worse("one_process_loss_err", abs(l - l64) / l64)
                worse("bound_ratio", bound_ratio(abs(r - l64), abs(l - l64), tokens // cfg.dp, abs(l64)))
            for n, p in model.named_parameters():
                g64 = exact64.get_parameter(n).grad.cpu()
                scale = g64.abs().max().item()
                ranks_err = (totals[step][n].double() - g64).abs().max().item()
                one_err = (p.grad.cpu().double() - g64).abs().max().item()
                worse("ranks_grad_err", ranks_err / scale)
                worse("one_process_grad_err", one_err / scale)
                worse("bound_ratio", bound_ratio(ranks_err, one_err, tokens, scale))
            exact64.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return out


def by_gram(cfg, spec):
    """Whether --tp-newton-schulz gram orthogonalizes this parameter with newton_schulz_tp (TP > 1, a Muon
    matrix split along its long side, not taken apart by --ns-blocks)."""
    blocked = cfg.ns_blocks != "whole" and spec.name in qkv_row_layouts(cfg.gpt())
    return (cfg.tp_newton_schulz == "gram" and cfg.tp > 1 and cfg.optimizer == "muon" and spec.group == "muon"
            and not blocked and mlr.gram_eligible(spec.global_shape, spec.tp_split_dim))


def why_gradients_inexact(cfg, rank_order=True):
    """Why the ranks' step gradients cannot have the one process's bits ("" if they can). rank_order: the
    backend's sums add the ranks in rank order (Gloo: the lesson's reduce-scatter, gpt.tp_all_reduce)."""
    if cfg.tp > 2 and not rank_order:
        return f"TP = {cfg.tp} adds f's and g's {cfg.tp} partial sums in the backend's own order"
    return ""


def why_inexact(cfg, rank_order=True):
    """Why some fp32 sum of the run has another order than the one process's ("" if none: see
    the policy above). rank_order: the DP and TP sums add the ranks in rank order (Gloo, the lesson's)."""
    gradients = why_gradients_inexact(cfg, rank_order)
    reasons = [gradients] if gradients else []
    if cfg.dp > 2 and not rank_order:
        reasons.append(f"the backend sums over DP = {cfg.dp} in its own order")
    if any(by_gram(cfg, spec) for spec in param_specs(cfg)):
        reasons.append("--tp-newton-schulz gram sums Gram matrices over TP inside Newton-Schulz")
    return "; ".join(reasons)


def exact(cfg, rank_order=True):
    """Whether every fp32 sum happens in the same order as in one process (see the policy above)."""
    return not why_inexact(cfg, rank_order)


def replay_tolerance(cfg, spec, ns_inputs, rank_order=True):
    """What the replay may differ by (see the policy above): NCCL's DP sum over DP > 2, another order of it;
    --tp-newton-schulz gram, the Gram matrix summed over TP ranks (the lesson's gram_tolerance of the replay's
    Newton-Schulz inputs, ns_inputs: {name: [each step's]}; lr_at never exceeds cfg.lr)."""
    gram = (mt.gram_tolerance(ns_inputs[spec.name], cfg.lr, "match_rms_adamw", spec.global_shape, dm.NS_STEPS,
                              cfg.ns_coefficients) if by_gram(cfg, spec) else 0.0)
    if cfg.dp <= 2 or rank_order:
        return gram
    if spec.group == "muon" and cfg.optimizer == "muon":
        return gram + mt.batched_ns_tolerance(cfg.steps, cfg.lr, "match_rms_adamw", spec.global_shape)
    return cfg.steps * cfg.lr * mo.BATCHED_NS_BOUND


def verify(cfg, results, device="cpu", rank_order=True):
    """The distributed run (run with cfg.keep) against one process; returns a dict of checks.

    rank_order: whether the ranks' DP and TP sums added their terms in rank order (Gloo: yes)."""
    specs = param_specs(cfg)
    totals, replica_diff = total_gradients(cfg, results, specs)
    logits = [ranks_max_logits(results, s) for s in range(cfg.steps)] if cfg.qk_clip is not None else None
    replay = reference(cfg, device, replay=totals, replay_max_logits=logits)
    replayed = dm.check_against_torch(specs, results, replay["params"], cfg.tp)
    for c, spec in zip(replayed, specs):
        c["tolerance"] = replay_tolerance(cfg, spec, replay["ns_inputs"], rank_order)
        c["ok"] = c["identical"] or c["max_abs_diff"] <= c["tolerance"]
    inexact, gradients_inexact = why_inexact(cfg, rank_order), why_gradients_inexact(cfg, rank_order)
    checks = dict(exact=not inexact, gradients_exact=not gradients_inexact, why_inexact=inexact,
                  replay=replayed, replica_max_diff=replica_diff,
                  **step_gradients(cfg, results, specs, totals, device, against_float64=bool(gradients_inexact)))
    plain = reference(cfg, device)
    ranks_losses = [[results[d * cfg.tp]["losses"][s] for d in range(cfg.dp)] for s in range(cfg.steps)]
    checks.update(trained=dm.check_against_torch(specs, results, plain["params"], cfg.tp),
                  trained_loss_max_rel_diff=loss_drift(ranks_losses, plain["losses"]))
    if gradients_inexact:
        same_function = checks["bound_ratio"] <= 1
    else:
        same_function = checks["grad_max_rel_diff"] == checks["step_loss_max_rel_diff"] == 0
    if inexact:  # reported beside the chaos floor, never a verdict (the policy above)
        floor = loss_drift(reference(cfg, device, nudge=True)["losses"], plain["losses"])
        checks.update(chaos_floor_loss_max_rel_diff=floor,
                      chaos_ratio=checks["trained_loss_max_rel_diff"] / floor if floor else None)
        same_training = True
    else:
        same_training = checks["trained_loss_max_rel_diff"] == 0 and all(c["identical"] for c in checks["trained"])
    checks["passed"] = all(c["ok"] for c in replayed) and replica_diff == 0 and same_function and same_training
    return checks


def print_verification(cfg, checks, print_fn=print):
    n = len(checks["replay"])
    model = f"DP=1, TP's {cfg.tp} pieces computed apart" if cfg.tp > 1 else "TP=1, DP=1"
    in_order = {1: "every fp32 sum in its order",
                2: "every fp32 sum as the ranks associate it (TP = 2: the reference adds TP's two partial sums as "
                   "the ranks do, a + b = b + a)"}.get(
        cfg.tp, f"every fp32 sum as the ranks associate it (TP = {cfg.tp}: the reference adds TP's {cfg.tp} partial "
                "sums left to right in rank order, as the ranks' Gloo all-reduces do)")
    matrices = {"muon": "torch.optim.Muon + ", "normuon": "NorMuon's reference (muon_tools) + torch.optim."}
    print_fn(f"Against one process ({model}, {matrices.get(cfg.optimizer, '')}AdamW, the same micro-batches): "
             + (checks["why_inexact"] if checks["why_inexact"] else f"{in_order}, every comparison bit for bit"))
    same = sum(c["identical"] for c in checks["replay"])
    within = sum(c["ok"] and not c["identical"] for c in checks["replay"])
    print_fn(f"  replay:    torch's optimizers fed the ranks' summed gradients: {same}/{n} parameters identical"
             + (f", {within} within their derived bound (replay_tolerance: DP order, Gram sums)" if within else "")
             + (f", {n - same - within} beyond it" if n - same - within else ""))
    replicas = (f"; TP copies of replicated gradients differ by {checks['replica_max_diff']:.1e}" if cfg.tp > 1 else "")
    n_same = sum(c["identical"] for c in checks["trained"])
    if checks["gradients_exact"]:
        print_fn(f"  gradients: each step at the ranks' weights: losses within {checks['step_loss_max_rel_diff']:.1e} "
                 f"and gradients within {checks['grad_max_rel_diff']:.1e} relative{replicas}")
    else:
        print_fn(f"  gradients: each step at the ranks' weights, against float64: the ranks' within "
                 f"{checks['ranks_grad_err']:.1e} of the largest entry (losses {checks['ranks_loss_err']:.1e}), "
                 f"the one process's fp32 within {checks['one_process_grad_err']:.1e} ({checks['one_process_loss_err']:.1e}); "
                 f"{checks['bound_ratio']:.2f} of the bound at most (section 3){replicas}")
    if checks["exact"]:
        print_fn(f"  trained:   free-running from the same start: losses of all {cfg.steps} steps within "
                 f"{checks['trained_loss_max_rel_diff']:.1e} relative; {n_same}/{n} parameters identical")
    else:
        ratio = checks["chaos_ratio"]
        worst = max(checks["trained"], key=lambda c: c["max_abs_diff"])
        print_fn(f"  trained:   free-running, reported (not checked): losses within "
                 f"{checks['trained_loss_max_rel_diff']:.1e} relative over {cfg.steps} steps; one ulp on {CHAOS_PARAM}"
                 f" moves the one-process run's by {checks['chaos_floor_loss_max_rel_diff']:.1e}: "
                 + (f"{ratio:.2g}x that chaos floor" if ratio is not None else "no chaos floor to compare with")
                 + f"; {n_same}/{n} parameters identical, largest |d| {worst['max_abs_diff']:.1e} ({worst['name']})")
    print_fn(f"Result: {'PASS' if checks['passed'] else 'FAIL'}")


# =============================================================================
# 4. What a run measured
# =============================================================================
TP_PHASES = ("TP all-reduce (forward)", "TP all-reduce (backward)")


def timed_steps(cfg):
    """The steps whose times count (0-based): from TIMED_FROM_STEP, when there are enough of them."""
    return range(TIMED_FROM_STEP - 1 if cfg.steps >= TIMED_FROM_STEP + 2 else 0, cfg.steps)


def median_step(cfg, results):
    """(step, rank) of the median step, on its slowest rank: each timed step is as long as its slowest rank takes
    (the others wait for it in the next collective), and the median of those is one real step, whose parts add up
    to it. (Medians of each part, each on its own slowest rank, would not: a rank waiting for another counts
    the wait in the part it waits in, and a part's slowest rank is the one that waited there.)"""
    slowest = sorted((max(r["ms"]["step"][s] for r in results), s) for s in timed_steps(cfg))
    _, step = slowest[(len(slowest) - 1) // 2]  # the lower middle of an even count: a step that ran
    return step, max(range(len(results)), key=lambda r: results[r]["ms"]["step"][step])


def summarize(cfg, results):
    """Losses (averaged over DP ranks), the median step's parts (median_step) and bytes per step."""
    dp_heads = [results[d * cfg.tp] for d in range(cfg.dp)]  # TP ranks of a DP rank share its loss
    losses = [statistics.fmean(r["losses"][s] for r in dp_heads) for s in range(cfg.steps)]
    step, rank = median_step(cfg, results)
    ms = {k: results[rank]["ms"][k][step] for k in results[0]["ms"]}
    ledgers = [dict(comm=r["model_ledger"]["comm"] + r["ledger"]["comm"]) for r in results]
    phases = TP_PHASES + mt.PHASES_OF[run_kind(cfg)]
    phases += tuple(dict.fromkeys(c["phase"] for r in ledgers for c in r["comm"] if c["phase"] not in phases))
    table = mt.bytes_per_step(ledgers, cfg.steps, phases)  # with the phases options add ("QK-clip maxima")
    sent_max, sent_all = mt.total_bytes(table)
    optimizer_sent = [sum(t["sent"][r] for p, t in table.items() if p not in TP_PHASES) for r in range(len(results))]
    out = dict(losses=losses, val=results[0]["val"], ms=ms, ms_at=dict(step=step + 1, rank=rank),
               bytes_per_step=table, bytes_sent_max_rank=sent_max,
               bytes_sent_all_ranks=sent_all, optimizer_bytes_sent_max_rank=max(optimizer_sent),
               tokens_per_s=cfg.batch * cfg.context / (ms["step"] / 1e3))
    if cfg.qk_clip is not None:  # per step: the largest logit of any head, and how many heads (of all layers) clipped
        maxima = [torch.stack(list(ranks_max_logits(results, s).values())) for s in range(cfg.steps)]
        out["qk_clip"] = dict(max_logit=[m.max().item() for m in maxima],
                              heads_clipped=[int((m > cfg.qk_clip).sum()) for m in maxima])
    return out


def print_summary(cfg, summary, print_fn=print):
    ms, at = summary["ms"], summary["ms_at"]
    shown = mt.rounded_parts({k: ms[k] for k in ("forward", "backward", "optimizer")})  # whole ms
    timed = timed_steps(cfg)
    print_fn(f"\nStep (the median of steps {timed[0] + 1}-{timed[-1] + 1}, each on its slowest rank: step {at['step']}, "
             f"rank {at['rank']}): {sum(shown.values())} ms = forward {shown['forward']} + backward "
             f"{shown['backward']} + optimizer {shown['optimizer']} ms (optimizer {ms['optimizer'] / ms['step']:.0%} "
             f"of the step); {summary['tokens_per_s']:,.0f} tokens/s")
    rows = [[phase, t["axis"], t["dtype"], mt.human_bytes(max(t["sent"])), mt.human_bytes(sum(t["sent"]))]
            for phase, t in summary["bytes_per_step"].items()]
    rows.append(["total", "", "", mt.human_bytes(summary["bytes_sent_max_rank"]),
                 mt.human_bytes(summary["bytes_sent_all_ranks"])])
    print_fn("Bytes per step (ring counts; last step):")
    print_fn(mt.format_table(["phase", "axis", "dtype", "sent/rank (max)", "sent, all ranks"], rows,
                             ["<", "<", "<", ">", ">"]))
    if "qk_clip" in summary:
        q, heads = summary["qk_clip"], cfg.layers * cfg.heads
        steps_clipped = sum(n > 0 for n in q["heads_clipped"])
        first = next((i + 1 for i, n in enumerate(q["heads_clipped"]) if n), None)
        print_fn(f"QK-clip, tau {cfg.qk_clip:g}: the largest logit of any head was {q['max_logit'][0]:.3g} at step 1, "
                 f"{max(q['max_logit']):.3g} at most, {q['max_logit'][-1]:.3g} at step {cfg.steps}; heads clipped at "
                 f"{steps_clipped} of {cfg.steps} steps" + (f" (from step {first}): {sum(q['heads_clipped'])} of the "
                 f"{heads} heads x {cfg.steps} steps" if first else ""))


def time_split(trace_path, steps=PROFILE_ACTIVE):
    """{label: ms per step} of the record_function labels in one rank's Chrome trace: forward, backward,
    optimizer step, and inside it the lesson's phases (collectives by ledger phase, newton-schulz,
    state update). Labels nest: a phase's time is also inside "optimizer step"."""
    with open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    totals = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("ph") == "X":
            totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"] / 1e3 / steps
    return totals


def schedule_words(cfg):
    """"" for a constant lr, else how warmup-cosine shapes it (for headers and tables)."""
    if cfg.schedule == "constant":
        return ""
    return f" (warm-up {cfg.warmup_steps} steps, cosine decay to {MIN_LR_FRACTION:g}x)"


def header(cfg):
    n_params = sum(p.numel() for p in GPT(cfg.gpt()).parameters())
    corpus = load_corpus()
    what = ("AdamW ZeRO-1 (every parameter)" if cfg.optimizer == "adamw"
            else f"{'NorMuon' if cfg.optimizer == 'normuon' else 'Muon'}, {cfg.strategy} strategy")
    options = [f"QK-clip tau {cfg.qk_clip:g}" if cfg.qk_clip is not None else "",
               f"Newton-Schulz on the QKV's {cfg.ns_blocks}" if cfg.ns_blocks != "whole" else "",
               f"{cfg.ns_coefficients} coefficients" if cfg.ns_coefficients != "jordan" else "",
               "TP Newton-Schulz by Gram all-reduce" if cfg.tp_newton_schulz == "gram" else ""]
    what += "".join(f", {o}" for o in options if o)
    return (f"GPT {cfg.layers} layers x d={cfg.d_model}, {cfg.heads} heads, context {cfg.context}: "
            f"{n_params / 1e6:.2f} M parameters; {what}, lr {cfg.lr:g}{schedule_words(cfg)}\n"
            f"Text: the standard library's sources, {corpus.train.numel() / 1e6:.1f} MB train "
            f"({corpus.n_train_files} files), {corpus.val.numel() / 1e6:.1f} MB validation ({corpus.n_val_files} files); "
            f"{cfg.batch} x {cfg.context} = {cfg.batch * cfg.context:,} tokens per step\n"
            f"Grid: {cfg.dp * cfg.tp} ranks, DP={cfg.dp} x TP={cfg.tp}, torch {torch.__version__}\n")


# =============================================================================
# 5. The command line
# =============================================================================

def run(cfg, verify_run=False, print_fn=print):
    """Check, train on cfg.dp x cfg.tp spawned Gloo ranks, summarize (and verify); returns a dict."""
    validate(cfg)
    mt.start_method()  # the ranks' forkserver imports torch (seconds) while this process reads the text
    print_fn(header(cfg))
    t0 = time.perf_counter()
    results = mt.spawn_ranks(replace(cfg, keep=cfg.keep or verify_run), train_rank)
    wall_s = time.perf_counter() - t0
    summary = summarize(cfg, results)
    print_summary(cfg, summary, print_fn)
    print_fn(f"Wall time: {wall_s:.1f} s (start, read the text, {cfg.steps} steps)")
    out = dict(config=asdict(cfg), torch=torch.__version__, wall_s=wall_s, **summary)
    if cfg.profile:
        out["time_split_ms"] = [time_split(os.path.join(cfg.profile, f"rank{r}.json")) for r in range(len(results))]
        print_fn(f"Traces: {cfg.profile}/rank0.json ... rank{len(results) - 1}.json (open in ui.perfetto.dev)")
    if verify_run:
        print_fn("")
        out["checks"] = verify(cfg, results)
        print_verification(cfg, out["checks"], print_fn)
        out["passed"] = out["checks"]["passed"]
    return out


def build_parser():
    d = TrainConfig()
    p = mt.OneLineParser(description="Train a small GPT on the standard library's sources with distributed "
                                            "Muon (or AdamW) on DP x TP Gloo ranks.")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel size (default %(default)s)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (default %(default)s)")
    p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZER_NAMES,
                   help="muon (default): Muon for hidden matrices, AdamW for the rest; normuon: NorMuon for them "
                        "(owner or comm-free); adamw: AdamW for all")
    p.add_argument("--strategy", choices=mo.STRATEGIES, help=f"Muon's (default {d.strategy})")
    p.add_argument("--steps", type=int, default=d.steps, help="(default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate, the schedule's peak (default %(default)s)")
    p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule,
                   help=f"constant (default) or warmup-cosine: linear warm-up, cosine decay to "
                        f"{MIN_LR_FRACTION:g} x --lr")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="warmup-cosine's (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="(default %(default)s)")
    p.add_argument("--momentum", type=float, default=d.momentum, help="Muon's (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="windows per step, all DP ranks (default %(default)s)")
    p.add_argument("--context", type=int, default=d.context, help="(default %(default)s)")
    p.add_argument("--d-model", type=int, default=d.d_model, help="(default %(default)s)")
    p.add_argument("--layers", type=int, default=d.layers, help="(default %(default)s)")
    p.add_argument("--heads", type=int, default=d.heads, help="(default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(default %(default)s)")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines (default %(default)s)")
    p.add_argument("--val-windows", type=int, default=d.val_windows, help="(default %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s", metavar="SECONDS",
                   help="a rank silent this long, or a collective waiting this long, ends the run (default %(default)s)")
    p.add_argument("--profile", default="", metavar="DIR",
                   help=f"write torch.profiler Chrome traces of steps {PROFILE_WAIT + PROFILE_WARMUP + 1}-"
                        f"{PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE} to DIR/rank<R>.json")
    p.add_argument("--qk-clip", type=float, metavar="TAU", dest="qk_clip",
                   help="QK-clip (Kimi K2's MuonClip): after each step, shrink W_q and W_k of every head whose "
                        "largest logit passed TAU (default off)")
    p.add_argument("--ns-blocks", choices=mlr.NS_BLOCKS, default=d.ns_blocks,
                   help="Newton-Schulz of the fused QKV: whole (default, torch's), blocks (Q, K, V apart) or "
                        "heads (each head's q, k, v apart)")
    p.add_argument("--ns-coefficients", choices=tuple(mc.NS_COEFFICIENT_CHOICES), default=d.ns_coefficients,
                   help="jordan (default: torch's one quintic) or polar_express (one per iteration, arXiv 2505.16932)")
    p.add_argument("--tp-newton-schulz", choices=mlr.TP_NEWTON_SCHULZ, default=d.tp_newton_schulz,
                   help="gather (default): TP gather -> Newton-Schulz -> TP shard; gram: TP pieces split along "
                        "the long side orthogonalized where they lie, one Gram all-reduce per iteration "
                        "(--strategy gather)")
    p.add_argument("--verify", action="store_true",
                   help="train the same model in one process with torch.optim.Muon + AdamW and compare")
    p.add_argument("--json", metavar="PATH", help="write the run's figures")
    p.add_argument("--traceback", action="store_true", help="on a rank's failure, print its traceback too")
    mt.add_backend_flags(p)
    p.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p


def config_from_args(a):
    if a.optimizer == "adamw" and a.strategy is not None:
        raise ValueError(f"--optimizer adamw takes no --strategy (got {a.strategy}): strategies are Muon's")
    given = {f.name: getattr(a, f.name) for f in fields(TrainConfig) if getattr(a, f.name, None) is not None}
    return TrainConfig(**given)


def main_torchrun(args):
    """Under torchrun: this process is one rank; rank 0 gathers the results and prints (no second copy
    of the training: train_rank is the same)."""
    def prepare(world):
        cfg = config_from_args(args)
        mt.check_topology(cfg.dp, cfg.tp, world)
        # on CPUs the ranks of this node share its memory; a GPU's own memory is not checked here
        validate(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world)) if args.device == "cpu" else 0)
        if args.json:
            mt.check_writable(args.json)
        return cfg

    def body(cfg, rank, device):
        if rank == 0:
            print(header(cfg))
        return train_rank(rank, replace(cfg, keep=args.verify), device)

    def finish(cfg, gathered, device, seconds):
        summary = summarize(cfg, gathered)
        print_summary(cfg, summary)
        print(f"Wall time: {seconds:.1f} s ({cfg.steps} steps, {args.backend})")
        out = dict(config=asdict(cfg), torch=torch.__version__, backend=args.backend, device=args.device, **summary)
        code = 0
        if args.verify:
            out["checks"] = verify(cfg, gathered, device, rank_order=args.backend == "gloo")
            print()
            print_verification(cfg, out["checks"])
            code = 0 if out["checks"]["passed"] else 1
        mt.write_json(args.json, out)
        return code

    args.backend, args.device = mt.backend_flags(args)
    return mt.run_under_torchrun(args.backend, args.device, prepare, body, finish, args.traceback)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if mt.under_torchrun():
        return main_torchrun(args)

    def work():
        mt.backend_flags(args)
        if args.json:
            mt.check_writable(args.json)
        out = run(config_from_args(args), verify_run=args.verify)
        mt.write_json(args.json, out)
        return 0 if out.get("passed", True) else 1

    return mt.exit_code(work, args.traceback)


if __name__ == "__main__":
    sys.exit(main())
