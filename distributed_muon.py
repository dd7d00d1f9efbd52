"""Distributed Muon, ZeRO-1 x tensor parallel, on GPUs over NCCL: one process per GPU, started by torchrun.
(Made from distributed_muon_cpu.py by tools/gpu_twin.py, never by hand: diff the two to see what GPUs change.)

Muon (MomentUm Orthogonalized by Newton-Schulz) replaces the momentum of every 2-D weight by its nearest
semi-orthogonal matrix. Newton-Schulz needs the WHOLE matrix, but distributed training shards every matrix twice:
tensor parallelism (TP) splits a weight across the TP ranks of a row of the grid, and ZeRO-1 flattens the TP-local
weights into buckets and splits each bucket across the data-parallel (DP) ranks, so that each rank keeps optimizer
state for its 1/DP slice only. This script puts each matrix back together, orthogonalizes it, and hands every rank
exactly its piece:

    DP gather  ->  TP gather  ->  Newton-Schulz  ->  TP shard  ->  DP shard

then checks every parameter, bit for bit (torch.equal), against PyTorch's own single-device torch.optim.Muon and
torch.optim.AdamW fed the same total gradient.

Launch recipes (DP = processes / TP unless --dp says otherwise)
--------------
    torchrun --standalone --nproc-per-node 8 distributed_muon.py --tp 2       # 8 GPUs, DP=4 x TP=2
    torchrun --standalone --nproc-per-node 8 distributed_muon.py --tp 2 --strategy owner --explain
    torchrun --standalone --nproc-per-node 4 distributed_muon.py --backend gloo --device cpu --tp 2  # no GPU
    python distributed_muon.py --help                   # every flag, the other strategies' and options' too

Reading order: 1. Muon on one device, 2. the grid and its collectives, 3. the virtual buffer, 4. the gather flow,
5. the step, 6. run it; then distmuon/owners.py (7) and distmuon/large_runs.py (8). This file is the core of the
library (`pip install .`, then `from distmuon import DistributedMuon`); the runner, muon_tools.py, runs it.
"""

from __future__ import annotations

if __name__ == "__main__":  # torchrun started this process, one of DP x TP: the runner checks the flags, runs run_rank
    import muon_forkserver  # no torch in it: the ranks' forkserver starts importing torch now, beside this process

    muon_forkserver.start_command()
    import muon_tools

    raise SystemExit(muon_tools.main_under_torchrun("distributed_muon"))  # this file's run_rank, the GPUs' lesson

import datetime
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch.profiler import record_function

# From the library, below this file: AdamW's math for what Muon does not take, Gloo's reduce-scatter in rank
# order, the Ledger, a param group added whole or not at all, and what the optimizer refuses.
from distmuon.adamw import adamw_state, adamw_step_, scalar_lr
from distmuon.collectives import all_gather_single, reduce_scatter_sum
from distmuon.rules import add_or_refuse_group, copy_sharing
from distmuon.ledger import Ledger
from distmuon.normuon import check_rows_held
from distmuon.checks import (ORTHOGONALIZED, QK_CLIP_OFF, check_grid, check_options, check_step_arguments,
                             checked_zero1_state_dict, index_named_params, ns_coefficients_of, step_device,
                             step_problem, torch_defaults)

# =============================================================================
# 1. Muon on one device
# =============================================================================
# torch.optim.Muon's step for one 2-D parameter P with gradient G (torch/optim/_muon.py), in five lines:
#
#   B <- B + (1 - mu) (G - B)                  momentum buffer (torch's lerp form)
#   U <- G + mu (B - G)   (Nesterov; else B)   what Newton-Schulz orthogonalizes
#   O <- NewtonSchulz(U)                       its nearest semi-orthogonal matrix, in bf16
#   P <- P (1 - lr wd) - adjusted_lr(lr, shape) O    decoupled weight decay, a learning rate for the shape
#
# All but Newton-Schulz is elementwise: a rank can run it on any slice of P and get the whole tensor's bits.
# Newton-Schulz needs the whole matrix: sections 2-5 get it to one place. The code is torch's, operation for
# operation, so the result can be bit-identical: cast to bf16 (a tall matrix transposed, so that X X^T is the small
# one), scale by the Frobenius norm (clamped by eps) so the spectral norm is <= 1, then quintic iterations
# X <- a X + (b A + c A A) X, A = X X^T, with Keller Jordan's coefficients, 5 steps and eps = 1e-7, torch's defaults
# (a param group's ns_coefficients may give one (a, b, c) per iteration instead).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz(matrix, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, eps=NS_EPS, fused_mm=torch.addmm,
                  dtype=torch.bfloat16):
    """Approximately orthogonalize a full (rows, cols) matrix; returns bfloat16 (dtype). With fused_mm = torch.addmm
    (beta * input + alpha * m1 @ m2 in one call) these are exactly torch.optim.Muon's operations, hence its bits.
    coefficients: one (a, b, c), or one per iteration; dtype float64: the same iteration without bf16's rounding."""
    x = matrix.to(dtype)
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # out of place: a bf16 input is not modified
    for a, b, c in ns_coefficients_of(coefficients, steps):
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
    """Update the momentum buffer in place and return the Newton-Schulz input (elementwise: a shard gets the
    whole matrix's bits)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def adjusted_lr(lr, adjust_lr_fn, global_shape):
    """Muon's per-matrix learning rate, from the FULL (TP-gathered) shape (rows, cols): torch.optim.Muon's three."""
    rows, cols = global_shape
    if adjust_lr_fn in (None, "original"):  # Keller Jordan's; torch's default
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":  # Moonlight's ("Muon is Scalable for LLM Training")
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":  # below 1 for wide matrices
        return lr * math.sqrt(rows / cols)
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}")


def muon_update(momentum_buffer, grad, group):
    """Muon's momentum, then the bf16 cast Newton-Schulz does first anyway (half the bytes to move, no bit changed)."""
    return muon_momentum_(momentum_buffer, grad, group["momentum"], group["nesterov"]).bfloat16()


def apply_muon_update_(param, ortho, group, global_shape, runs=None):
    """p <- p (1 - lr wd) - adjusted_lr(global shape) O, as torch.optim.Muon: the decay takes the unadjusted lr.
    runs: None, or [(start, stop, rows)]: elements [start, stop) lie in blocks of `rows` rows, each adjusted for
    its own shape (rows, cols), one add_ per run, as torch adjusts blocks stepped as parameters."""
    lr = scalar_lr(group["lr"])  # a float, or a Tensor lr as torch reads it
    param.mul_(1 - lr * group["weight_decay"])
    if runs is None:
        param.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], global_shape))
    for start, stop, rows in runs or ():
        param[start:stop].add_(ortho[start:stop],
                               alpha=-adjusted_lr(lr, group["adjust_lr_fn"], (rows, global_shape[1])))


def muon_step_(param, grad, momentum_buffer, group):
    """torch.optim.Muon's step of one 2-D parameter on one device, with a param group's options: the step the rest
    of this file distributes. Only its middle line needs the whole matrix."""
    update = muon_update(momentum_buffer, grad, group)  # elementwise
    ortho = newton_schulz(update, group["ns_steps"], group["ns_coefficients"], group["eps"])  # the whole matrix
    apply_muon_update_(param, ortho, group, tuple(param.shape))  # elementwise


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
# The groups are sliced from torch.arange(world).view(DP, TP). Every rank must create every group, in the same
# order, even the groups it is not part of. Every collective goes through the functions below, which record in
# a Ledger (distmuon/ledger.py), in one line each, what this rank sends and receives: a ring's count, (n - 1) * k
# bytes each way for n ranks and k-byte shards, labelled with its phase. A vote lets every rank refuse together.

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


def plan_grid(dp, tp, rank):
    """The grid as `rank` sees it, without process groups: what a launcher plans with."""
    check_grid(dp, tp)
    grid = torch.arange(dp * tp).view(dp, tp)
    dp_rank, tp_rank = divmod(rank, tp)
    return Grid(rank=rank, dp=Axis("DP", dp, dp_rank, tuple(grid[:, tp_rank].tolist())),
                tp=Axis("TP", tp, tp_rank, tuple(grid[dp_rank].tolist())),
                world=Axis("world", dp * tp, rank, tuple(range(dp * tp))))


def make_grid(dp, tp, rank):
    """Build the DP and TP process groups. Collective: call on every rank."""
    check_grid(dp, tp, dist.get_world_size())
    plan, grid = plan_grid(dp, tp, rank), torch.arange(dp * tp).view(dp, tp)
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in grid.tolist() + grid.T.tolist()}  # rows, then columns
    return replace(plan, dp=replace(plan.dp, group=groups[plan.dp.ranks]),
                   tp=replace(plan.tp, group=groups[plan.tp.ranks]), world=replace(plan.world, group=dist.group.WORLD))


def all_gather(shard, axis, ledger, phase):
    """Concatenate every rank's equal-sized 1-D shard along `axis`: (size * k,)."""
    if axis.size == 1:
        return shard
    out = shard.new_empty(axis.size * shard.numel())
    with record_function(phase):  # a label for profiler traces
        all_gather_single(out, shard, group=axis.group)
    ledger.record_ring(phase, "all_gather", axis, shard)
    return out


def reduce_scatter(bucket, axis, ledger, phase):
    """Sum `bucket` over the ranks of `axis` and keep this rank's 1/size of it (on Gloo, in rank order)."""
    if axis.size == 1:
        return bucket
    with record_function(phase):
        work, shard = reduce_scatter_sum(bucket, axis)
        work.wait()
    ledger.record_ring(phase, "reduce_scatter", axis, bucket[:bucket.numel() // axis.size])
    return shard()


def all_reduce(tensor, axis, ledger, phase, op=dist.ReduceOp.SUM):
    """Reduce `tensor` in place over the ranks of `axis` (SUM or MAX), counted as a ring all-reduce."""
    if axis.size == 1:
        return tensor
    with record_function(phase):
        dist.all_reduce(tensor, op=op, group=axis.group)
    ring = 2 * (axis.size - 1) * -(-tensor.numel() // axis.size)
    ledger.record_comm(phase, "all_reduce", axis, ring, ring, tensor.dtype)
    return tensor


def vote(flags, problem, me, axis, ledger, phase):
    """Each flag ORed over the ranks of `axis`, and one more byte: whether some rank has a `problem` (one line). If one
    has, every rank raises before anything moves, naming that rank (found by one more MAX all-reduce, of the rank)."""
    votes = torch.cat([flags, torch.tensor([problem is not None], device=flags.device)]).to(torch.uint8)
    votes = all_reduce(votes, axis, ledger, phase, dist.ReduceOp.MAX).bool()
    if votes[-1]:
        rank = torch.tensor([me + 1 if problem else 0], dtype=torch.int64, device=flags.device)
        rank = int(all_reduce(rank, axis, ledger, "refusal", dist.ReduceOp.MAX)) - 1
        raise ValueError(f"rank {me}: {problem}" if problem else
                         f"rank {rank} refused the step (it raised why); nothing changed")
    return votes[:-1]


# =============================================================================
# 3. The virtual buffer
# =============================================================================
# ZeRO-1 sees a param group's TP-local parameters as one flat "virtual buffer", cut into buckets of at most
# bucket_size elements (a larger parameter gets a bucket of its own). Each bucket is padded to a multiple of
# DP, and DP rank r keeps the r-th of its DP equal shards:
#
#   bucket (buffer 0, bucket 0), DP = 4, shard = L elements
#   |<---- qkv.weight ---->|<- proj.weight ->|<router>|pad|
#   |<--- DP 0 --->|<--- DP 1 --->|<--- DP 2 --->|<--- DP 3 --->|
#   0              L              2L             3L             4L
#
# A parameter may straddle shards (qkv.weight: DP 0 and DP 1); a rank's state covers only its part (`local_range`,
# maybe empty). A DistMeta per parameter and rank (the Moonshot PoC's MuonDistMeta names) says where it lies: a pure
# function of shapes, DP and bucket size: every rank computes the same one without talking (notes/02-virtual-buffer.md).


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
    def param_slice(self):  # the local range, as a slice of the flattened TP-local parameter
        return slice(self.local_range[0] - self.bucket_range[0], self.local_range[1] - self.bucket_range[0])

    @property
    def shard_slice(self):  # the local range, as a slice of this DP rank's shard
        return slice(self.local_range[0] - self.shard_start, self.local_range[1] - self.shard_start)


def plan_buckets(buffers, dp, bucket_size):
    """buffers: one list per param group of (name, numel). Returns (buckets, bucket_ranges)."""
    buckets, bucket_ranges = [], {}
    for buffer_idx, entries in enumerate(buffers):
        current, used = [], 0

        def close():
            if current:
                buckets.append(Bucket(buffer_idx, sum(b.buffer_idx == buffer_idx for b in buckets), tuple(current),
                                      used, -(-used // dp) * dp))

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
    return tuple(size * tp if dim == tp_split_dim else size for dim, size in enumerate(local_shape))


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


def shard_of_bucket(parts, metas, shard_numel, dtype, device):
    """This DP rank's shard of a bucket from its parts ({name: flat part}): zeros where it has none (padding, or a
    parameter with no gradient). A part that fills the whole shard is the shard, not copied."""
    present = [parts[m.name] for m in metas if m.name in parts]
    if len(present) == 1 and present[0].numel() == shard_numel and present[0].dtype == dtype:
        return present[0].reshape(-1)
    shard = torch.zeros(shard_numel, dtype=dtype, device=device)
    for meta in metas:
        if meta.name in parts:
            shard[meta.shard_slice] = parts[meta.name]
    return shard


# =============================================================================
# 4. The gather flow
# =============================================================================
# The heart of the step, for one bucket of Muon matrices. Each rank holds its DP shard of the bucket's update
# (bf16: its part of every matrix the shard touches) and needs its part of newton_schulz(the FULL matrix):
#
#   update shard       --DP gather (all-gather)------> every TP-local matrix of the bucket
#   TP-local matrix    --TP gather (along split dim)-> the full matrix  [only where this rank has a part]
#   full matrix        --Newton-Schulz---------------> orthogonal full matrix
#   orthogonal matrix  --TP shard (slice)------------> its TP piece
#   TP piece           --DP shard (slice)------------> this rank's part
#
# The DP gather is one flat all-gather per bucket (every matrix a view of it); the TP gather is per matrix,
# along its own split dim, for the matrices this rank's DP shard touches (notes/04-bucketing.md). The gathers
# communicate; their mirrors, the shards, are free slices. Last, the gather strategy: the flow bucket by bucket.

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


def orthogonalize(name, full, group, ledger, ns_function=None):
    """Newton-Schulz of one full matrix with its group's options (or ns_function, given the same), its FLOPs counted."""
    with record_function("newton-schulz"):
        ortho = (ns_function or newton_schulz)(full, group["ns_steps"], group["ns_coefficients"], group["eps"])
    ledger.record_compute(name, tuple(full.shape), newton_schulz_flops(full.shape, group["ns_steps"]))
    return ortho


def orthogonalize_tp_local(tp_local, meta, group, grid, ledger, newton_schulz_of=orthogonalize):
    """The three middle arrows for one matrix: its TP-local piece -> this TP rank's piece of newton_schulz_of(full)."""
    full = tp_gather(tp_local, meta.tp_split_dim, grid.tp, ledger)  # TP gather
    ortho = newton_schulz_of(meta.name, full, group, ledger)  # Newton-Schulz
    return tp_shard(ortho, meta.tp_split_dim, grid.tp.rank, grid.tp.size)  # TP shard: a slice


def gather_newton_schulz_shard(update_shard, metas, group, grid, ledger, middle=orthogonalize_tp_local):
    """The gather flow for one bucket of matrices: {name: this rank's part of the orthogonalized matrix}.

        DP gather  ->  TP gather  ->  Newton-Schulz  ->  TP shard  ->  DP shard

    update_shard: this rank's DP shard of the bucket (bf16); metas: the matrices to orthogonalize; middle: the three
    middle arrows for one matrix, (tp_local, meta, group, grid, ledger) -> its TP piece.
    """
    update_bucket = dp_gather(update_shard, grid.dp, ledger)  # DP gather: the whole bucket
    return {meta.name: dp_shard(middle(matrix_in_bucket(update_bucket, meta), meta, group, grid, ledger), meta)
            for meta in metas}  # the three middle arrows, then DP shard: a slice


@dataclass(frozen=True)
class Unit:
    """What the stages of a step take at once: ZeRO-1 buckets, and a strategy's own chunks of matrices, if any."""

    buckets: tuple = ()
    chunks: tuple = ()  # tuples of names outside the buckets, which stages 1 and 4 ask the strategy for

    @property
    def names(self):
        return tuple(n for b in self.buckets for n in b.names) + tuple(n for c in self.chunks for n in c)


class Gather:
    """The gather strategy (a distmuon/strategy.py Strategy): the flow above by buckets; middle: its 3 middle arrows."""

    name, owners, overlap = "gather", None, 0  # every rank that touches a matrix orthogonalizes it, in turn
    orthogonalizes_once = holds_rows = False  # so not once, nor by one rank that holds its whole rows (see plan)
    own_options = ()  # no keywords of its own beyond the optimizer's
    phases = ("grad presence", "grad reduce-scatter", "DP gather", "TP gather", "param all-gather")  # recorded in order

    def __init__(self, middle=orthogonalize_tp_local):
        self.middle = middle

    def plan(self, opt):  # refused: an algorithm whose rows only a whole matrix's holder sees
        check_rows_held(opt.param_groups, self.name)

    def bucketed(self, opt, name):
        return True

    def part_of(self, opt, name, dp_rank):
        return opt.layout.metas[dp_rank][name].param_slice

    def units(self, opt):
        return [Unit(buckets=(b,)) for b in opt.layout.buckets]

    def stages(self, opt, active):
        opt.stages_in_turn(active)

    def runs_of(self, name):
        return None

    def orthogonalize(self, opt, unit, updates, active):
        parts = {}
        for bucket in unit.buckets:
            group = opt.param_groups[bucket.buffer_idx]
            if group["algorithm"] != "muon":
                continue
            metas = [opt.dist_metas[n] for n in bucket.names]
            shard = shard_of_bucket(updates, metas, bucket.numel // opt.grid.dp.size, torch.bfloat16, opt.device)
            # Only the matrices this rank's DP shard touches (its TP peers share that shard, so they agree) and
            # that some rank has a gradient for.
            touched = [m for m in metas if m.local_numel and m.name in active]
            parts.update(gather_newton_schulz_shard(shard, touched, group, opt.grid, opt.ledger, self.middle))
        return parts

    def clip_qk_(self, opt, max_logits):  # every rank still takes part in a collective, as the others may, and refuses
        all_reduce(torch.tensor([opt.grid.rank + 1.0], device=opt.device), opt.grid.world, opt.ledger,
                   "QK-clip maxima", dist.ReduceOp.MAX)
        raise ValueError(f"rank {opt.grid.rank}: {QK_CLIP_OFF}")


# =============================================================================
# 5. The step: DistributedMuon, with the gather strategy plugged in
# =============================================================================
# One optimizer step as seen from one rank (DP=4, TP=2), one unit (here: one bucket) at a time:
#
#   1. grads (TP-local)  --DP reduce-scatter (fp32)-----> this rank's part of the summed gradient
#   2. gradient part     --momentum (lerp) / AdamW------> update part (bf16) / new AdamW weights
#   3. update parts      --the strategy (section 4)-----> this rank's part of each orthogonalized matrix
#      then  part -= lr*wd*part + adjusted_lr * update      (the weight update, on the part only)
#   4. parts             --param all-gather (fp32)------> every rank holds its full TP-local weights
#
# A rank's "part" of a parameter is the range of its flat TP piece whose state it keeps (dist_meta's local range).
# AdamW rides the same reduce-scatter and all-gather and needs no gather (elementwise). The strategy plugged in (its
# calls: distmuon/strategy.py) says where each matrix is orthogonalized: here, section 4's flow, a bucket at a time.


class DistributedMuon(torch.optim.Optimizer):
    """ZeRO-1 x TP Muon (and AdamW for non-matrix parameters); bit-identical to torch.

    params: as torch's optimizers take them: tensors, (name, tensor) pairs, or param groups {"params": ...,
        "algorithm": "muon" | "adamw", ...options} ("muon" if not given); each tensor this rank's TP piece, the same
        parameters in the same order on every rank (plain tensors named by their index, as torch's state_dict).
    options (keywords): any option of torch.optim.Muon or torch.optim.AdamW, the default of every group that takes
        it; a group's own options win, then torch's defaults. What is not honoured bit for bit is refused.
    grid: from make_grid; tp_split_dims: {name: dim} of TP-split parameters (a group added later may carry its own
        under the key "tp_split_dims"); bucket_size: largest bucket, in elements, before padding to DP.
    strategy: where each matrix is orthogonalized: strategy_class() (None), or another Strategy (distmuon/strategy.py);
    large_runs: None, or a LargeRuns, which wraps the strategy (large_runs.around(strategy)), one per optimizer.
    Gradients are summed over DP. A parameter whose .grad is None on every rank is skipped, as torch skips it; one
    with a gradient on some ranks only gets zeros from the others, as DDP adds.
    """
    strategy_class = Gather  # the strategy plugged in when none is given (a subclass plugs in its own)

    def __init__(self, params, *, grid, tp_split_dims=None, bucket_size=1 << 16, strategy=None, large_runs=None,
                 **options):
        # by its fields, not its class: the GPU twin and another commit's lesson define their own Grid
        if not all(hasattr(grid, axis) for axis in ("rank", "dp", "tp", "world")):
            raise ValueError(f"grid must be the Grid of make_grid(dp, tp, rank) (got {type(grid).__name__})")
        check_options(str, options, bucket_size=bucket_size)
        check_step_arguments(tp_split_dims=tp_split_dims, strategy=strategy, large_runs=large_runs)
        self.grid, self.bucket_size, self.ledger = grid, bucket_size, Ledger()
        self.large_runs, self.strategy = large_runs, strategy or self.strategy_class()
        self.strategy = self.strategy if large_runs is None else large_runs.around(self.strategy)
        self.options, self.tp_split_dims = options, dict(tp_split_dims or {})
        super().__init__(params, {})  # each group's options are filled by add_param_group, per its algorithm
        self.defaults = torch_defaults(self.param_groups, options)  # torch's optimizer's, which schedulers read
        self.device = step_device(self.param_groups)
        self._lay_out()

    def add_param_group(self, param_group):
        """torch's, each option filled and checked per the group's algorithm. After construction (on every rank
        alike), the group joins the layout: buckets of its own, the strategy's plan for its matrices, the others
        keeping theirs. Refused, it changes nothing (distmuon.rules)."""
        add_or_refuse_group(self, param_group, super().add_param_group, self.options,
                            self._lay_out if hasattr(self, "layout") else None,  # at construction: laid out after it
                            lambda group: self.tp_split_dims.update(group.pop("tp_split_dims", {})),
                            dict(tp_split_dims=dict(self.tp_split_dims)))

    def _lay_out(self):
        """Index and check every parameter, plan the layout (buckets, dist_meta) and the strategy's plan on it."""
        grid = self.grid
        self.param_by_name, self.group_of, split_dims = index_named_params(self.param_groups, self.tp_split_dims)
        self.muon_names = [n for n in self.param_by_name if self.group_of[n]["algorithm"] in ORTHOGONALIZED]
        buffers = [[n for n in g["param_names"] if self.strategy.bucketed(self, n)] for g in self.param_groups]
        shapes = {n: tuple(p.shape) for n, p in self.param_by_name.items()}
        self.layout = plan_layout(buffers, shapes, split_dims, grid.dp.size, grid.tp.size, self.bucket_size)
        self.dist_metas = self.layout.metas[grid.dp.rank]
        self.strategy.plan(self)
        self.owners = self.strategy.owners  # {matrix: the rank that orthogonalizes it}; None: every one that touches it
        self.parts = {n: self.strategy.part_of(self, n, grid.dp.rank) for n in self.param_by_name}

    # -- the step: the stages below, run by the strategy ---------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ledger.step += 1
        self.strategy.stages(self, self.vote_on_gradients())
        return loss

    def stages_in_turn(self, active):
        """The four stages, one unit at a time."""
        for unit in self.strategy.units(self):
            updates = self.update_state(self.reduce(unit, active))  # 1, 2
            for name, ortho_part in self.strategy.orthogonalize(self, unit, updates, active).items():  # 3
                self.apply_update(name, ortho_part)
            self.gather(unit, active)  # 4

    def vote_on_gradients(self):
        """The parameters with a gradient on some rank, the same set everywhere, voted on before anything moves (had
        each rank decided alone, ranks could enter different collectives and wait forever), and every refusal."""
        flags = torch.tensor([p.grad is not None for p in self.param_by_name.values()], device=self.device)
        votes = vote(flags, step_problem(self.param_groups, self.param_by_name), self.grid.rank, self.grid.world,
                     self.ledger, "grad presence")
        return {n for n, present in zip(self.param_by_name, votes.tolist()) if present}

    def reduce(self, unit, active):
        """Stage 1: {name: this rank's part of the gradient summed over DP}, bucket by bucket (chunks: the strategy's)."""
        grads = {}
        for bucket in unit.buckets:
            shard = reduce_scatter(self.grad_bucket(bucket), self.grid.dp, self.ledger, "grad reduce-scatter")
            grads.update(self.grad_parts(bucket, shard, active))
        for chunk in unit.chunks:
            grads.update(self.strategy.reduce_chunk(self, chunk, active))
        return grads

    def grad_bucket(self, bucket):
        """This rank's TP-local gradients laid out as the bucket (zeros where it has none, as DDP adds); a
        gradient that fills the bucket alone is used as it is, not copied."""
        grads = [self.param_by_name[n].grad for n in bucket.names]
        if len(grads) == 1 and grads[0] is not None and grads[0].numel() == bucket.numel and grads[0].dtype == torch.float32:
            return grads[0].reshape(-1)
        grad_bucket = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
        for name in bucket.names:
            grad = self.param_by_name[name].grad
            if grad is not None:
                grad_bucket[slice(*self.dist_metas[name].bucket_range)] = grad.reshape(-1)
        return grad_bucket

    def grad_parts(self, bucket, grad_shard, active):
        return {n: grad_shard[m.shard_slice] for n, m in self.dist_metas.items() if n in bucket.names and m.local_numel
                and n in active}

    def update_state(self, grads):
        """Stage 2, on this rank's parts only: AdamW updates its weights; Muon's momentum gives {matrix: its part
        of the Newton-Schulz input, bf16}."""
        updates = {}
        with record_function("state update"):
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

    def apply_update(self, name, ortho_part):
        """The end of stage 3: Muon's weight update, on this rank's part of the matrix."""
        apply_muon_update_(self.param_by_name[name].view(-1)[self.parts[name]], ortho_part, self.group_of[name],
                           self.layout.global_shapes[name], self.strategy.runs_of(name))

    def gather(self, unit, active):
        """Stage 4: the parameter all-gather; every DP rank again holds its full TP pieces."""
        for bucket in unit.buckets:
            self.copy_in(bucket, all_gather(self.param_shard(bucket), self.grid.dp, self.ledger, "param all-gather"))
        for chunk in unit.chunks:
            self.strategy.broadcast_chunk(self, chunk, active)

    def param_shard(self, bucket):
        metas = [self.dist_metas[n] for n in bucket.names]
        parts = {m.name: self.param_by_name[m.name].view(-1)[m.param_slice] for m in metas}
        return shard_of_bucket(parts, metas, bucket.numel // self.grid.dp.size, torch.float32, self.device)

    def copy_in(self, bucket, param_bucket):
        for name in bucket.names:
            self.param_by_name[name].view(-1).copy_(param_bucket[slice(*self.dist_metas[name].bucket_range)])

    @torch.no_grad()
    def clip_qk_(self, max_logits):  # after step(), collective: the strategy's (the gather strategy refuses it)
        return self.strategy.clip_qk_(self, max_logits)

    def __deepcopy__(self, memo):  # a copy that steps as this one does, on the same ranks: the grid shared
        return copy_sharing(self, memo, [self.grid])

    # -- checkpoints: ZeRO-1's are per rank, and belong to one layout --------
    def _checkpoint_layout(self):
        return dict(dp=self.grid.dp.size, tp=self.grid.tp.size, dp_rank=self.grid.dp.rank, tp_rank=self.grid.tp.rank,
                    bucket_size=self.bucket_size, strategy=self.strategy.name, owners=self.owners)

    def state_dict(self):  # this rank's shard of the state, and the layout it belongs to
        return dict(super().state_dict(), layout=self._checkpoint_layout())

    def load_state_dict(self, state_dict):  # checked whole before anything is replaced; the step reads what loaded
        super().load_state_dict(checked_zero1_state_dict(self, state_dict, self._checkpoint_layout()))
        self.param_by_name, self.group_of, _ = index_named_params(self.param_groups, self.tp_split_dims)

    def state_bytes(self):  # bytes of optimizer state this rank holds (momentum; AdamW moments and steps)
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values() if torch.is_tensor(t))


# =============================================================================
# 6. Run it
# =============================================================================
# Every one of the DP x TP processes runs run_rank, at the end of this section, top to bottom:
#
#   join the world (init_process_group) -> the grid (section 2)
#     -> its TP pieces of the demo model (below) -> the optimizer (section 5)
#     -> the steps, each fed this DP rank's own gradients
#     -> every rank's pieces to rank 0, which runs torch.optim.Muon / torch.optim.AdamW
#        on one device, fed the gradients summed over DP, and compares (torch.equal)
#
# Something else starts the processes and tells each who it is: torchrun on a GPU cluster, here the runner
# (muon_tools.py), a torchrun for one machine. Both set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every
# process, which init_process_group reads.
#
# The demo model is a small transformer that exercises every case the optimizer must handle: Muon matrices
# tall, square and wide, split by TP along dim 0 (column-parallel), dim 1 (row-parallel) or not at all (an MoE
# router); AdamW, as in practice, for the embedding and head (split by vocabulary), and without weight decay
# for norms, biases and a 0-dim scalar.
#
# Gradients differ per DP rank (each saw different data) and agree across a TP row (pieces of one gradient).
# They are integers times 2**-10 in [-1/4, 1/4]: any sum of up to 2**12 of them is a multiple of 2**-10 below
# 2**10, exact in float32, so the DP reduction gives the same bits in any order (real gradients would make
# bit-identity impossible for a reason unrelated to Muon).

VOCAB, D_MODEL, N_LAYERS, N_EXPERTS = 512, 128, 2, 8
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
        if s.name.endswith(("norm1.weight", "norm2.weight")) or s.name == "final_norm.weight":
            out[s.name] = torch.ones(s.global_shape)
        elif s.name.endswith(".bias"):
            out[s.name] = torch.zeros(s.global_shape)
        else:
            out[s.name] = torch.randn(s.global_shape, generator=g) * 0.02
    return out


def dp_rank_grads(specs, seed, step, dp_rank, missing=()):
    """Full gradients that DP rank `dp_rank` computed at `step`. missing: (name, dp_rank or -1 for every rank,
    step) whose gradient is None (a frozen embedding, an expert no token reached)."""
    g = torch.Generator().manual_seed((seed * 100_003 + step) * 1_009 + dp_rank)
    grads = {s.name: torch.randint(-GRAD_MAX_INT, GRAD_MAX_INT + 1, s.global_shape, generator=g).float() * GRAD_SCALE
             for s in specs}  # drawn for every parameter, so a missing one changes no other draw
    for name, rank, at in missing:
        if at == step and rank in (-1, dp_rank):
            grads[name] = None
    return grads


def rank_piece(full, spec, grid, device):
    """This rank's TP piece of a full tensor of `spec` (a weight or its gradient), on `device`; None stays None."""
    if full is None:
        return None
    return tp_shard(full, spec.tp_split_dim, grid.tp.rank, grid.tp.size).contiguous().to(device)


def run_steps(cfg, specs, build_optimizer, grid, device, after_step=None):
    """The steps, on a rank that has joined the world: {its final pieces, ledger, step times, state}.

    build_optimizer(grid, params) builds the optimizer over this rank's pieces {name: tensor}.
    after_step(step, opt, out) -> the optimizer to go on with: what the runner adds after a step (section 8's
    QK-clip; a resume from a checkpoint, which a lost state would show), recorded in `out`, the result."""
    start = initial_params(specs, cfg.seed)
    params = {s.name: rank_piece(start[s.name], s, grid, device) for s in specs}
    opt, out, step_ms = build_optimizer(grid, params), dict(rank=grid.rank), []
    for step in range(1, cfg.steps + 1):
        grads = dp_rank_grads(specs, cfg.seed, step, grid.dp.rank, cfg.missing_grads)
        for s in specs:
            params[s.name].grad = rank_piece(grads[s.name], s, grid, device)
        dist.barrier()  # the ranks start the step together: the clock times the step alone
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":  # kernels and NCCL return before they finish: wait, then read the clock
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if after_step is not None:
            opt = after_step(step, opt, out)
    return dict(out, params={n: p.detach().cpu() for n, p in params.items()}, ledger=asdict(opt.ledger),
                step_ms=step_ms, state_bytes=opt.state_bytes(), owners=opt.owners)


def max_abs_diff(got, expected):
    return (got.double() - expected.double()).abs().max().item() if got.shape == expected.shape else math.inf


def check_against_torch(specs, ranks, reference, tp, start=None):
    """One row per parameter: every rank's piece against the same piece of torch's result (torch.equal), the
    largest difference, and (given the parameters the run started from) how far torch moved the parameter."""
    checks = []
    for s in specs:
        pairs = [(r["params"][s.name], tp_shard(reference[s.name], s.tp_split_dim, r["rank"] % tp, tp)) for r in ranks]
        checks.append(dict(name=s.name, identical=all(torch.equal(got, want) for got, want in pairs),
                           max_abs_diff=max(max_abs_diff(got, want) for got, want in pairs)))
        if start is not None:
            checks[-1]["max_abs_update"] = (reference[s.name] - start[s.name]).abs().max().item()
    return checks


def run_rank(cfg, specs, build_optimizer, torch_reference, after_step=None):
    """What every process runs: join, build, step, and (rank 0) check every rank's pieces against torch.

    cfg: the run's settings (the runner's RunConfig, from the command line): dp, tp, steps, seed, timeout_s, ...
    specs: the model's parameters (transformer_specs above, or the command line's --model).
    build_optimizer(grid, params): DistributedMuon (section 5) over this rank's pieces, with the strategy and
        options the command line asks for (sections 7 and 8); after_step: run_steps'.
    torch_reference(device): {name: the full parameter after cfg.steps steps of torch.optim.Muon /
        torch.optim.AdamW on one device, fed each step's gradients summed over DP}.
    Returns on rank 0 {"ranks": what run_steps returned on each rank, "checks": check_against_torch's rows,
    "reference_s": torch's time}; None on the others.
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
    mine = run_steps(cfg, specs, build_optimizer, grid, device, after_step)
    ranks = [None] * grid.world.size if rank == 0 else None
    dist.gather_object(mine, ranks, dst=0)  # every rank's pieces, ledger and times, to rank 0
    dist.destroy_process_group()
    if rank != 0:
        return None
    t0 = time.perf_counter()
    reference = torch_reference(device)
    checks = check_against_torch(specs, ranks, reference, cfg.tp, initial_params(specs, cfg.seed))
    return dict(ranks=ranks, checks=checks, reference_s=time.perf_counter() - t0)
