"""Train a small GPT on real text with distributed Muon under DP x TP, and check it against one process.

Launch recipes
--------------
    python examples/train_gpt.py                          # 8 Gloo ranks, DP=4 x TP=2
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
(DistributedMuon and its strategies, imported, not copied), its settings examples/gpt_hyperparameters.py,
and --verify's one process and comparison examples/gpt_verify.py. The lesson's launcher runs the
ranks (muon_tools.spawn_ranks): Ctrl-C, SIGTERM, a failing or silent rank end the run as there.

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
import os
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

import distributed_muon_cpu  # noqa: E402
from distmuon import checks  # noqa: E402
from distmuon import large_runs  # noqa: E402
from distmuon import owners  # noqa: E402
import muon_tools  # noqa: E402
from examples.gpt import (GPT, GPTConfig, check_gpt, hidden_matrix_shapes, param_groups,  # noqa: E402
                          qkv_row_layouts)
from examples.gpt_verify import print_verification, ranks_max_logits, snapshot, verify  # noqa: E402
from examples.gpt_hyperparameters import MIN_LR_FRACTION, hyperparameters, set_lr  # noqa: E402
from examples.stdlib_text import load_corpus  # noqa: E402

# =============================================================================
# 1. The run's configuration and its checks
# =============================================================================
OPTIMIZER_NAMES = ("muon", "normuon", "adamw")
SCHEDULES = ("constant", "warmup-cosine")
PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE = 2, 1, 3  # steps skipped, warmed up, then traced
TIMED_FROM_STEP = 3  # medians leave out the first steps (allocations, first-touch, Gloo's set-up)


@dataclass(frozen=True)
class TrainConfig:
    dp: int = 4
    tp: int = 2
    optimizer: str = "muon"  # "normuon": NorMuon on the matrices; "adamw": AdamW ZeRO-1 on every parameter (the baseline)
    strategy: str = "owner"  # one of owners.STRATEGIES (Muon only); owner: each matrix orthogonalized once
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
    timeout_s: float = muon_tools.TIMEOUT_S
    profile: str = ""  # a folder for Chrome traces, one per rank ("" = no profiling)
    keep: bool = False  # return every rank's gradients and weights of every step (for verification)
    progress: bool = True  # rank 0 prints a progress line every log_every steps
    fail_rank: int = -1  # for tests: this rank raises at step 1
    qk_clip: float = None  # tau of QK-clip (None: off)
    ns_blocks: str = "whole"  # one of large_runs.NS_BLOCKS: what Newton-Schulz sees of the fused QKV
    ns_coefficients: str = "jordan"  # one of checks.NS_COEFFICIENT_CHOICES
    tp_newton_schulz: str = "gather"  # one of large_runs.TP_NEWTON_SCHULZ: gram orthogonalizes TP pieces where they lie

    def gpt(self):
        return GPTConfig(context=self.context, d_model=self.d_model, n_layers=self.layers,
                         n_heads=self.heads, seed=self.seed)


def validate(cfg, ranks_here=None):
    """Every check that can be made before any rank starts; ValueError with one line. ranks_here: how many
    of the ranks share this machine's memory (default all of them, as when spawned; 0: do not check)."""
    muon_tools.check_topology(cfg.dp, cfg.tp)
    muon_tools.check_seed(cfg.seed)
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
    if cfg.strategy not in owners.STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(owners.STRATEGIES)} (got {cfg.strategy!r})")
    if cfg.optimizer == "normuon" and not owners.strategy_class(cfg.strategy).holds_rows:
        raise ValueError(f"--optimizer normuon takes --strategy {muon_tools.either(owners.strategies_where(lambda s: s.holds_rows))}, "
                         f"whose owner holds each matrix's rows (got --strategy {cfg.strategy})")
    check_large_run_options(cfg)
    checks.check_hyperparameters(muon_tools.flag, bucket_size=cfg.bucket_size, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             momentum=cfg.momentum, adjust_lr_fn="match_rms_adamw")
    if cfg.lr == 0:
        raise ValueError("--lr must be > 0")
    muon_tools.check_step_numbers(muon_tools.flag, hyperparameters(cfg), hidden_matrix_shapes(cfg.gpt()))
    for name, n in (("batch", cfg.batch), ("val-windows", cfg.val_windows)):
        if n % cfg.dp:
            raise ValueError(f"DP {cfg.dp} does not divide --{name} {n}: every DP rank takes the same share")
    if cfg.profile and cfg.steps < PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE:
        raise ValueError(f"--profile traces steps {PROFILE_WAIT + PROFILE_WARMUP + 1} to "
                         f"{PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE}: --steps must be >= "
                         f"{PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE} (got {cfg.steps})")
    if cfg.profile:
        muon_tools.check_writable(cfg.profile, "--profile", folder=True)  # the ranks make it (start_profiler)
    muon_tools.check_launch(cfg.timeout_s, cfg.fail_rank, cfg.dp * cfg.tp)
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
    muon_tools.check_large_run_flags(ns_coefficients=cfg.ns_coefficients, ns_blocks=cfg.ns_blocks,
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
    budget = muon_tools.host_memory() if budget is None else budget
    need = ranks_here * memory_lower_bound(cfg)
    if need > budget:
        raise ValueError(f"--batch {cfg.batch} x --context {cfg.context} with --d-model {cfg.d_model} and --layers "
                         f"{cfg.layers} needs at least {muon_tools.human_bytes(need)} on {ranks_here} ranks here, more than "
                         f"this machine's {muon_tools.human_bytes(budget)} of memory")


def large_run_options(cfg):
    """What --tp-newton-schulz, --ns-blocks and --qk-clip add, as the lesson's optimizers take it
    (distmuon.large_runs.LargeRuns); None at their defaults: torch's behaviour."""
    options = {}
    if cfg.tp_newton_schulz != "gather":
        options["tp_newton_schulz"] = cfg.tp_newton_schulz
    if cfg.ns_blocks != "whole":
        options["ns_blocks"] = cfg.ns_blocks
    if cfg.qk_clip is not None:
        options["qk_clip_tau"] = cfg.qk_clip
    return large_runs.LargeRuns(row_layouts=qkv_row_layouts(cfg.gpt()), **options) if options else None


def build_optimizer(model, cfg, grid):
    # AdamW ZeRO-1 is the gather class with no Muon group: the lesson's baseline
    return owners.OPTIMIZERS["gather" if cfg.optimizer == "adamw" else cfg.strategy](
        param_groups(model, *hyperparameters(cfg)), grid=grid, tp_split_dims=model.tp_split_dims(),
        bucket_size=cfg.bucket_size, large_runs=large_run_options(cfg))


def run_kind(cfg):
    return muon_tools.BASELINE if cfg.optimizer == "adamw" else cfg.strategy


# =============================================================================
# 2. One rank's training
# =============================================================================

def train_rank(rank, cfg, device):
    """What every rank runs once the world is joined; returns its losses, timings, bytes (and with
    cfg.keep its gradients of every step and its final weights)."""
    torch.set_num_threads(1)  # as in the lesson: the reference pins the same count
    grid = distributed_muon_cpu.make_grid(cfg.dp, cfg.tp, rank)
    corpus = load_corpus()
    model = GPT(cfg.gpt(), grid.tp, distributed_muon_cpu.Ledger()).to(device)
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



def train_each(rank, trainings, device):
    """Several trainings on one set of ranks (tests and benchmarks share a spawn): trainings.configs,
    one after the other, each on a fresh model and optimizer."""
    return [train_rank(rank, cfg, device) for cfg in trainings.configs]


@dataclass(frozen=True)
class Trainings:
    """What muon_tools.spawn_ranks needs (dp, tp, timeout_s), for several TrainConfigs on the same grid."""
    configs: tuple
    dp: int
    tp: int
    timeout_s: float = muon_tools.TIMEOUT_S


def train_many(configs):
    """Run TrainConfigs of one grid on one spawn of ranks: [(config, every rank's result)] in order."""
    dp, tp = configs[0].dp, configs[0].tp
    if any((c.dp, c.tp) != (dp, tp) for c in configs):
        raise ValueError("train_many runs configurations of one grid")
    for cfg in configs:
        validate(cfg)
    per_rank = muon_tools.spawn_ranks(Trainings(tuple(configs), dp, tp, max(c.timeout_s for c in configs)), train_each)
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
# 3. What a run measured
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
    phases = TP_PHASES + muon_tools.PHASES_OF[run_kind(cfg)]
    phases += tuple(dict.fromkeys(c["phase"] for r in ledgers for c in r["comm"] if c["phase"] not in phases))
    table = muon_tools.bytes_per_step(ledgers, cfg.steps, phases)  # with the phases options add ("QK-clip maxima")
    sent_max, sent_all = muon_tools.total_bytes(table)
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
    shown = muon_tools.rounded_parts({k: ms[k] for k in ("forward", "backward", "optimizer")})  # whole ms
    timed = timed_steps(cfg)
    print_fn(f"\nStep (the median of steps {timed[0] + 1}-{timed[-1] + 1}, each on its slowest rank: step {at['step']}, "
             f"rank {at['rank']}): {sum(shown.values())} ms = forward {shown['forward']} + backward "
             f"{shown['backward']} + optimizer {shown['optimizer']} ms (optimizer {ms['optimizer'] / ms['step']:.0%} "
             f"of the step); {summary['tokens_per_s']:,.0f} tokens/s")
    rows = [[phase, t["axis"], t["dtype"], muon_tools.human_bytes(max(t["sent"])),
             muon_tools.human_bytes(sum(t["sent"]))]
            for phase, t in summary["bytes_per_step"].items()]
    rows.append(["total", "", "", muon_tools.human_bytes(summary["bytes_sent_max_rank"]),
                 muon_tools.human_bytes(summary["bytes_sent_all_ranks"])])
    print_fn("Bytes per step (ring counts; last step):")
    print_fn(muon_tools.format_table(["phase", "axis", "dtype", "sent/rank (max)", "sent, all ranks"], rows,
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
# 4. The command line
# =============================================================================

def run(cfg, verify_run=False, print_fn=print):
    """Check, train on cfg.dp x cfg.tp spawned Gloo ranks, summarize (and verify); returns a dict."""
    validate(cfg)
    muon_tools.start_method()  # the ranks' forkserver imports torch (seconds) while this process reads the text
    print_fn(header(cfg))
    t0 = time.perf_counter()
    results = muon_tools.spawn_ranks(replace(cfg, keep=cfg.keep or verify_run), train_rank)
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
    p = muon_tools.OneLineParser(description="Train a small GPT on the standard library's sources with distributed "
                                            "Muon (or AdamW) on DP x TP Gloo ranks.")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel size (default %(default)s)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (default %(default)s)")
    p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZER_NAMES,
                   help="muon (default): Muon for hidden matrices, AdamW for the rest; normuon: NorMuon for them "
                        "(owner or comm-free); adamw: AdamW for all")
    p.add_argument("--strategy", choices=owners.STRATEGIES, help=f"Muon's (default {d.strategy})")
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
    p.add_argument("--log-every", type=int, default=d.log_every,
                   help="steps between progress lines (default %(default)s)")
    p.add_argument("--val-windows", type=int, default=d.val_windows, help="(default %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s", metavar="SECONDS",
                   help="a rank silent this long, or a collective waiting this long, ends the run (default %(default)s)")
    p.add_argument("--profile", default="", metavar="DIR",
                   help=f"write torch.profiler Chrome traces of steps {PROFILE_WAIT + PROFILE_WARMUP + 1}-"
                        f"{PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE} to DIR/rank<R>.json")
    p.add_argument("--qk-clip", type=float, metavar="TAU", dest="qk_clip",
                   help="QK-clip (Kimi K2's MuonClip): after each step, shrink W_q and W_k of every head whose "
                        "largest logit passed TAU (default off)")
    p.add_argument("--ns-blocks", choices=large_runs.NS_BLOCKS, default=d.ns_blocks,
                   help="Newton-Schulz of the fused QKV: whole (default, torch's), blocks (Q, K, V apart) or "
                        "heads (each head's q, k, v apart)")
    p.add_argument("--ns-coefficients", choices=tuple(checks.NS_COEFFICIENT_CHOICES), default=d.ns_coefficients,
                   help="jordan (default: torch's one quintic) or polar_express (one per iteration, arXiv 2505.16932)")
    p.add_argument("--tp-newton-schulz", choices=large_runs.TP_NEWTON_SCHULZ, default=d.tp_newton_schulz,
                   help="gather (default): TP gather -> Newton-Schulz -> TP shard; gram: TP pieces split along "
                        "the long side orthogonalized where they lie, one Gram all-reduce per iteration "
                        "(--strategy gather)")
    p.add_argument("--verify", action="store_true",
                   help="train the same model in one process with torch.optim.Muon + AdamW and compare")
    p.add_argument("--json", metavar="PATH", help="write the run's figures")
    p.add_argument("--traceback", action="store_true", help="on a rank's failure, print its traceback too")
    muon_tools.add_backend_flags(p)
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
        muon_tools.check_topology(cfg.dp, cfg.tp, world)
        # on CPUs the ranks of this node share its memory; a GPU's own memory is not checked here
        validate(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world)) if args.device == "cpu" else 0)
        if args.json:
            muon_tools.check_writable(args.json)
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
        muon_tools.write_json(args.json, out)
        return code

    args.backend, args.device = muon_tools.backend_flags(args)
    return muon_tools.run_under_torchrun(args.backend, args.device, prepare, body, finish, args.traceback)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if muon_tools.under_torchrun():
        return main_torchrun(args)

    def work():
        muon_tools.backend_flags(args)
        if args.json:
            muon_tools.check_writable(args.json)
        out = run(config_from_args(args), verify_run=args.verify)
        muon_tools.write_json(args.json, out)
        return 0 if out.get("passed", True) else 1

    return muon_tools.exit_code(work, args.traceback)


if __name__ == "__main__":
    sys.exit(main())
