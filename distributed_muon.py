"""Distributed Muon, ZeRO-1 x tensor parallel, on GPUs over NCCL: one process per GPU, started by torchrun.
(Made from distributed_muon_cpu.py by tools/gpu_twin.py, never by hand: diff the two to see what GPUs change.)

Muon (MomentUm Orthogonalized by Newton-Schulz) replaces the momentum of every
2-D weight by its nearest semi-orthogonal matrix. Newton-Schulz needs the WHOLE
matrix, but distributed training shards every matrix twice:

  * tensor parallelism (TP) splits a weight across the TP ranks of a row of the grid;
  * ZeRO-1 flattens the TP-local weights into buckets and splits each bucket
    across the data-parallel (DP) ranks, so each rank keeps optimizer state for
    its 1/DP slice only.

This script puts each matrix back together, orthogonalizes it, and hands every
rank exactly its piece:

    DP gather  ->  TP gather  ->  Newton-Schulz  ->  TP shard  ->  DP shard

and then checks every parameter, bit for bit (torch.equal), against PyTorch's
own single-device torch.optim.Muon and torch.optim.AdamW fed the same total
gradient. That flow repeats Newton-Schulz on every rank that touches a matrix;
section 7 (muon_owners.py) adds two strategies that orthogonalize each matrix
once, on its owner ("owner": all-to-all exchanges; "comm-free": matrices sharded
whole across DP).

Launch recipes (DP = processes / TP unless --dp says otherwise)
--------------
    torchrun --standalone --nproc-per-node 8 distributed_muon.py --tp 2       # 8 GPUs, DP=4 x TP=2
    torchrun --standalone --nproc-per-node 8 distributed_muon.py --tp 2 --strategy owner --explain
    torchrun --standalone --nproc-per-node 4 distributed_muon.py --backend gloo --device cpu --tp 2  # no GPU
    python distributed_muon.py --help                   # every flag; the other strategies' and options'
                                                        # recipes: muon_owners.py, muon_large_runs.py

Import it and its optimizer is a real torch.optim.Optimizer:
    from distributed_muon_cpu import DistributedMuon, make_grid

Reading order (each section opens with what it does and why)
    1. Newton-Schulz, momentum and the learning-rate adjustment (the math)
    2. The grid and its collectives (through which every byte between ranks goes, counted)
    3. The virtual buffer (param groups, buckets, dist_meta)
    4. The gather flow (DP gather -> TP gather -> Newton-Schulz -> TP shard -> DP shard)
    5. The step: the gather strategy (DistributedMuon, a torch.optim.Optimizer)
    6. Run it (what each process runs, on a small transformer, checked against torch)
then, each in a file of its own:
    7. muon_owners.py: each matrix orthogonalized once (the owner and comm-free strategies)
    8. muon_large_runs.py: what large runs add (fused QKV by blocks, QK-clip, Newton-Schulz on TP pieces)
and beside the lesson, no part of it: muon_checks.py (what the optimizer refuses), muon_forkserver.py (how
a command starts its ranks' processes early) and muon_tools.py (9-12: torch's reference, the accounting, the
launcher and the command line, the training checks).
"""

from __future__ import annotations

import datetime
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace

if __name__ == "__main__":  # a Ctrl-C while torch loads waits for the launcher (section 11): one line, exit 130
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    import muon_forkserver  # no torch in it: the ranks' forkserver starts importing torch now, beside this process

    muon_forkserver.start_for_command()

import torch
import torch.distributed as dist
from torch.profiler import record_function

# What the optimizer refuses (its constructor's checks, shared with DTensorMuon and the command lines)
# lives beside the lesson, no part of it.
from muon_checks import check_options, check_param_groups, fill_param_group, index_named_params, name_params

# =============================================================================
# 1. Newton-Schulz, momentum and the learning-rate adjustment
# =============================================================================
# The math of torch.optim.Muon (torch/optim/_muon.py), written out and kept
# operation for operation identical, so that the distributed result can be
# bit-identical to it: cast to bf16 (a tall matrix transposed, so that the Gram
# matrix X X^T is the small one), scale by the Frobenius norm (clamped by eps) so
# the spectral norm is <= 1, then quintic iterations X <- a X + (b A + c A A) X,
# A = X X^T. The coefficients, 5 steps and eps = 1e-7 are Keller Jordan's,
# torch.optim.Muon's defaults. One (a, b, c) serves every iteration, or a list
# gives one per iteration: Polar Express (Amsel et al., arXiv 2505.16932,
# Algorithm 1) picks each iteration's polynomial to be optimal for the worst
# singular value left by the previous ones.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
# Algorithm 1's eight triples, the first seven divided by (1.01, 1.01^3, 1.01^5), its safety factor
# for bf16; iterations past the eighth repeat the last. (Its extra 1.01 on the norm is not applied:
# the normalization stays torch.optim.Muon's.)
_POLAR_EXPRESS = ((8.28721201814563, -23.595886519098837, 17.300387312530933),
                  (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
                  (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
                  (3.3184196573706015, -2.488488024314874, 0.51004894012372),
                  (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
                  (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
                  (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
                  (1.875, -1.25, 0.375))
POLAR_EXPRESS = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS[:-1]) + _POLAR_EXPRESS[-1:]
NS_COEFFICIENT_CHOICES = {"jordan": NS_COEFFICIENTS, "polar_express": POLAR_EXPRESS}


def ns_coefficients_of(coefficients, steps):
    """One (a, b, c) triple per iteration, as a tuple of `steps` triples: from one triple (every
    iteration), a list of exactly `steps` triples, or a name of NS_COEFFICIENT_CHOICES (a longer
    list gives its first `steps`, a shorter one repeats its last, as Algorithm 1 does)."""
    if isinstance(coefficients, str):
        if coefficients not in NS_COEFFICIENT_CHOICES:
            raise ValueError(f"ns_coefficients {coefficients!r} is not one of {', '.join(NS_COEFFICIENT_CHOICES)}")
        named = NS_COEFFICIENT_CHOICES[coefficients]
        named = (named,) if isinstance(named[0], (int, float)) else named
        return tuple(named[min(i, len(named) - 1)] for i in range(steps))
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    coefficients = tuple(coefficients)
    if len(coefficients) == 3 and all(number(v) for v in coefficients):
        triples = (tuple(float(v) for v in coefficients),) * steps
    else:
        triples = tuple(tuple(float(v) for v in t) if isinstance(t, (tuple, list)) and len(t) == 3
                        and all(number(v) for v in t) else None for t in coefficients)
        if None in triples or len(triples) != steps:
            raise ValueError(f"ns_coefficients must be one (a, b, c) triple, a name ({', '.join(NS_COEFFICIENT_CHOICES)}) "
                             f"or {steps} triples, one per iteration (got {coefficients!r})")
    if not all(math.isfinite(v) for t in triples for v in t):
        raise ValueError(f"ns_coefficients must be finite (got {coefficients})")
    return triples


def newton_schulz(matrix, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, eps=NS_EPS, fused_mm=torch.addmm,
                  dtype=torch.bfloat16):
    """Approximately orthogonalize a full (rows, cols) matrix; returns bfloat16 (dtype).

    With fused_mm = torch.addmm (beta * input + alpha * m1 @ m2, in one call) these are
    exactly torch.optim.Muon's operations, so its result is torch's, bit for bit.
    coefficients: one (a, b, c), or one per iteration (ns_coefficients_of).
    dtype: torch's bf16; torch.float64 gives the same iteration without bf16's rounding.
    """
    per_iteration = ns_coefficients_of(coefficients, steps)
    x = matrix.to(dtype)
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # out of place: a bf16 input is not modified
    for a, b, c in per_iteration:
        gram = x @ x.mT
        poly = fused_mm(gram, gram, gram, beta=b, alpha=c)  # b*A + c*A@A
        x = fused_mm(x, poly, x, beta=a)  # a*X + poly@X
    return x.mT if tall else x


def newton_schulz_flops(shape, steps=NS_STEPS):
    """Matmul FLOPs of newton_schulz on a (rows, cols) matrix, m = min and n = max of them: each
    iteration does X@X.T (2 m m n), A@A (2 m m m) and poly@X (2 m m n); elementwise work left out."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m * m * m)


def muon_momentum_(momentum_buffer, grad, momentum, nesterov):
    """Update the momentum buffer in place and return the Newton-Schulz input (elementwise: a shard
    gets the whole matrix's bits). torch's moving average, buf <- buf + (1-mu)(g - buf), Nesterov
    g.lerp(buf, mu)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def adjusted_lr(lr, adjust_lr_fn, global_shape):
    """Muon's per-matrix learning rate, from the FULL (TP-gathered) shape (A, B) = (rows, cols).

    'original'           : sqrt(max(1, A/B))     (Keller Jordan; torch's default)
    'match_rms_adamw'    : 0.2 * sqrt(max(A, B)) (Moonlight, "Muon is Scalable for LLM Training")
    'spectral_unclamped' : sqrt(A/B)             (torch.optim.Muon's third choice: below 1 for wide matrices)
    """
    rows, cols = global_shape
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":
        return lr * math.sqrt(rows / cols)
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}")


def adamw_(param, grad, exp_avg, exp_avg_sq, step, *, lr, betas, eps, weight_decay, maximize=False,
           max_exp_avg_sq=None):
    """torch.optim.AdamW's single-tensor math, line for line, on any slice (elementwise: a ZeRO-1
    shard gets the full tensor's bits). `step` is the already-incremented step count; maximize: the
    gradient's ascent; max_exp_avg_sq: amsgrad's running maximum of exp_avg_sq, or None without amsgrad."""
    beta1, beta2 = betas
    if maximize:
        grad = -grad
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    if max_exp_avg_sq is not None:  # amsgrad: normalize by the largest second moment so far
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        exp_avg_sq = max_exp_avg_sq
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


# The same math with a param group's options, on a part of a parameter.
def muon_update(momentum_buffer, grad, group):
    """Muon's momentum, then the bf16 cast Newton-Schulz does first anyway (half the bytes to move, no bit changed)."""
    return muon_momentum_(momentum_buffer, grad, group["momentum"], group["nesterov"]).bfloat16()


def apply_muon_update_(param, ortho, group, global_shape, runs=None):
    """p <- p (1 - lr wd) - adjusted_lr(global shape) O, as torch.optim.Muon: the decay takes the unadjusted lr.
    runs: None (torch's update), or [(start, stop, rows)]: elements [start, stop) lie in blocks of `rows`
    rows, each adjusted for its own shape (rows, cols) as torch would adjust the blocks as separate
    parameters; one add_ per run, so the bits stay torch's."""
    param.mul_(1 - group["lr"] * group["weight_decay"])
    if runs is None:
        param.add_(ortho, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], global_shape))
    for start, stop, rows in runs or ():
        param[start:stop].add_(ortho[start:stop],
                               alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], (rows, global_shape[1])))


def adamw_state(numel, group, device=None):
    """What torch.optim.AdamW keeps for a parameter of `numel` elements, before its first step."""
    state = dict(step=torch.tensor(0.0), exp_avg=torch.zeros(numel, device=device),
                 exp_avg_sq=torch.zeros(numel, device=device))
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros(numel, device=device)
    return state


def adamw_step_(param, grad, state, group):
    """One AdamW step of a part: the step count, then adamw_ on the state's moments."""
    state["step"] += 1
    adamw_(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"].item(), lr=group["lr"],
           betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
           maximize=group.get("maximize", False), max_exp_avg_sq=state.get("max_exp_avg_sq"))


# =============================================================================
# 2. The grid and its collectives
# =============================================================================
# world = DP x TP ranks laid out as a matrix, rank = dp_rank * TP + tp_rank:
#
#            TP 0   TP 1          a row    = one TP group: contiguous ranks, as the
#    DP 0  [   0      1 ]                    GPUs of one node, where TP's frequent
#    DP 1  [   2      3 ]                    traffic belongs
#    DP 2  [   4      5 ]         a column = one DP group: strided ranks that hold
#    DP 3  [   6      7 ]                    the same TP piece of every weight
#
# The groups are sliced from torch.arange(world).view(DP, TP). Every rank must
# create every group, in the same order, even the groups it is not part of.
#
# Every collective goes through the functions below, which record in a Ledger
# what each rank sends and receives (Gloo's profiler records no message sizes):
# a ring's count, (n - 1) * k bytes each way for n ranks and k-byte shards. Each
# call is labelled with its phase for torch.profiler (record_function).

# torch 2.14 renames all_gather_into_tensor / reduce_scatter_tensor to *_single;
# older torch has only the old names: resolved once, here.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# A world this large on one machine is a typo, not a plan: every rank is a Python
# process with torch loaded (its memory: notes/07-pitfalls.md).
MAX_WORLD = 64


@dataclass(frozen=True)
class Axis:
    """One direction of the grid, seen from one rank."""

    name: str  # "DP", "TP" or "world"
    size: int
    rank: int  # this rank's index along the axis
    ranks: tuple  # global ranks of this rank's group along the axis
    group: object = None  # the torch.distributed ProcessGroup (None when not initialized)


@dataclass(frozen=True)
class Grid:
    rank: int
    dp: Axis
    tp: Axis
    world: Axis  # every rank at once, across both axes


def check_topology(dp, tp, world=None):
    """Raise ValueError naming every factor when the grid cannot exist."""
    if dp < 1 or tp < 1:
        raise ValueError(f"DP and TP must be >= 1 (got DP={dp}, TP={tp})")
    if world is not None and dp * tp != world:
        raise ValueError(f"world size {world} != DP {dp} x TP {tp} = {dp * tp}")
    if dp * tp > MAX_WORLD:
        raise ValueError(f"DP {dp} x TP {tp} = {dp * tp} ranks is more than {MAX_WORLD} on one machine")


def rank_grid(dp, tp):
    return torch.arange(dp * tp).view(dp, tp)


def plan_grid(dp, tp, rank):
    """The grid as `rank` sees it, without process groups: what a launcher plans with."""
    check_topology(dp, tp)
    grid = rank_grid(dp, tp)
    dp_rank, tp_rank = divmod(rank, tp)
    return Grid(rank=rank,
                dp=Axis("DP", dp, dp_rank, tuple(grid[:, tp_rank].tolist())),
                tp=Axis("TP", tp, tp_rank, tuple(grid[dp_rank].tolist())),
                world=Axis("world", dp * tp, rank, tuple(range(dp * tp))))


def make_grid(dp, tp, rank):
    """Build the DP and TP process groups. Collective: call on every rank."""
    check_topology(dp, tp, dist.get_world_size())
    plan, grid = plan_grid(dp, tp, rank), rank_grid(dp, tp)
    groups = {}
    for ranks in grid.tolist() + grid.T.tolist():  # TP groups (rows), then DP groups (columns)
        group = dist.new_group(ranks)
        groups[tuple(ranks)] = group
    return replace(plan, dp=replace(plan.dp, group=groups[plan.dp.ranks]),
                   tp=replace(plan.tp, group=groups[plan.tp.ranks]),
                   world=replace(plan.world, group=dist.group.WORLD))


@dataclass
class Ledger:
    """What this rank communicated and computed, step by step."""

    step: int = 0
    comm: list = field(default_factory=list)  # dicts: step, phase, op, axis, dtype, sent, received (bytes)
    compute: list = field(default_factory=list)  # dicts: step, name, shape, flops

    def record_comm(self, phase, op, axis, sent_numel, received_numel, dtype):
        size = dtype.itemsize
        self.comm.append(dict(step=self.step, phase=phase, op=op, axis=axis.name,
                              dtype=str(dtype).replace("torch.", ""),
                              sent=sent_numel * size, received=received_numel * size))

    def record_ring(self, phase, op, axis, shard):
        """A ring collective of `shard`-sized pieces: (n - 1) pieces out and in."""
        ring = (axis.size - 1) * shard.numel()
        self.record_comm(phase, op, axis, ring, ring, shard.dtype)

    def record_compute(self, name, shape, flops):
        self.compute.append(dict(step=self.step, name=name, shape=tuple(shape), flops=flops))


def all_gather(shard, axis, ledger, phase):
    """Concatenate every rank's equal-sized 1-D shard along `axis`: (size * k,)."""
    if axis.size == 1:
        return shard
    out = shard.new_empty(axis.size * shard.numel())
    with record_function(phase):
        all_gather_single(out, shard, group=axis.group)
    ledger.record_ring(phase, "all_gather", axis, shard)
    return out


def sum_in_order(contributions):
    """contributions[0] + contributions[1] + ..., left to right: one order, the same on every run
    (a new tensor: the first addition writes it, no copy first)."""
    if len(contributions) == 1:
        return contributions[0].clone()
    total = contributions[0] + contributions[1]
    for contribution in contributions[2:]:
        total += contribution
    return total


def reduce_scatter_sum(bucket, axis):
    """torch's reduce-scatter with ReduceOp.SUM (the total gradient, as the reference is fed; no AVG
    on older torch), started: (work, a function that returns the shard). Gloo's reduce_scatter is a
    full all-reduce, more bytes and slower (notes/measured/gloo_collectives_2core.txt); there each
    rank's i-th shard goes straight to rank i in one all-to-all, added in rank order: a ring's bytes."""
    shard_numel = bucket.numel() // axis.size
    if dist.get_backend(axis.group) == "gloo":
        received = bucket.new_empty(bucket.numel())
        work = dist.all_to_all_single(received, bucket, group=axis.group, async_op=True)
        return work, lambda: sum_in_order(received.view(axis.size, shard_numel))
    out = bucket.new_empty(shard_numel)
    work = reduce_scatter_single(out, bucket, op=dist.ReduceOp.SUM, group=axis.group, async_op=True)
    return work, lambda: out


def reduce_scatter(bucket, axis, ledger, phase):
    """Sum `bucket` over the ranks of `axis` and keep this rank's 1/size of it."""
    if axis.size == 1:
        return bucket
    with record_function(phase):
        work, shard = reduce_scatter_sum(bucket, axis)
        work.wait()
    ledger.record_ring(phase, "reduce_scatter", axis, bucket[:bucket.numel() // axis.size])
    return shard()


def all_reduce(tensor, axis, ledger, phase, op=dist.ReduceOp.SUM):
    """Reduce `tensor` in place over the ranks of `axis` (SUM or MAX), counted as a ring all-reduce:
    2 (n - 1) pieces of 1/n of it out and in."""
    if axis.size == 1:
        return tensor
    with record_function(phase):
        dist.all_reduce(tensor, op=op, group=axis.group)
    ring = 2 * (axis.size - 1) * -(-tensor.numel() // axis.size)
    ledger.record_comm(phase, "all_reduce", axis, ring, ring, tensor.dtype)
    return tensor


def any_rank(flags, axis, ledger, phase):
    """Elementwise OR of a 1-D bool tensor over the ranks of `axis`: one MAX all-reduce of the flags as bytes."""
    if axis.size == 1:
        return flags
    return all_reduce(flags.to(torch.uint8), axis, ledger, phase, dist.ReduceOp.MAX).bool()


# =============================================================================
# 3. The virtual buffer
# =============================================================================
# ZeRO-1 sees a param group's TP-local parameters as one flat "virtual buffer",
# cut into buckets of at most --bucket-size elements (a parameter larger than
# that gets a bucket of its own). Each bucket is padded to a multiple of DP and
# DP rank r keeps the r-th of its DP equal shards:
#
#   bucket (buffer 0, bucket 0), DP = 4, shard = L elements
#   |<---- qkv.weight ---->|<- proj.weight ->|<router>|pad|
#   |<--- DP 0 --->|<--- DP 1 --->|<--- DP 2 --->|<--- DP 3 --->|
#   0              L              2L             3L             4L
#
# A parameter may straddle shards (qkv.weight: DP 0 and DP 1); a rank's state
# covers only its part (`local_range`, maybe empty). A DistMeta per parameter and
# rank (the Moonshot PoC's MuonDistMeta names) says where it lies: a pure function
# of shapes, DP and bucket size, so every rank computes the same one without
# talking (notes/02-virtual-buffer.md).


@dataclass(frozen=True)
class Bucket:
    buffer_idx: int
    bucket_idx: int
    names: tuple  # parameters, in bucket order
    used: int  # elements holding parameters
    numel: int  # padded to a multiple of DP

    def shard_range(self, dp_rank, dp):
        shard = self.numel // dp
        return dp_rank * shard, (dp_rank + 1) * shard


@dataclass(frozen=True)
class DistMeta:
    name: str
    buffer_idx: int  # which param group / virtual buffer
    bucket_idx: int  # which bucket inside that buffer
    shape: tuple  # TP-local shape (what this rank holds)
    global_shape: tuple  # shape after the TP gather (what Newton-Schulz sees)
    tp_split_dim: int  # dim TP splits (-1: not split)
    bucket_range: tuple  # [start, end) of the parameter inside its bucket
    local_range: tuple  # [start, end) of the part this DP rank keeps, in bucket coordinates; may be empty
    shard_start: int  # where this DP rank's shard begins in the bucket

    @property
    def local_numel(self):
        return self.local_range[1] - self.local_range[0]

    @property
    def param_slice(self):
        """The local range as a slice of the flattened TP-local parameter."""
        start = self.bucket_range[0]
        return slice(self.local_range[0] - start, self.local_range[1] - start)

    @property
    def shard_slice(self):
        """The local range as a slice of this DP rank's shard."""
        return slice(self.local_range[0] - self.shard_start, self.local_range[1] - self.shard_start)


def plan_buckets(buffers, dp, bucket_size):
    """buffers: one list per param group of (name, numel). Returns (buckets, bucket_ranges)."""
    buckets, bucket_ranges = [], {}
    for buffer_idx, entries in enumerate(buffers):
        current, used = [], 0

        def close():
            if current:
                padded = -(-used // dp) * dp
                buckets.append(Bucket(buffer_idx, sum(b.buffer_idx == buffer_idx for b in buckets),
                                      tuple(current), used, padded))

        for name, numel in entries:
            if current and used + numel > bucket_size:
                close()
                current, used = [], 0
            bucket_ranges[name] = (used, used + numel)
            current.append(name)
            used += numel
        close()
    return buckets, bucket_ranges


def build_dist_metas(buckets, bucket_ranges, shapes, global_shapes, tp_split_dims, dp_rank, dp):
    metas = {}
    for b in buckets:
        lo, hi = b.shard_range(dp_rank, dp)
        for name in b.names:
            start, end = bucket_ranges[name]
            l0 = min(max(start, lo), end)
            l1 = max(min(end, hi), l0)
            metas[name] = DistMeta(name, b.buffer_idx, b.bucket_idx, tuple(shapes[name]),
                                   tuple(global_shapes[name]), tp_split_dims[name], (start, end), (l0, l1), lo)
    return metas


def global_shape_of(local_shape, tp_split_dim, tp):
    shape = list(local_shape)
    if tp_split_dim >= 0:
        shape[tp_split_dim] *= tp
    return tuple(shape)


@dataclass(frozen=True)
class Layout:
    """Where every parameter lives, the same on every rank: the buckets and every DP rank's dist_meta."""

    buckets: tuple
    bucket_ranges: dict  # name -> [start, end) inside its bucket
    shapes: dict  # name -> TP-local shape
    global_shapes: dict  # name -> shape after the TP gather
    tp_split_dims: dict  # name -> dim TP splits, -1 if none
    metas: tuple  # one {name: DistMeta} per DP rank

    @property
    def dp(self):
        return len(self.metas)


def plan_layout(buffers, shapes, tp_split_dims, dp, tp, bucket_size):
    """buffers: one list of parameter names per param group, in order (the names ZeRO-1 buckets)."""
    global_shapes = {n: global_shape_of(s, tp_split_dims[n], tp) for n, s in shapes.items()}
    buckets, bucket_ranges = plan_buckets([[(n, math.prod(shapes[n])) for n in names] for names in buffers],
                                          dp, bucket_size)
    metas = tuple(build_dist_metas(buckets, bucket_ranges, shapes, global_shapes, tp_split_dims, r, dp)
                  for r in range(dp))
    return Layout(tuple(buckets), bucket_ranges, shapes, global_shapes, tp_split_dims, metas)


# =============================================================================
# 4. The gather flow
# =============================================================================
# The heart of the step, for one bucket of Muon matrices. Each rank holds its DP
# shard of the bucket's update (bf16: its part of every matrix the shard
# touches) and needs its part of newton_schulz(the FULL matrix), for each of them:
#
#   update shard       --DP gather (all-gather)------> every TP-local matrix of the bucket
#   TP-local matrix    --TP gather (along split dim)-> the full matrix  [only where this rank has a part]
#   full matrix        --Newton-Schulz---------------> orthogonal full matrix
#   orthogonal matrix  --TP shard (slice)------------> its TP piece
#   TP piece           --DP shard (slice)------------> this rank's part
#
# The DP gather is one flat all-gather per bucket (every matrix a view of it);
# the TP gather is per matrix, along its own split dim, for the matrices this
# rank's DP shard touches (notes/04-bucketing.md). The gathers communicate; their
# mirrors, the shards, are free slices of the full result. The pure part of each
# arrow is a function of its own, so the notebook runs them in one process.

def dp_gather(update_shard, dp, ledger):
    """Every DP rank's update shard -> the whole bucket: the shards joined in DP rank order."""
    return all_gather(update_shard, dp, ledger, "DP gather")


def matrix_in_bucket(bucket, meta):
    """One TP-local matrix of a whole bucket: a view of its range, no copy."""
    return bucket[slice(*meta.bucket_range)].view(meta.shape)


def join_tp_pieces(pieces, tp_split_dim):
    """The pure part of tp_gather: the TP pieces, in TP rank order -> the full matrix."""
    return torch.cat(pieces, dim=tp_split_dim) if tp_split_dim >= 0 else pieces[0]


def tp_gather(tp_local, tp_split_dim, tp, ledger):
    """TP pieces of one matrix -> the full matrix, joined along tp_split_dim."""
    if tp_split_dim < 0 or tp.size == 1:
        return tp_local
    pieces = all_gather(tp_local.reshape(-1), tp, ledger, "TP gather").view(tp.size, *tp_local.shape)
    return join_tp_pieces(pieces.unbind(0), tp_split_dim)


def tp_shard(full, tp_split_dim, tp_rank, tp_size):
    """Full tensor -> TP rank tp_rank's piece (a slice: no communication)."""
    if tp_split_dim < 0 or tp_size == 1:
        return full
    return full.chunk(tp_size, dim=tp_split_dim)[tp_rank]


def dp_shard(tp_local, meta):
    """TP piece of a matrix -> the part in this rank's DP shard (a slice: no communication)."""
    return tp_local.reshape(-1)[meta.param_slice]


def shard_of_bucket(parts, metas, shard_numel, dtype, device):
    """This DP rank's shard of a bucket from its parts ({name: flat part}), the mirror of dp_shard:
    zeros where it has none (padding, or a parameter that has no gradient). A part that fills the
    whole shard (a matrix alone in its bucket) is the shard: used as it is, not copied."""
    present = [parts[m.name] for m in metas if m.name in parts]
    if len(present) == 1 and present[0].numel() == shard_numel and present[0].dtype == dtype:
        return present[0].reshape(-1)
    shard = torch.zeros(shard_numel, dtype=dtype, device=device)
    for meta in metas:
        if meta.name in parts:
            shard[meta.shard_slice] = parts[meta.name]
    return shard


def orthogonalize(name, full, group, ledger, blocks=None):
    """Newton-Schulz of one full matrix with its param group's options, its FLOPs counted in the ledger:
    torch.optim.Muon's call on the whole matrix, or block by block where `blocks` (None, or section 8's
    muon_large_runs.Blocks: LargeRuns is one) names the matrix."""
    if blocks is not None and name in blocks.blocks:
        return blocks.orthogonalize_by_blocks(name, full, group, ledger)
    with record_function("newton-schulz"):  # a label for profiler traces
        ortho = newton_schulz(full, group["ns_steps"], group["ns_coefficients"], group["eps"])
    ledger.record_compute(name, tuple(full.shape), newton_schulz_flops(full.shape, group["ns_steps"]))
    return ortho


def gather_newton_schulz_shard(update_shard, metas, group, grid, ledger, large_runs=None):
    """The gather flow for one bucket of matrices: {name: this rank's part of the orthogonalized matrix}.

        DP gather  ->  TP gather  ->  Newton-Schulz  ->  TP shard  ->  DP shard

    update_shard: this rank's DP shard of the bucket (bf16); metas: the matrices to orthogonalize.
    large_runs: None (torch's way), or the optimizer's muon_large_runs.LargeRuns, which orthogonalizes
    some matrices by blocks, and some on their TP pieces where they lie (no TP gather, no TP shard).
    """
    update_bucket = dp_gather(update_shard, grid.dp, ledger)  # DP gather: the whole bucket
    ortho_parts = {}
    for meta in metas:
        tp_local = matrix_in_bucket(update_bucket, meta)
        if large_runs is not None and meta.name in large_runs.gram:
            tp_piece = large_runs.orthogonalize_tp_piece(tp_local, meta, group, grid, ledger)
        else:
            full = tp_gather(tp_local, meta.tp_split_dim, grid.tp, ledger)  # TP gather
            ortho = orthogonalize(meta.name, full, group, ledger, large_runs)  # Newton-Schulz
            tp_piece = tp_shard(ortho, meta.tp_split_dim, grid.tp.rank, grid.tp.size)  # TP shard: a slice
        ortho_parts[meta.name] = dp_shard(tp_piece, meta)  # DP shard: a slice
    return ortho_parts


# =============================================================================
# 5. The step: DistributedMuon, the gather strategy
# =============================================================================
# One optimizer step as seen from one rank (DP=4, TP=2), bucket by bucket:
#
#   1. grads (TP-local)  --DP reduce-scatter (fp32)----> this rank's part of the summed gradient
#   2. gradient part     --momentum (lerp) / AdamW-----> update part (bf16) / new AdamW weights
#   3. update parts      --the gather flow (section 4)--> this rank's part of each orthogonalized matrix
#      then  part -= lr*wd*part + adjusted_lr * update     (the weight update, on the part only)
#   4. parts             --param all-gather (fp32)-----> every rank holds its full TP-local weights
#
# A rank's "part" of a parameter is the range of its flat TP piece whose state it
# keeps (dist_meta's local range). AdamW rides the same reduce-scatter and
# all-gather and needs no gather (elementwise). Buckets go one at a time through
# all four stages, so one bucket's temporaries are alive at a time (notes/08).


def check_ns_coefficients(param_groups):
    """Every Muon group's ns_coefficients as ns_coefficients_of reads them (section 1), kept as given:
    what torch.optim.Muon would take. A ValueError names the group."""
    for i, group in enumerate(param_groups):
        if group["algorithm"] == "muon":
            try:
                ns_coefficients_of(group["ns_coefficients"], group["ns_steps"])
            except ValueError as e:
                raise ValueError(f"param group {i}: {e}") from None


# What clip_qk_ (section 8.4) says, on every rank, when the optimizer was built without QK-clip.
QK_CLIP_OFF = ("QK-clip is off: construct the optimizer with qk_clip_tau (and row_layouts with q or k rows; the "
               "lesson's optimizers take both in large_runs=muon_large_runs.LargeRuns(...))")


class DistributedMuon(torch.optim.Optimizer):
    """ZeRO-1 x TP Muon (and AdamW for non-matrix parameters), the gather strategy; bit-identical to torch.

    params: as torch's optimizers take them: tensors, (name, tensor) pairs (named_parameters()), or param
        groups {"params": ..., "algorithm": "muon" | "adamw", ...options}; a group without an algorithm is
        Muon's, as torch.optim.Muon takes plain parameters. Each tensor is this rank's TP piece, the same on
        every DP rank; the same parameters in the same order on every rank (plain tensors are named by their
        index, as torch's state_dict numbers them).
    options (keywords): any option of torch.optim.Muon or torch.optim.AdamW, the default of every group
        whose algorithm takes it; a group's own options win, and what neither gives is torch's default
        (muon_checks.TORCH_OPTIONS, read from the installed torch). A Muon group's `eps` is Newton-Schulz's,
        as in torch.optim.Muon. What is not honoured bit for bit is refused (muon_checks.REFUSED).
    grid: from make_grid; tp_split_dims: {name: dim} of TP-split parameters (others are replicated); a group
        added later (add_param_group, on every rank) may carry its own as the key "tp_split_dims".
    bucket_size: largest bucket, in elements, before padding to a multiple of DP.
    Gradients are summed over DP. A parameter whose .grad is None on every rank is skipped, as torch
    skips it; one with a gradient on some ranks only gets zeros from the others, as DDP adds.
    large_runs: None (torch's behaviour), or a muon_large_runs.LargeRuns: what large runs add (fused QKV
        by blocks, Newton-Schulz on TP pieces, QK-clip), section 8, whose docstring says what each does;
        one per optimizer. The step calls it where a matrix is orthogonalized, where its update is
        applied, and after the step (clip_qk_).
    """

    strategy = "gather"
    owners = None  # the gather strategy has none: every rank that touches a matrix orthogonalizes it

    def __init__(self, params, *, grid, tp_split_dims=None, bucket_size=1 << 16, large_runs=None, **options):
        # by its fields, not its class: the GPU twin and another commit's lesson define their own Grid
        if not all(hasattr(grid, axis) for axis in ("rank", "dp", "tp", "world")):
            raise ValueError(f"grid must be the Grid of make_grid(dp, tp, rank) (got {type(grid).__name__})")
        check_options(str, options, bucket_size=bucket_size)
        self.grid, self.bucket_size, self.ledger, self.large_runs = grid, bucket_size, Ledger(), large_runs
        self.options, self.tp_split_dims = options, dict(tp_split_dims or {})
        super().__init__(params, {})  # each group's options are filled by add_param_group, per its algorithm
        self.device = self.param_groups[0]["params"][0].device
        self._lay_out()

    def add_param_group(self, param_group):
        """torch's, each option filled and checked per the group's algorithm (fill_param_group). Called after
        construction, on every rank alike (a collective decision, as construction is), the group joins the
        layout: its own buckets, and section 7's owners for its matrices, the others keeping theirs."""
        if not isinstance(param_group, dict):
            raise ValueError(f"a param group must be a dict with 'params' (got {type(param_group).__name__})")
        self.tp_split_dims.update(param_group.pop("tp_split_dims", {}))
        fill_param_group(param_group, self.options, len(self.param_groups))
        super().add_param_group(name_params(param_group, sum(len(g["params"]) for g in self.param_groups)))
        if hasattr(self, "layout"):
            self._lay_out()

    def _lay_out(self):
        """Index and check every parameter, plan the layout (buckets, dist_meta) and what the strategy and
        large_runs plan on it: at construction, and again when a param group is added."""
        grid = self.grid
        self.param_by_name, self.group_of, split_dims = index_named_params(self.param_groups, self.tp_split_dims)
        check_ns_coefficients(self.param_groups)
        self.muon_names = [n for n in self.param_by_name if self.group_of[n]["algorithm"] == "muon"]
        buffers = [[n for n in g["param_names"] if self._bucketed(n)] for g in self.param_groups]
        shapes = {n: tuple(p.shape) for n, p in self.param_by_name.items()}
        self.layout = plan_layout(buffers, shapes, split_dims, grid.dp.size, grid.tp.size, self.bucket_size)
        self.dist_metas = self.layout.metas[grid.dp.rank]
        if self.large_runs is not None:
            self.large_runs.plan(self)
        self._plan()
        self.parts = {n: self.part_of(n, grid.dp.rank) for n in self.param_by_name}
        if self.large_runs is not None:
            self.large_runs.plan_parts(self)

    # -- the step ------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ledger.step += 1
        self._stages(self._vote_on_gradients())
        return loss

    def _stages(self, active):
        """The four stages, bucket by bucket (section 7's strategies, muon_owners.py, schedule them otherwise)."""
        for bucket in self.layout.buckets:
            updates = self._update_state(self._reduce_bucket(bucket, active))  # 1, 2
            for name, ortho_part in self._orthogonalize_bucket(bucket, updates, active).items():  # 3
                self._apply_update(name, ortho_part)
            self._gather_bucket(bucket)  # 4

    def _vote_on_gradients(self):
        """The parameters with a gradient on some rank, the same set everywhere, and whether every rank can
        step: one tiny MAX all-reduce of a byte per parameter and one more, before anything moves. Had each
        rank decided alone, ranks could enter different collectives and wait forever; a rank that refuses (a
        group's option set or loaded since construction, a gradient of another shape) makes every rank
        raise, the highest such rank named, and nothing has changed."""
        problem = self._problem()
        votes = [p.grad is not None for p in self.param_by_name.values()] + [self.grid.rank + 1 if problem else 0]
        votes = all_reduce(torch.tensor(votes, dtype=torch.uint8, device=self.device), self.grid.world, self.ledger,
                           "grad presence", dist.ReduceOp.MAX).tolist()
        if votes[-1]:
            raise ValueError(problem or f"rank {votes[-1] - 1} refused the step (it raised why); nothing changed")
        return {n for n, present in zip(self.param_by_name, votes) if present}

    def _problem(self):
        """This rank's reason to refuse the step, or None: a group's options, or a gradient that is not the
        parameter's shape, dtype and device."""
        try:
            check_param_groups(self.param_groups)
            check_ns_coefficients(self.param_groups)
        except ValueError as e:
            return f"rank {self.grid.rank}: {e}"
        for name, p in self.param_by_name.items():
            g = p.grad
            if g is not None and (g.shape != p.shape or g.dtype != p.dtype or g.device != p.device):
                return (f"rank {self.grid.rank}: the gradient of {name} is {g.dtype} {tuple(g.shape)} on {g.device}; "
                        f"the parameter is {p.dtype} {tuple(p.shape)} on {p.device}")
        return None

    def _reduce_bucket(self, bucket, active):
        """Stage 1: {name: this rank's part of the gradient summed over DP} for the bucket's active parts."""
        grad_shard = reduce_scatter(self._grad_bucket(bucket), self.grid.dp, self.ledger, "grad reduce-scatter")
        return self._grad_parts(bucket, grad_shard, active)

    def _grad_bucket(self, bucket):
        """This rank's TP-local gradients laid out as the bucket (zeros where it has none, as DDP adds);
        a gradient that fills the bucket alone is used as it is, not copied."""
        grads = [self.param_by_name[n].grad for n in bucket.names]
        if (len(grads) == 1 and grads[0] is not None and grads[0].numel() == bucket.numel
                and grads[0].dtype == torch.float32):
            return grads[0].reshape(-1)
        grad_bucket = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
        for name in bucket.names:
            grad = self.param_by_name[name].grad
            if grad is not None:
                grad_bucket[slice(*self.dist_metas[name].bucket_range)] = grad.reshape(-1)
        return grad_bucket

    def _grad_parts(self, bucket, grad_shard, active):
        metas = [self.dist_metas[n] for n in bucket.names]
        return {m.name: grad_shard[m.shard_slice] for m in metas if m.local_numel and m.name in active}

    def _update_state(self, grads):
        """Stage 2, on this rank's parts only: AdamW updates its weights; Muon's momentum gives
        {matrix: its part of the Newton-Schulz input, bf16}."""
        updates = {}
        with record_function("state update"):  # momentum and AdamW: a label for profiler traces
            for name, grad in grads.items():
                p, group = self.param_by_name[name], self.group_of[name]
                state = self.state[p]
                if group["algorithm"] == "adamw":
                    if not state:
                        state.update(adamw_state(grad.numel(), group, grad.device))
                    adamw_step_(p.view(-1)[self.parts[name]], grad, state, group)
                else:
                    if not state:  # momentum of this rank's part only: it never exists for the whole matrix
                        state["momentum_buffer"] = grad.new_zeros(grad.numel())
                    updates[name] = muon_update(state["momentum_buffer"], grad, group)
        return updates

    def _orthogonalize_bucket(self, bucket, updates, active):
        """Stage 3 for one bucket: {matrix: this rank's part of newton_schulz(the full matrix)}."""
        group = self.param_groups[bucket.buffer_idx]
        if group["algorithm"] != "muon":
            return {}
        metas = [self.dist_metas[n] for n in bucket.names]
        update_shard = shard_of_bucket(updates, metas, bucket.numel // self.grid.dp.size, torch.bfloat16,
                                       self.device)
        # Only the matrices this rank's DP shard touches (its TP peers share that shard,
        # so they agree) and that some rank has a gradient for.
        touched = [m for m in metas if m.local_numel and m.name in active]
        return gather_newton_schulz_shard(update_shard, touched, group, self.grid, self.ledger, self.large_runs)

    def _apply_update(self, name, ortho_part):
        """The end of stage 3: Muon's weight update, on this rank's part of the matrix."""
        runs = self.large_runs.runs.get(name) if self.large_runs is not None else None
        apply_muon_update_(self.param_by_name[name].view(-1)[self.parts[name]], ortho_part, self.group_of[name],
                           self.layout.global_shapes[name], runs)

    def _gather_bucket(self, bucket):
        """Stage 4 for one bucket: the parameter all-gather; every DP rank again holds its full TP pieces."""
        self._copy_in(bucket, all_gather(self._param_shard(bucket), self.grid.dp, self.ledger, "param all-gather"))

    def _param_shard(self, bucket):
        metas = [self.dist_metas[n] for n in bucket.names]
        parts = {m.name: self.param_by_name[m.name].view(-1)[m.param_slice] for m in metas}
        return shard_of_bucket(parts, metas, bucket.numel // self.grid.dp.size, torch.float32, self.device)

    def _copy_in(self, bucket, param_bucket):
        for name in bucket.names:
            self.param_by_name[name].view(-1).copy_(param_bucket[slice(*self.dist_metas[name].bucket_range)])

    # -- after the step: QK-clip (section 8.4) -------------------------------
    @torch.no_grad()
    def clip_qk_(self, max_logits):
        """QK-clip, called by every rank after step() (collective): muon_large_runs.LargeRuns.clip_qk_ says
        what it takes, scales and returns. Refused on every rank when the optimizer has no qk_clip_tau."""
        if self.large_runs is None:  # off: every rank still sends what LargeRuns.clip_qk_ would, and all refuse
            all_reduce(torch.tensor([self.grid.rank + 1.0], device=self.device), self.grid.world, self.ledger,
                       "QK-clip maxima", dist.ReduceOp.MAX)
            raise ValueError(f"rank {self.grid.rank}: {QK_CLIP_OFF}")
        return self.large_runs.clip_qk_(self, max_logits)

    # -- what the layout holds, and what section 7's strategies plan differently --
    def _bucketed(self, name):
        """Whether ZeRO-1's flat buckets hold this parameter: all of them here."""
        return True

    def _plan(self):
        """Anything to plan once the layout is known: nothing for the gather strategy."""

    def part_of(self, name, dp_rank):
        """The part of `name` that DP rank `dp_rank` keeps state for, as a slice of the flat TP piece."""
        return self.layout.metas[dp_rank][name].param_slice

    # -- checkpoints: ZeRO-1's are per rank, and belong to one layout --------
    def _checkpoint_layout(self):
        return dict(dp=self.grid.dp.size, tp=self.grid.tp.size, dp_rank=self.grid.dp.rank,
                    tp_rank=self.grid.tp.rank, bucket_size=self.bucket_size, strategy=self.strategy,
                    owners=self.owners)

    def state_dict(self):
        """This rank's shard of the state."""
        sd = super().state_dict()
        sd["layout"] = self._checkpoint_layout()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        saved, here = state_dict.pop("layout", None), self._checkpoint_layout()
        if saved != here:
            diff = ", ".join(f"{k} {saved.get(k) if saved else None} != {v}" for k, v in here.items()
                             if not saved or saved.get(k) != v)
            raise ValueError(f"state_dict was saved for another shard layout: {diff}")
        super().load_state_dict(state_dict)

    def state_bytes(self):
        """Bytes of optimizer state this rank holds (momentum; AdamW moments and steps)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if torch.is_tensor(t))


# =============================================================================
# 6. Run it
# =============================================================================
# Every one of the DP x TP processes runs run_rank, at the end of this section,
# top to bottom:
#
#   join the world (init_process_group) -> the grid (section 2)
#     -> its TP pieces of the demo model (below) -> the optimizer (section 5)
#     -> the steps, each fed this DP rank's own gradients
#     -> every rank's pieces to rank 0, which runs torch.optim.Muon / torch.optim.AdamW
#        on one device, fed the gradients summed over DP, and compares (torch.equal)
#
# Something else starts the processes and tells each who it is: torchrun on a GPU
# cluster, here muon_tools.spawn_ranks, a torchrun for one machine (and tooling:
# a free port, heartbeats, Ctrl-C, a dead or frozen rank named in one line). Both
# set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every process, which
# init_process_group reads.
#
# The demo model is a small transformer that exercises every case the optimizer
# must handle: Muon matrices tall, square and wide, split by TP along dim 0
# (column-parallel), dim 1 (row-parallel) or not at all (an MoE router); AdamW, as
# in practice, for the embedding and head (split by vocabulary), and without
# weight decay for norms, biases and a 0-dim scalar.
#
# Gradients differ per DP rank (each saw different data) and agree across a TP
# row (pieces of one gradient). They are integers times 2**-10 in [-1/4, 1/4]:
# any sum of up to MAX_WORLD of them is a multiple of 2**-10 below 2**4, exact in
# float32, so the DP reduction gives the same bits in any order (real gradients
# would make bit-identity impossible for a reason unrelated to Muon).

VOCAB, D_MODEL, N_LAYERS, N_EXPERTS, N_HEADS = 512, 128, 2, 8, 8
GRAD_SCALE = 2.0**-10
GRAD_MAX_INT = 256  # |gradient| <= 256 * 2**-10 = 1/4


@dataclass(frozen=True)
class ParamSpec:
    name: str
    global_shape: tuple
    tp_split_dim: int  # -1: the same full tensor on every TP rank
    group: str  # "muon", "adamw" or "adamw_no_wd"


def transformer_specs(vocab=VOCAB, d=D_MODEL, n_layers=N_LAYERS, n_experts=N_EXPERTS):
    specs = [ParamSpec("embed.weight", (vocab, d), 0, "adamw")]
    for i in range(n_layers):
        p = f"layers.{i}."
        specs += [
            ParamSpec(p + "norm1.weight", (d,), -1, "adamw_no_wd"),
            ParamSpec(p + "attn.qkv.weight", (3 * d, d), 0, "muon"),  # tall, column-parallel
            ParamSpec(p + "attn.qkv.bias", (3 * d,), 0, "adamw_no_wd"),
            ParamSpec(p + "attn.proj.weight", (d, d), 1, "muon"),  # square, row-parallel
            ParamSpec(p + "attn.proj.bias", (d,), -1, "adamw_no_wd"),
            ParamSpec(p + "norm2.weight", (d,), -1, "adamw_no_wd"),
            ParamSpec(p + "router.weight", (n_experts, d), -1, "muon"),  # wide, never split
            ParamSpec(p + "mlp.fc1.weight", (4 * d, d), 0, "muon"),
            ParamSpec(p + "mlp.fc1.bias", (4 * d,), 0, "adamw_no_wd"),
            ParamSpec(p + "mlp.fc2.weight", (d, 4 * d), 1, "muon"),  # wide, row-parallel
            ParamSpec(p + "mlp.fc2.bias", (d,), -1, "adamw_no_wd"),
        ]
    specs += [ParamSpec("final_norm.weight", (d,), -1, "adamw_no_wd"),
              ParamSpec("logit_scale", (), -1, "adamw_no_wd"),  # a 0-dim tensor
              ParamSpec("lm_head.weight", (vocab, d), 0, "adamw")]
    return specs


def initial_params(specs, seed):
    """The full single-device parameters every run starts from."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in specs:
        if s.name.endswith("norm1.weight") or s.name.endswith("norm2.weight") or s.name == "final_norm.weight":
            out[s.name] = torch.ones(s.global_shape)
        elif s.name.endswith(".bias"):
            out[s.name] = torch.zeros(s.global_shape)
        else:
            out[s.name] = torch.randn(s.global_shape, generator=g) * 0.02
    return out


def dp_rank_grads(specs, seed, step, dp_rank, missing=()):
    """Full gradients that DP rank `dp_rank` computed at `step`. missing: (name, dp_rank or -1 for
    every rank, step) whose gradient is None (a frozen embedding, an expert no token reached)."""
    g = torch.Generator().manual_seed((seed * 100_003 + step) * 1_009 + dp_rank)
    grads = {s.name: torch.randint(-GRAD_MAX_INT, GRAD_MAX_INT + 1, s.global_shape, generator=g).float() * GRAD_SCALE
             for s in specs}  # drawn for every parameter, so a missing one changes no other draw
    for name, rank, at in missing:
        if at == step and rank in (-1, dp_rank):
            grads[name] = None
    return grads


FUSED_QKV = "attn.qkv.weight"  # the demo's fused QKV matrices end so: laid out head by head, as Megatron's


def dp_rank_max_logits(specs, seed, step, dp_rank):
    """{fused QKV name: the largest logit of each of its N_HEADS heads in DP rank dp_rank's forward at
    `step`} (float32): for section 8's QK-clip, what a forward pass would report, drawn as the gradients
    are. Head h's lies in [0.75, 1.25] x 25 (h + 1): with tau = 100 the first three heads never clip, the
    last three always do, and the two between depend on the step and the batch."""
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


def rank_piece(full, spec, grid, device):
    """This rank's TP piece of a full tensor of `spec` (a weight or its gradient), on `device`; None stays None."""
    if full is None:
        return None
    return tp_shard(full, spec.tp_split_dim, grid.tp.rank, grid.tp.size).contiguous().to(device)


def run_steps(cfg, specs, build_optimizer, grid, device):
    """The steps, on a rank that has joined the world: {its final pieces, ledger, step times, state}.

    build_optimizer(grid, params) builds the optimizer over this rank's pieces {name: tensor}."""
    start = initial_params(specs, cfg.seed)
    params = {s.name: rank_piece(start[s.name], s, grid, device) for s in specs}
    opt = build_optimizer(grid, params)
    step_ms, qk_clip = [], []
    for step in range(1, cfg.steps + 1):
        if grid.rank == cfg.fail_rank:  # how the tests make a rank fail
            raise RuntimeError(f"injected failure on rank {grid.rank} at step {step} (--fail-rank)")
        grads = dp_rank_grads(specs, cfg.seed, step, grid.dp.rank, cfg.missing_grads)
        for s in specs:
            params[s.name].grad = rank_piece(grads[s.name], s, grid, device)
        dist.barrier()  # the ranks start the step together: the clock times the step alone
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":  # kernels and NCCL return before they finish: wait, then read the clock
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if cfg.qk_clip_tau is not None:  # section 8's QK-clip, after the step
            max_logits = dp_rank_max_logits(specs, cfg.seed, step, grid.dp.rank)
            qk_clip.append(opt.clip_qk_(computed_here(max_logits, grid.tp.rank, grid.tp.size)))
        if step == (cfg.steps + 1) // 2:
            # Resume from a checkpoint halfway: a fresh optimizer loads this rank's state_dict. Were
            # the state lost, the momentum would restart and the comparison with torch would fail.
            fresh = build_optimizer(grid, params)
            fresh.load_state_dict(opt.state_dict())
            fresh.ledger, opt = opt.ledger, fresh
    return dict(rank=grid.rank, params={n: p.detach().cpu() for n, p in params.items()}, ledger=asdict(opt.ledger),
                step_ms=step_ms, state_bytes=opt.state_bytes(), owners=opt.owners, qk_clip=qk_clip)


def max_abs_diff(got, expected):
    return (got.double() - expected.double()).abs().max().item() if got.shape == expected.shape else math.inf


def check_against_torch(specs, ranks, reference, tp, start=None):
    """One row per parameter: every rank's piece against the same piece of torch's result (torch.equal),
    the largest difference, and (given the parameters the run started from) how far torch moved the
    parameter, the scale of a difference of 0."""
    checks = []
    for s in specs:
        pairs = [(r["params"][s.name], tp_shard(reference[s.name], s.tp_split_dim, r["rank"] % tp, tp))
                 for r in ranks]
        checks.append(dict(name=s.name, identical=all(torch.equal(got, want) for got, want in pairs),
                           max_abs_diff=max(max_abs_diff(got, want) for got, want in pairs)))
        if start is not None:
            checks[-1]["max_abs_update"] = (reference[s.name] - start[s.name]).abs().max().item()
    return checks


def run_rank(cfg, specs, build_optimizer, torch_reference):
    """What every process runs: join, build, step, and (rank 0) check every rank's pieces against torch.

    cfg: the run's settings (muon_tools.RunConfig: the command line's flags): dp, tp, steps, seed, ...
    specs: the model's parameters (transformer_specs above, or the command line's --model).
    build_optimizer(grid, params): DistributedMuon (section 5) over this rank's pieces, or the strategy
        and options the command line asks for (sections 7 and 8).
    torch_reference(device): {name: the full parameter after cfg.steps steps of torch.optim.Muon /
        torch.optim.AdamW on one device, fed each step's gradients summed over DP}.
    Returns on rank 0 {"ranks": what run_steps returned on each rank, "checks": check_against_torch's
    rows, "reference_s": torch's time}; None on the others.
    """
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)  # bf16 matmul bits can depend on the thread count: one, as in torch's run
    # One GPU per process, cuda:LOCAL_RANK (torchrun sets it), set once. Rank 0 runs torch's reference on its
    # GPU too: tensor cores round bf16 matmuls otherwise than a CPU, so bit-identity holds device against device.
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NCCL runs the collectives on the GPUs themselves (NVLink, InfiniBand); device_id binds it to this GPU.
    dist.init_process_group(cfg.backend, timeout=datetime.timedelta(seconds=cfg.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    grid = make_grid(cfg.dp, cfg.tp, rank)
    mine = run_steps(cfg, specs, build_optimizer, grid, device)
    ranks = [None] * grid.world.size if rank == 0 else None
    dist.gather_object(mine, ranks, dst=0)  # every rank's pieces, ledger and times, to rank 0
    dist.destroy_process_group()
    if rank != 0:
        return None
    t0 = time.perf_counter()
    reference = torch_reference(device)
    checks = check_against_torch(specs, ranks, reference, cfg.tp, initial_params(specs, cfg.seed))
    return dict(ranks=ranks, checks=checks, reference_s=time.perf_counter() - t0)


if __name__ == "__main__":
    # torchrun started this process, one of DP x TP, and set its RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
    # and MASTER_PORT: no launcher of ours. The tooling checks the flags (rank 0 says what is wrong), rank 0
    # prints the plan, this file's run_rank runs, and rank 0 prints the report.
    import muon_tools

    sys.exit(muon_tools.main_under_torchrun(run_rank))
