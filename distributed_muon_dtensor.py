"""Distributed Muon for DTensor parameters: FSDP2 x tensor parallel on a 2-D DeviceMesh, MoE expert stacks.

The lesson script, distributed_muon_cpu.py, describes where every piece of every
matrix lives with its own bookkeeping: a grid of process groups, a virtual
buffer cut into buckets, and one `dist_meta` per parameter and rank. PyTorch's
own parallelism already carries that information on every parameter: with
FSDP2 (`fully_shard`) and DTensor tensor parallelism (`parallelize_module`) a
parameter IS a DTensor, and its device mesh and placements say exactly which
rank holds which elements. This file is the lesson's owner strategy rebuilt on
that description:

    local shards --momentum / AdamW (elementwise, on the shard)--> update shards (bf16)
    update shards --gather at owner (ONE all_to_all_single)------> full matrix, on its owner only
    full matrix   --Newton-Schulz (torch's 2-D ops)--------------> orthogonal matrix
    orthogonal    --scatter from owner (ONE all_to_all_single)---> every holder's shard of it

Each Muon matrix is orthogonalized exactly once, by an owner chosen among the
ranks that hold it, balanced by Newton-Schulz FLOPs (the lesson's
longest-processing-time assignment, restricted to each matrix's holders).
Everything is checked, bit for bit (torch.equal), against PyTorch's
single-device torch.optim.Muon and torch.optim.AdamW fed the same total
gradient; with --batched-ns the Muon matrices are held to the lesson's derived
bound instead (mt.batched_ns_tolerance), everything else still bit for bit.

Its demo is a command of its own, dtensor_demo.py (`python dtensor_demo.py`: 8 Gloo ranks, a 4 x 2 mesh,
PASS/FAIL; its docstring has the launch recipes, torchrun's among them). This file is the optimizer alone,
a module to import: it has no command, and imports nothing that runs it.

The optimizer alone, in your own training script (every rank, after init_process_group; the README's
"DTensorMuon in your FSDP2 x TP training loop" is a whole one, checkpoints included, run by a test):

    from distributed_muon_dtensor import DTensorMuon
    opt = DTensorMuon([dict(params=matrices, algorithm="muon"),      # [(name, param)], DTensor or not
                       dict(params=others, algorithm="adamw")],
                      expert_stacks={"layers.0.moe.w1"}, lr=0.02)
    loss.backward(); opt.step()

A real training with it: examples/train_gpt_dtensor.py (the GPT of examples/, fully_shard x
parallelize_module, --verify against one process, --save / --resume across meshes).

Under torchrun each process is one rank of the same demo (dtensor_demo.py, section 9): NCCL and
cuda:LOCAL_RANK where a GPU exists (the defaults), Gloo and the CPU with
--backend gloo --device cpu; the world size must be --dp x --tp. Rank 0 gathers
every rank's results, runs torch's reference on its own device (bitwise
agreement needs the same kind of device: cuBLAS's bf16 sums are not the CPU's;
see the lesson's notes/06-gpus.md), compares on the CPU and prints the same
report and PASS/FAIL. Only the Gloo/CPU form was run here: this machine has no
GPU, so NCCL and CUDA were NOT run, and nothing here shows that they work.

Reading order (each section opens with what it does and why)
    1. What is reused from the lesson (the math, the parameter checks, the owners)
    2. Placements: where each element lives (what replaces dist_meta)
    3. The plan: matrices, their holders and owners, the transfers
       3b. Rows of a laid-out matrix: fused blocks and QK-clip, on any local piece
       3c. Newton-Schulz on TP pieces, without gathering the matrix (tp_newton_schulz="gram")
    4. The configuration: automatic from placements, or your own callables
    5. The optimizer (DTensorMuon, a torch.optim.Optimizer)
    6. Checkpoints through torch.distributed.checkpoint, across meshes
What runs it lives beside it, in dtensor_demo.py, and continues the numbering (`python dtensor_demo.py`
runs it):
    7. The demo model (FSDP2 x TP x a MoE expert stack), a run, and its verification
       (exact gradients bit for bit; a real training run replayed bit for bit, and within fp32 bounds)
    8. Accounting, beside the lesson's strategies; FSDP2's and TP's own bytes, measured
    9. Main: the command line (spawned Gloo ranks, or one rank per torchrun process)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.profiler import record_function

import distributed_muon_cpu as dm
import muon_checks as mc
import muon_large_runs as mlr
import muon_owners as mo
import muon_tools as mt

# =============================================================================
# 1. What is reused from the lesson
# =============================================================================
# Nothing of the math is written twice: Newton-Schulz, the momentum, the
# learning-rate adjustment and AdamW come from the lesson's section 1 (with the
# small functions that step a part of a parameter with a group's options:
# muon_update, apply_muon_update_, adamw_step_), kept operation for operation
# identical to torch.optim.Muon and torch.optim.AdamW. The named parameters and
# every group's options are checked by muon_checks.named_params, as the lesson's are.
# The owner assignment (longest-processing-time over Newton-Schulz FLOPs) and
# its check come from its section 6 (muon_owners.py), with the function that moves
# many parts in one all-to-all (send_parts, which records its bytes and waits in an
# EventLedger) and the Newton-Schulz of an owner's matrices (newton_schulz_owned).
from distributed_muon_cpu import (NS_COEFFICIENTS, NS_EPS, NS_STEPS, adamw_step_,  # noqa: F401
                                  apply_muon_update_, muon_update, newton_schulz_flops)
from muon_owners import assign_owners, check_owners, lpt_order  # noqa: F401

# =============================================================================
# 2. Placements: where each element lives
# =============================================================================
# A DTensor carries a device mesh (an n-D array of ranks) and one placement per
# mesh dim. With FSDP2 on a "dp" dim and TP on a "tp" dim, mesh (dp=3, tp=2):
#
#   nn.Linear(8, 10) under ColwiseParallel, then fully_shard:  weight (10, 8)
#   placements (_StridedShard(dim=0, sf=2), Shard(dim=0)):
#     TP splits the rows first (5 | 5), then FSDP splits each TP half over dp (2, 2, 1):
#
#        rows 0-1  -> (dp 0, tp 0) = rank 0      rows 5-6  -> (dp 0, tp 1) = rank 1
#        rows 2-3  -> (dp 1, tp 0) = rank 2      rows 7-8  -> (dp 1, tp 1) = rank 3
#        row  4    -> (dp 2, tp 0) = rank 4      row  9    -> (dp 2, tp 1) = rank 5
#
#   nn.Linear(10, 8) under RowwiseParallel, then fully_shard:  weight (8, 10)
#   placements (Shard(dim=0), Shard(dim=1)): 3 | 3 | 2 rows x 5 | 5 columns.
#
# FSDP2 pads nothing that the optimizer sees: a dim that the dp size does not
# divide is cut as torch.chunk cuts it (ceil-sized pieces first, the last ones
# smaller, possibly empty); the padding lives in FSDP2's own all-gather buffer.
# So shards are uneven, and some ranks may hold nothing of a small matrix.
#
# That is all dist_meta used to say (which rank keeps which range of which
# matrix), and it is now a pure function of (global shape, mesh shape,
# placements, mesh coordinate): local_indices below computes, for any rank, the
# global flat index of each element of its local tensor, in its local order,
# by cutting a tensor of indices as the placements cut the parameter. Replicate
# dims copy and need no gather. A Partial placement (a pending sum) cannot be
# orthogonalized: the gradient must be reduced first, as FSDP2 and DDP do in
# backward.
#
# The order of the cuts matters when they are uneven. TP cuts first (rows
# 0-53 | 54-107 | 108-159 of a (160, 40) ColwiseParallel weight over tp = 3),
# then FSDP2 cuts each TP piece over dp as torch.chunk does (54 rows over
# dp = 4: 14, 14, 14, 12), and it marks its cut _StridedShard(0, sf=3): the
# split that comes AFTER the 3 of the mesh dim to its right. So a cut applies
# in mesh order, except a _StridedShard, which waits for the later mesh dims
# that cut the same tensor dim (split_order). torch's own
# _StridedShard._split_tensor (which distribute_tensor uses) cuts the strided
# dim first and is right only when the later cuts are even: for rank (dp 3,
# tp 1) of that weight it gives 13 rows where FSDP2 keeps 12, rows 96-107
# (measured with torch 2.14; pytorch/pytorch issue 168134, "gaps in uneven
# strided shard", is open). The optimizer follows FSDP2, which holds the data,
# and checks at construction that every local tensor has the shape its
# placements give it here.
SHARD_PLACEMENTS = (Shard, _StridedShard)


def split_order(placements):
    """The mesh dims that cut the tensor, in the order their cuts apply (see above): per tensor dim, mesh order,
    each _StridedShard after the later mesh dims that cut the same tensor dim."""
    def ordered(dims):  # the mesh dims cutting one tensor dim, in mesh order
        if not dims:
            return []
        first, rest = dims[0], ordered(dims[1:])
        return rest + [first] if isinstance(placements[first], _StridedShard) else [first] + rest

    tensor_dims = sorted({p.dim for p in placements if isinstance(p, SHARD_PLACEMENTS)})
    return [i for d in tensor_dims
            for i in ordered([i for i, p in enumerate(placements) if isinstance(p, SHARD_PLACEMENTS) and p.dim == d])]


def placements_problem(name, placements, mesh_shape):
    """None when the optimizer can handle these placements, else why not (one line)."""
    for dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            later = [mesh_shape[i] for i, p in enumerate(placements)
                     if i > dim and isinstance(p, SHARD_PLACEMENTS) and p.dim == placement.dim]
            if placement.split_factor != math.prod(later):
                return (f"{name}: placement {placement!r} on mesh dim {dim}: its split factor is not the product of "
                        f"the later mesh dims cutting tensor dim {placement.dim} ({math.prod(later)}), as FSDP2 "
                        f"writes it; this layout is not known here")
        if isinstance(placement, (Replicate,) + SHARD_PLACEMENTS):
            continue
        if placement.is_partial():
            return (f"{name}: placement {placement} on mesh dim {dim} is a pending reduction (Partial); "
                    f"reduce the gradient first, as FSDP2 and DDP do in backward")
        return f"{name}: placement {placement} on mesh dim {dim} is not Shard, _StridedShard or Replicate"
    return None


def chunks_with_empty(tensor, n, dim=0):
    """torch.chunk into n along dim, and empty pieces where it makes fewer (the ranks past the data)."""
    chunks = list(torch.chunk(tensor, n, dim=dim))
    return chunks + [chunks[0].narrow(dim, 0, 0)] * (n - len(chunks))


def local_index_tensor(shape, mesh_shape, placements, coordinate):
    """The global flat index of each element the rank at `coordinate` holds, shaped as its local tensor."""
    index = torch.arange(math.prod(shape)).view(shape)
    for i in split_order(placements):
        index = chunks_with_empty(index, mesh_shape[i], placements[i].dim)[coordinate[i]]
    return index


def local_indices(shape, mesh_shape, placements, coordinate):
    """Global flat indices of the elements the rank at `coordinate` holds, in its local tensor's order."""
    return local_index_tensor(shape, mesh_shape, placements, coordinate).reshape(-1)


def local_shape(shape, mesh_shape, placements, coordinate):
    """The shape of the local tensor local_index_tensor cuts, without building it (torch.chunk's sizes)."""
    shape = list(shape)
    for i in split_order(placements):
        d, n, k = placements[i].dim, shape[placements[i].dim], mesh_shape[i]
        size = -(-n // k)  # torch.chunk's chunk size; the last chunks are smaller, or missing (empty)
        shape[d] = max(0, min(size, n - coordinate[i] * size))
    return tuple(shape)


def local_shape_problem(name, p):
    """None when DTensor p's local tensor has the shape its placements give it here, else why not (one line)."""
    coordinate = p.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not on the parameter's mesh
        return None
    expected = local_shape(tuple(p.shape), tuple(p.device_mesh.shape), p.placements, coordinate)
    if tuple(p.to_local().shape) != expected:
        return (f"{name}: the local tensor on rank {dist.get_rank()} has shape {tuple(p.to_local().shape)}, where "
                f"placements {tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)} put {expected} "
                f"(TP cuts, then FSDP2: section 2); this layout is not known here")
    return None


def sharded_dims(placements):
    """The mesh dims that cut the tensor; the others (Replicate) copy it."""
    return tuple(i for i, p in enumerate(placements) if isinstance(p, SHARD_PLACEMENTS))


# =============================================================================
# 3. The plan: matrices, their holders and owners, the transfers
# =============================================================================
# A "matrix" is what Newton-Schulz sees: a 2-D Muon parameter, or one expert of
# a 3-D expert stack (E, out, in) declared in expert_stacks (each expert is its
# own matrix, as if the experts were E separate nn.Linear weights; whether the
# expert dim is sharded, expert parallel, or not).
#
# The plan is made once, at construction, from shapes and placements only, and
# every rank must make the SAME plan: the all-to-all needs every pair of ranks to
# agree on what goes where. A rank does not see every DTensor, though: FSDP2
# puts a parameter that TP does not split on the rank's own 1-D "dp" sub-mesh,
# so on a 4 x 2 mesh a router weight is one DTensor on ranks {0, 2, 4, 6} and
# another, equal but independent, on {1, 3, 5, 7}. So the ranks first swap
# their descriptions (one all_gather_object at construction) and each plans
# the union: a copy is keyed by (name, mesh ranks), and each copy's matrices
# are orthogonalized once, by an owner among their own holders.
#
#   matrix W, held by 4 ranks, owner 2:                         one all_to_all_single
#     rank 0: piece a --\                           /--> rank 0: a of NS(W)   each a batch of
#     rank 1: piece b ---+--> rank 2: W = [a b c d] -+--> rank 1: b of NS(W)   every matrix of
#     rank 3: piece d --/     (c is its own)  NS(W)   \--> rank 3: d of NS(W)   the step
#
# With Replicate dims, each piece is sent by the replica that sits where the
# owner sits along those dims (the owner's own pieces never move), and the
# result goes back to every replica (each keeps its own copy of the weights).
#
# Owners: the lesson's assign_owners balances over ranks 0..n-1, but a matrix
# may only go to a rank that holds some of it (else it would travel whole to a
# stranger). So it is the lesson's longest-processing-time rule with the
# candidates restricted: matrices in the lesson's lpt_order (decreasing FLOPs,
# equal FLOPs shape by shape), each to the least-loaded of ITS holders (ties:
# the lowest rank). When every rank holds a piece of everything (FSDP2 on dims
# the mesh divides) that is exactly the lesson's assign_owners, assignment for
# assignment (tested).
# (An earlier version ran assign_owners once per holder set, which forgot the
# load of the other sets: on 4 x 2, max/mean NS FLOPs 1.49 against 1.02 now.)

@dataclass(frozen=True)
class Copy:
    """One DTensor (or plain tensor) parameter as the ranks that hold it see it."""

    name: str
    group: int  # index of its param group
    shape: tuple  # global shape
    mesh_ranks: tuple  # global ranks of its mesh, row-major; () for a plain tensor (local)
    mesh_shape: tuple
    placements: tuple
    expert_stack: bool
    mesh_dim_names: tuple = ()  # the mesh's dim names (tp_newton_schulz="gram" looks for "tp"), () if none

    @property
    def local(self):
        """Plain tensors and all-Replicate DTensors: every holder has the whole thing, no exchange."""
        return not self.mesh_ranks or not sharded_dims(self.placements)

    @property
    def matrix_shape(self):
        return self.shape[1:] if self.expert_stack else self.shape

    @property
    def n_matrices(self):
        return self.shape[0] if self.expert_stack else 1


@dataclass
class Matrix:
    """One Newton-Schulz input and how it travels; transfers hold only what this rank takes part in."""

    name: str  # e.g. "layers.0.moe.w1[3]", or "router.weight@1,3,5,7" when copies live on several meshes
    copy: Copy
    expert: int  # -1 for a 2-D parameter
    holders: tuple  # global ranks that hold some of it
    owner: int = -1
    shape: tuple = ()  # what the owner puts together: the (out, in) matrix, or its TP piece (section 3c)
    tp_dim: int = -1  # section 3c: the mesh dim whose ranks orthogonalize their pieces together; -1: whole at owner
    # positions / offsets: flat indices, a slice where they run start, start + 1, ... (as_slice)
    gather: list = field(default_factory=list)  # (source, destination, numel, positions at source, offsets at dest.)
    scatter: list = field(default_factory=list)  # (source, destination, numel, offsets at source, positions at dest.)


def as_slice(index):
    """A flat index that runs start, start + 1, ..., as a slice, else itself. Why: the same elements, but a
    slice of a flat tensor is a view and writing into one is a memcpy, where an index tensor gathers and
    scatters element by element (the copies of a world of one took 0.7 s of a 1 s step at d = 768 before).
    FSDP2's Shard(0) pieces, a world of one and whole experts all run so."""
    n = index.numel()
    start = int(index[0]) if n else 0
    if n == 0 or (int(index[-1]) == start + n - 1 and (n == 1 or bool((index[1:] - index[:-1] == 1).all()))):
        return slice(start, start + n)
    return index


def covers(index, numel):
    """Whether a flat index (as_slice's) is every element of a tensor of numel elements, in order."""
    return isinstance(index, slice) and index == slice(0, numel)


def matrix_name(copy, expert, copies_of_name):
    where = "@" + ",".join(map(str, copy.mesh_ranks)) if copies_of_name > 1 else ""
    return copy.name + (f"[{expert}]" if expert >= 0 else "") + where


def copy_pieces(copy):
    """[(shard key, [holder ranks], global flat indices)] of a distributed copy, one per distinct piece."""
    mesh = torch.tensor(copy.mesh_ranks).view(copy.mesh_shape)
    cut = sharded_dims(copy.placements)
    pieces = {}
    for coordinate in torch.cartesian_prod(*[torch.arange(s) for s in copy.mesh_shape]).view(-1, len(copy.mesh_shape)):
        coordinate = tuple(coordinate.tolist())
        key = tuple(coordinate[i] for i in cut)
        if key not in pieces:
            pieces[key] = ([], local_indices(copy.shape, copy.mesh_shape, copy.placements, coordinate))
        pieces[key][0].append(int(mesh[coordinate]))
    return [(key, ranks, index) for key, (ranks, index) in pieces.items()]


def rank_at(copy, like, key):
    """The rank holding piece `key` whose coordinate on the Replicate dims is that of rank `like`."""
    mesh = torch.tensor(copy.mesh_ranks).view(copy.mesh_shape)
    coordinate = torch.nonzero(mesh == like)[0].tolist()
    for i, k in zip(sharded_dims(copy.placements), key):
        coordinate[i] = k
    return int(mesh[tuple(coordinate)])


def assign_among_holders(ns_flops, holders, world, load=None, shapes=None):
    """{matrix: owner}: the lesson's LPT (mo.assign_owners), each matrix among its own holders only."""
    load = [0] * world if load is None else list(load)
    owners = {}
    for name in lpt_order(ns_flops, shapes):
        rank = min(holders[name], key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += ns_flops[name]
    return {n: owners[n] for n in ns_flops}


def plan_matrices(copies, group_ns_steps, me, world, assign=None, flops_of=None, tp_dim_of=None):
    """Every distributed matrix of `copies`, with owners and this rank's transfers; and the owners.

    assign: None for assign_among_holders, or a callable (ns_flops, holders, world) -> {rank: [names]}
        (the matrices gathered whole; TP pieces, section 3c, go to the rows of ranks gram_owners picks).
    flops_of: None, or a callable (copy, steps) -> Newton-Schulz FLOPs of one of its matrices (blocks: section 3b).
    tp_dim_of: None, or a callable copy -> the mesh dim whose TP pieces are orthogonalized in place (3c), or -1.
    """
    flops_of = flops_of or (lambda c, steps: newton_schulz_flops(c.matrix_shape, steps))
    copies_of_name = {}
    for c in copies:
        copies_of_name[c.name] = copies_of_name.get(c.name, 0) + 1
    matrices, pieces_of, gram = [], {}, []
    for c in copies:
        if c.local:
            continue
        pieces = copy_pieces(c)
        tp_dim = tp_dim_of(c) if tp_dim_of else -1
        in_pieces = tp_pieces(c, pieces, tp_dim, copies_of_name[c.name]) if tp_dim >= 0 else None
        if in_pieces:
            gram.append(in_pieces)
            pieces_of.update((m.name, p) for m, p in in_pieces)
            continue
        per_matrix = math.prod(c.matrix_shape)
        for e in range(c.n_matrices):
            holders = set()
            expert_pieces = []
            for key, ranks, index in pieces:
                inside = (index // per_matrix) == e if c.expert_stack else torch.ones_like(index, dtype=torch.bool)
                positions = torch.nonzero(inside).view(-1)
                if positions.numel():
                    holders.update(ranks)
                    expert_pieces.append((key, ranks, positions, index[positions] - e * per_matrix))
            m = Matrix(matrix_name(c, e if c.expert_stack else -1, copies_of_name[c.name]), c,
                       e if c.expert_stack else -1, tuple(sorted(holders)), shape=tuple(c.matrix_shape))
            matrices.append(m)
            pieces_of[m.name] = expert_pieces
    ns_flops = {m.name: flops_of(m.copy, group_ns_steps[m.copy.group]) for m in matrices}
    holders = {m.name: m.holders for m in matrices}
    load, gram_flops, gram_owners = gram_owners_of(gram, group_ns_steps, world)
    if assign is None:
        owners = assign_among_holders(ns_flops, holders, world, load,
                                      shapes={m.name: tuple(m.copy.matrix_shape) for m in matrices})
    else:
        owners = check_owners(assign(ns_flops, holders, world), list(ns_flops), world)
        strangers = [f"{n} (rank {owners[n]}; holders {list(holders[n])})" for n in owners
                     if owners[n] not in holders[n]]
        if strangers:
            raise ValueError("bad owner assignment: owned by a rank that holds none of it: " + "; ".join(strangers))
    matrices += [m for in_pieces in gram for m, _ in in_pieces]
    ns_flops.update(gram_flops)
    owners.update(gram_owners)
    for m in matrices:
        m.owner = owners[m.name]
        for key, ranks, positions, offsets in pieces_of.pop(m.name):
            source = m.owner if m.owner in ranks else rank_at(m.copy, m.owner, key)
            numel = positions.numel()
            if me in (source, m.owner) or me in ranks:
                positions, offsets = as_slice(positions), as_slice(offsets)
            if me in (source, m.owner):
                m.gather.append((source, m.owner, numel, positions if me == source else None,
                                 offsets if me == m.owner else None))
            for r in ranks:
                if me in (m.owner, r):
                    m.scatter.append((m.owner, r, numel, offsets if me == m.owner else None,
                                      positions if me == r else None))
    return matrices, ns_flops, owners


# -----------------------------------------------------------------------------
# 3b. Rows of a laid-out matrix: fused blocks and QK-clip, on any local piece
# -----------------------------------------------------------------------------
# muon_large_runs.py's RowLayout (the lesson's section 7) names the rows of a FULL matrix: a
# fused QKV laid out head by head is periods = heads of segments (q, k, v). Two
# additions need to know which rows a rank's LOCAL piece holds, whatever cut it
# (FSDP2's Shard(0) or _StridedShard on dp, TP's Shard(0) or Shard(1)):
#
#   blocks   the owner orthogonalizes each block alone (mlr.newton_schulz_blocks:
#            "blocks" joins a segment across heads, Q K V; "heads" takes each
#            segment of each head), so each block's update takes the adjusted lr
#            of its OWN (rows, cols), as torch.optim.Muon on the blocks as
#            separate parameters would;
#   QK-clip  after the step, the rows of query head h (its "q" rows, and its
#            "k" rows where no other head shares them: RowLayout.qk_row_heads)
#            are multiplied by its multiplier (section 5, clip_qk_).
#
# local_indices (section 2) gives each local element's global index, hence its
# row. Consecutive local elements with the same key (its block's height, or its
# head) make one run, and each run is ONE elementwise call on a slice of the flat
# local tensor (the lesson's apply_muon_update_ with the block's shape, or
# mul_): the op torch runs on each separate block, hence torch's bits; never a
# per-row multiply by a tensor of factors.
#
#   fused QKV, 2 heads of (q 3, k 2, v 2) = 14 rows; TP Shard(1) keeps every row:
#     local flat order:  q0 q0 q0 k0 k0 v0 v0 q1 q1 q1 k1 k1 v1 v1   (one row each)
#     block heights:     6  6  6  4  4  4  4  6  6  6  4  4  4  4    4 runs, 4 add_
#     QK-clip heads:     0  0  0  0  0  -  -  1  1  1  1  1  -  -    2 runs, 2 mul_
# An expert stack (E, out, in) takes the layout of ONE expert's (out, in): every
# expert is its own matrix (section 3), so its blocks are too (e.g. a fused
# SwiGLU gate | up, orthogonalized as gate and up); QK-clip, which scales
# attention heads, does not apply to an expert stack (refused).
QK_SEGMENTS = mlr.QK_SEGMENTS  # the segments of a RowLayout that QK-clip scales


def local_rows(copy, coordinate):
    """The row (of its expert's matrix, for a stack) of every element of the local tensor at `coordinate`,
    in local order; a plain tensor's coordinate is ()."""
    index = local_indices(copy.shape, copy.mesh_shape, copy.placements, coordinate)
    return (index // copy.shape[-1]) % copy.matrix_shape[0]


def runs(keys):
    """[(start, stop, key)] of each run of equal consecutive values of a 1-D integer tensor; keys < 0 left out."""
    if keys.numel() == 0:
        return []
    change = (torch.nonzero(keys[1:] != keys[:-1]).view(-1) + 1).tolist()
    starts, stops = [0] + change, change + [keys.numel()]
    return [(a, b, k) for a, b, k in zip(starts, stops, keys[starts].tolist()) if k >= 0]


# -----------------------------------------------------------------------------
# 3c. Newton-Schulz on TP pieces, without gathering the matrix (tp_newton_schulz="gram")
# -----------------------------------------------------------------------------
# When TP cuts a matrix along its LONG side (the columns of a wide one, the rows
# of a tall one: mlr.gram_eligible), Newton-Schulz needs only the small Gram matrix
# X X^T = sum_t X_t X_t^T of the (transposed-if-tall) X: the lesson's
# newton_schulz_tp all-reduces it over the TP ranks once per iteration, and each
# rank updates its own columns. Here the TP dim is the mesh dim named "tp"
# (torchtitan's name), holding Shard(d) with d the long side. FSDP2 (or HSDP)
# also cuts the piece of each TP rank over the other dims; so each TP piece is
# first put together, by the same one all-to-all as a whole matrix is, on one
# rank of its TP column, and the owners of the pieces of one matrix are the TP
# ranks of ONE row of the mesh (one TP group), every one of them taking part:
#
#   mesh dp=2 x tp=2, a wide W (rows x cols) under RowwiseParallel x FSDP2:
#     (dp0,tp0) W[:h, :c/2]  (dp0,tp1) W[:h, c/2:]     row chosen: dp1, so
#     (dp1,tp0) W[h:, :c/2]  (dp1,tp1) W[h:, c/2:]     (dp1,tp0) owns W[:, :c/2], (dp1,tp1) W[:, c/2:]
#   gather at owner (the all-to-all) -> newton_schulz_tp on the TP group of row dp1
#   (one all-reduce of 4 m^2 bytes per iteration, m = the short side) -> scatter from owner
#
# Rows of the mesh are chosen by the lesson's longest-processing-time rule,
# before the matrices gathered whole, which then see that load. Each piece is one
# Matrix named "<matrix>|tp<t>"; an owner's piece is full[lines] (tall) or
# full[:, lines] (wide), its lines in increasing order. Not always torch's bits:
# the Gram matrix and the norm are float32 sums over ranks, in another order than
# one matmul's, so a near-tie may round to the other bf16 neighbour (DTensorMuon's
# docstring and tests/test_dtensor_large_runs.py bound and measure it). Expert
# stacks and blocked matrices (3b) keep the gather.


def tp_pieces(copy, pieces, tp_dim, copies_of_name):
    """[(Matrix, its pieces as plan_matrices takes them)] of each TP piece of a 2-D copy cut along its long side on
    mesh dim tp_dim, offsets in the piece's own (rows, cols); None if a piece is not whole lines (keep the gather)."""
    rows, cols = copy.shape
    long_dim = 0 if rows > cols else 1
    at = sharded_dims(copy.placements).index(tp_dim)
    out = []
    for t in range(copy.mesh_shape[tp_dim]):
        mine = [(key, ranks, index) for key, ranks, index in pieces if key[at] == t]
        held = torch.cat([index for _, _, index in mine])
        lines = torch.unique(held // cols if long_dim == 0 else held % cols)
        if held.numel() != lines.numel() * copy.shape[1 - long_dim]:
            return None
        position = torch.full((copy.shape[long_dim],), -1, dtype=torch.long)
        position[lines] = torch.arange(lines.numel())
        shape = (lines.numel(), cols) if long_dim == 0 else (rows, lines.numel())
        offset = lambda index: (position[index // cols] * cols + index % cols if long_dim == 0
                                else (index // cols) * shape[1] + position[index % cols])
        holders = tuple(sorted({r for _, ranks, _ in mine for r in ranks}))
        m = Matrix(f"{matrix_name(copy, -1, copies_of_name)}|tp{t}", copy, -1, holders, shape=shape, tp_dim=tp_dim)
        out.append((m, [(key, ranks, torch.arange(index.numel()), offset(index)) for key, ranks, index in mine]))
    return out


def gram_flops(shape, long_dim, steps):
    """Matmul FLOPs one TP rank spends in newton_schulz_tp on its piece: m the short side, n its long lines:
    per iteration X_t X_t^T (2 m m n), A@A (2 m m m, on every TP rank) and poly@X_t (2 m m n)."""
    m, n = shape[1 - long_dim], shape[long_dim]
    return steps * (4 * m * m * n + 2 * m * m * m)


def gram_owners_of(gram, group_ns_steps, world):
    """Each TP-split matrix to one row of its mesh (its TP group at one coordinate of the other dims), longest
    first, to the row whose busiest rank is least loaded (ties: the first row): (load per rank, FLOPs, owners)."""
    load, flops, owners = [0] * world, {}, {}
    work = []
    for in_pieces in gram:
        c = in_pieces[0][0].copy
        long_dim = 0 if c.shape[0] > c.shape[1] else 1
        cost = {m.name: gram_flops(m.shape, long_dim, group_ns_steps[c.group]) for m, _ in in_pieces}
        work.append((-sum(cost.values()), in_pieces[0][0].name, in_pieces, cost))
    for _, _, in_pieces, cost in sorted(work, key=lambda w: w[:2]):
        c, tp_dim = in_pieces[0][0].copy, in_pieces[0][0].tp_dim
        mesh_rows = torch.tensor(c.mesh_ranks).view(c.mesh_shape).movedim(tp_dim, -1).reshape(-1, c.mesh_shape[tp_dim])
        row = min(mesh_rows.tolist(), key=lambda ranks: max(load[r] for r in ranks))
        for (m, _), rank in zip(in_pieces, row):
            owners[m.name], flops[m.name] = rank, cost[m.name]
            load[rank] += cost[m.name]
    return load, flops, owners


# =============================================================================
# 4. The configuration: automatic from placements, or your own callables
# =============================================================================
# PyTorch's design discussion for a distributed torch.optim.Muon proposes a
# `distributed_config` with three callables: who orthogonalizes what (assign),
# how a matrix is put together on its owner (gather), and how the result goes
# back (redistribute). Here the same three, with our names:
#
#   DistributedConfig()                          automatic: everything from the DTensor placements
#   DistributedConfig(assign=f)                  automatic data path, your owners:
#                                                f(ns_flops, holders, world) -> {rank: [matrix names]}
#   DistributedConfig(gather=g, redistribute=r,  your own parallelism (plain tensors you sharded yourself):
#                     global_shapes={...},         g(updates, owners) -> {name: full matrix} (the ones you own),
#                     assign=f or None)            r(orthos, owners) -> {name: your local piece},
#                                                f as above; holders: every rank of the optimizer's group
#                                                (None: the lesson's LPT)
#
# One `assign` signature in both forms: f(ns_flops, holders, world), where
# ns_flops is {matrix name: Newton-Schulz FLOPs}, holders {matrix name: (global
# ranks that may own it)}, world the world size; it returns {rank: [names]}.
#
# Every assignment is checked at construction: each matrix owned exactly once
# (the lesson's check_owners names each missing, doubled or unknown one), and,
# in the automatic form, by a rank that holds some of it.

@dataclass(frozen=True)
class DistributedConfig:
    """Who orthogonalizes what, and (explicit form) how matrices travel; see section 4 of the file.

    assign: f(ns_flops, holders, world) -> {global rank: [matrix names]}, in both forms; None:
        longest-processing-time over Newton-Schulz FLOPs, each matrix among its holders.
    gather, redistribute, global_shapes: the explicit form, all three or none (see above).
    """

    assign: Callable | None = None
    gather: Callable | None = None
    redistribute: Callable | None = None
    global_shapes: dict | None = None  # explicit form only: {name: (rows, cols)} of each Muon matrix

    @property
    def explicit(self):
        return self.gather is not None or self.redistribute is not None

    def check(self):
        if self.explicit and (self.gather is None or self.redistribute is None or self.global_shapes is None):
            raise ValueError("an explicit distributed_config needs gather, redistribute and global_shapes together")
        if not self.explicit and self.global_shapes is not None:
            raise ValueError("global_shapes belongs to an explicit distributed_config (with gather and redistribute)")


# =============================================================================
# 5. The optimizer
# =============================================================================
# One step, as seen from one rank:
#
#   0. checks         every group's options (torch's rules, mc.named_params)
#                     and every gradient, then the grad-presence vote: one MAX
#                     all-reduce of a flag per parameter name and one for "a rank
#                     found a problem" (then EVERY rank raises, before any tensor
#                     changes). A parameter whose grad is None on every rank is
#                     skipped, as torch skips it; one with a gradient somewhere
#                     takes zeros where it is None (never a hang: no rank enters
#                     an exchange the others skip)
#   1. on the local shard: Muon's momentum, then the update cast to bf16 (the cast
#                     Newton-Schulz does first anyway: half the bytes, no bit changed)
#   2. gather at owner     one all_to_all_single for every matrix of the step
#   3. Newton-Schulz       on the owner, one 2-D matrix at a time (torch's addmm
#                          path, so torch's bits); batched_ns stacks same-shape
#                          matrices instead (opt-in; within BATCHED_NS_BOUND);
#                          ns_blocks: block by block (3b); "gram": TP pieces,
#                          each TP group together (3c)
#   4. scatter from owner  one all_to_all_single back
#   5. on the local shard: AdamW (elementwise: a shard gets the full tensor's bits);
#                          p <- p * (1 - lr * wd) - adjusted_lr * update, the
#                          adjustment from the matrix's shape (per expert: (out, in);
#                          per block: each run of rows with its block's shape, 3b)
#   (after the step, if asked: clip_qk_, one MAX all-reduce of per-head maxima)
# (The explicit form's gather and redistribute are yours: their results are
# checked and voted on, and the new momentum is kept aside until they pass.)
#
# Gradients are taken as already reduced: p.grad is a DTensor with p's
# placements holding the total gradient (what FSDP2's reduce-scatter leaves).
# Optimizer state lives with the shard it belongs to, as DTensors with the
# parameter's placements: the owner keeps nothing between steps, so a
# checkpoint reshards like the parameters (section 6).

def local_of(t):
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(p, tensor):
    """`tensor` (local shape) as p is: a DTensor with p's mesh and placements, or itself."""
    if isinstance(p, DTensor):
        return DTensor.from_local(tensor, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return tensor


def describe(name, group_index, p, expert_stack):
    """The Copy of parameter p as this rank sees it (what the ranks swap at construction)."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        return Copy(name, group_index, tuple(p.shape), tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.mesh.shape),
                    tuple(p.placements), expert_stack, tuple(mesh.mesh_dim_names or ()))
    return Copy(name, group_index, tuple(p.shape), (), (), (), expert_stack)


class DTensorMuon(torch.optim.Optimizer):
    """Muon for DTensor (and plain) parameters on any mesh, AdamW for the rest; bit-identical to torch.

    Drop-in for an FSDP2 x TP training loop (every rank, after init_process_group):

        opt = DTensorMuon([dict(params=[(n, p) for n, p in model.named_parameters() if is_matrix(n)]),
                           dict(params=others, algorithm="adamw", weight_decay=0.0)], lr=0.02)
        loss.backward(); opt.step(); opt.zero_grad()

    The gradient contract: after backward, p.grad is the TOTAL gradient (already reduced over
    data parallel, as FSDP2's reduce-scatter leaves it), a DTensor with p's mesh and placements
    (a plain tensor for a plain p). A Partial gradient is refused.

    Checkpoints: torch's own helpers work unchanged (state is keyed by the names in the param
    groups, i.e. model.named_parameters(); the state tensors are DTensors with the parameter's
    placements, so they reshard):
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, ...)
        ... on another mesh: dcp.load(state, ...); set_model_state_dict(model, state["model"]);
        set_optimizer_state_dict(model, opt, state["optim"])

    A step that must be refused (a bad gradient or hyperparameter on any rank) raises on EVERY rank
    of the group before any parameter or state changes. A parameter whose .grad is None on every
    rank is skipped (value and state untouched), as torch.optim.Muon and AdamW skip it.

    What large runs add (defaults: torch's behaviour; tests/test_dtensor_large_runs.py):
        opt = DTensorMuon(groups, ns_coefficients="polar_express",       # one (a, b, c) per iteration
                          row_layouts={"attn.qkv.weight": mlr.RowLayout((hd, hd, hd), heads, ("q", "k", "v"))},
                          ns_blocks="blocks",                            # or "heads"
                          qk_clip_tau=100.0, tp_newton_schulz="gram")
        loss.backward(); opt.step(); opt.clip_qk_({"attn.qkv.weight": max_logit_per_head})
      * ns_blocks (section 3b): each block of a laid-out matrix orthogonalized alone, on its owner, with
        the lr adjusted by the block's own shape: bit-identical to torch.optim.Muon on the blocks as
        separate parameters, whatever FSDP2 / TP / HSDP cut. An expert stack's layout is one expert's:
        it applies to every expert (e.g. a fused SwiGLU gate | up).
      * clip_qk_ (after step(), every rank): one MAX all-reduce of the per-head maxima, then each rank
        scales the q and k rows it holds: bit-identical to torch's step then the rows times
        sqrt(min(1, tau / S_h)). Not for expert stacks. Its docstring has the bytes.
      * tp_newton_schulz="gram" (section 3c): a 2-D matrix whose "tp" mesh dim cuts its long side is
        orthogonalized in TP pieces by one TP group (one Gram all-reduce per iteration) instead of
        whole on one owner; the rest keep the gather (and torch's bits). NOT always torch's bits (the
        Gram matrix is a float32 sum over ranks): each step's orthogonal matrix within the lesson's
        gram_ns_tolerance, a multiple of torch's own bf16 error against the float64 iteration on that
        step's input (derived in muon_tools.py, section 8; `python tests/test_dtensor_large_runs.py 10`: on 960
        random shapes, 2x2 and TP 4, 926 came out torch.equal, the worst used 0.17 of the bound; with
        nearly rank-2 gradients torch's own error, and the difference, reach 2**-3.5 of the update).
        Bytes: each TP rank all-reduces 5 Gram matrices, ~40 m^2 (tp - 1) / tp bytes (m the short side,
        float32), where a gathered matrix's owner receives and sends ~4 m n (tp - 1) / tp bytes of bf16:
        Gram moves less only when n > 20 m, sent and received counted alike (muon_large_runs.py, section 7.3).
      * These options are the same on every rank (checked), are not part of the state dict (pass them
        again when you resume), and need the automatic distributed_config.
    See help(DTensorMuon.__init__) for every argument.
    """

    def __init__(self, params, *, expert_stacks=(), distributed_config=None, batched_ns=False, group=None,
                 row_layouts=None, ns_blocks="whole", tp_newton_schulz="gather", qk_clip_tau=None, **options):
        """Build the plan (collective: every rank of `group` calls it with the same parameter names).

        params: as torch's optimizers take them: tensors, (name, tensor) pairs (model.named_parameters()),
            or param groups {"params": ..., "algorithm": "muon" | "adamw", any option of that algorithm's
            torch optimizer}; a group without an algorithm is Muon's, as torch.optim.Muon takes plain
            parameters (muon_checks.muon_param_groups(model) splits a model the way Muon users do). Names
            are the model's (model.named_parameters(); plain tensors are numbered as torch's state_dict
            numbers them): owners are keyed by them. Muon parameters are 2-D, or 3-D expert stacks (E, out,
            in) named in expert_stacks. Tensors are float32 DTensors (any mesh; Shard, _StridedShard or
            Replicate placements) or plain tensors.
        options (keywords): any option of torch.optim.Muon or torch.optim.AdamW, the default of every group
            whose algorithm takes it; a group's own options win; what neither gives is torch's default
            (muon_checks.TORCH_OPTIONS, read from the installed torch), checked by torch's rules. A Muon
            group's `eps` is Newton-Schulz's, as in torch.optim.Muon; ns_coefficients may also be one triple
            per iteration or "polar_express" (dm.ns_coefficients_of). What is not honoured bit for bit is
            refused (muon_checks.REFUSED).
        expert_stacks: names of 3-D Muon parameters whose dim 0 indexes experts: each expert is its
            own matrix (orthogonalized once, lr adjusted by its (out, in)).
        distributed_config: DistributedConfig (section 4); None: automatic from the placements.
        batched_ns: owners orthogonalize their same-shape matrices in one batched call: faster for
            many small ones, not bitwise torch's (within BATCHED_NS_BOUND of it). Off by default.
        group: the process group of the exchanges (default: the whole world); every rank of it
            builds the optimizer and calls step() together (and add_param_group, which plans again).
        row_layouts: {name: mlr.RowLayout of the FULL matrix (one expert's, for a stack)}: which rows are which
            (section 3b), for the two options below; the same on every rank.
        ns_blocks: "whole" (torch's: each matrix as one), "blocks" (each segment of a layout across its
            periods, e.g. Q, K, V) or "heads" (each segment of each period alone): Newton-Schulz of each block
            alone and each block's lr adjusted by its own shape; only parameters in row_layouts.
        tp_newton_schulz: "gather" (every matrix put together whole on its owner) or "gram" (section 3c:
            2-D matrices whose mesh dim named "tp" cuts their long side, in TP pieces; not torch's bits).
        qk_clip_tau: None (off), or tau > 0: clip_qk_ scales the "q" and "k" rows of every head whose
            max logit exceeded tau (Kimi K2's per-head QK-clip).
        """
        mc.check_options(str, options)
        self.options = options
        super().__init__(params, {})  # each group's options are filled by add_param_group, per its algorithm
        self.config = distributed_config or DistributedConfig()
        self.config.check()
        self.batched_ns, self.ledger = batched_ns, mo.EventLedger()  # send_parts records its waits there
        self.expert_stacks = set(expert_stacks)
        self.row_layouts, self.ns_blocks = dict(row_layouts or {}), ns_blocks
        self.tp_newton_schulz, self.qk_clip_tau = tp_newton_schulz, qk_clip_tau
        self.axis = self._axis(group)
        self.me = self.axis.ranks[self.axis.rank]  # global ranks everywhere; self.index maps them to the group's
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._plan()

    def add_param_group(self, param_group):
        """torch's, each option filled and checked per the group's algorithm (mc.fill_param_group). Called after
        construction (on every rank of the group alike: it is collective), the plan is made again with the new
        group: the state of the others is kept (it lives with the parameters' shards, whoever owns what)."""
        mc.fill_param_group(param_group, self.options, len(self.param_groups))
        super().add_param_group(mc.name_params(param_group, sum(len(g["params"]) for g in self.param_groups)))
        if hasattr(self, "axis"):
            self._plan()

    def _plan(self):
        """Index and check the parameters, agree with every rank, plan who orthogonalizes what; create the state."""
        self.param_by_name, self.group_of = {}, {}
        problem = self._index_params()  # local checks; raised below on every rank at once, never a hang
        copies = self._swap_descriptions(problem)
        if self.config.explicit:
            self._plan_explicit(copies)
        else:
            self._plan_automatic(copies)
            self._plan_rows()
        # Every state tensor exists from the start (zeros, step 0: what torch creates at a first step), so that
        # torch's get/set_optimizer_state_dict find it and never run their own zero-gradient step.
        self.init_state()

    # -- construction -------------------------------------------------------
    @staticmethod
    def _axis(group):
        """The exchange group as the lesson's Axis: global ranks, this rank's index, the ProcessGroup."""
        if not dist.is_initialized():
            return dm.Axis("world", 1, 0, (0,), None)
        group = group or dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
        return dm.Axis("world", len(ranks), ranks.index(dist.get_rank()), ranks, group)

    def _index_groups(self):
        """{name: its param group} (groups found by identity, never ==) after the lesson's checks of the named
        parameters and every group's options (mc.named_params); the first problem as one line, or None."""
        try:
            named = mc.named_params(self.param_groups)
            dm.check_ns_coefficients(self.param_groups)
        except ValueError as e:
            return str(e)
        self.group_of = {name: group for name, _, group in named}
        self.param_by_name = {name: p for name, p, _ in named}
        return None

    def _group_index(self, name):
        return next(i for i, g in enumerate(self.param_groups) if g is self.group_of[name])

    def _index_params(self):
        """Check what the step relies on; return the first problem as one line (or None)."""
        problem = self._index_groups()
        if problem:
            return problem
        for name, p in self.param_by_name.items():
            if isinstance(p, DTensor):
                why = placements_problem(name, p.placements, p.device_mesh.shape) or local_shape_problem(name, p)
                if why:
                    return why
            if self.group_of[name]["algorithm"] == "muon":
                if name in self.expert_stacks:
                    if p.ndim != 3:
                        return f"expert stack {name} must be 3-D (experts, out, in); it has shape {tuple(p.shape)}"
                elif p.ndim != 2:
                    return mc.not_a_matrix(name, p.shape, expert_stacks=True)
        unknown = sorted(self.expert_stacks - {n for n in self.param_by_name
                                                if self.group_of[n]["algorithm"] == "muon"})
        if unknown:
            return f"expert_stacks names no Muon parameter: {', '.join(unknown)}"
        if self.config.explicit:
            if self.expert_stacks:
                return "an explicit distributed_config takes 2-D matrices only (no expert_stacks)"
            muon = [n for n in self.param_by_name if self.group_of[n]["algorithm"] == "muon"]
            missing = [n for n in muon if n not in self.config.global_shapes]
            if missing:
                return f"global_shapes lacks Muon matrices: {', '.join(missing)}"
        return self._large_run_problem()

    def _large_run_problem(self):
        """The options of section 3b and clip_qk_, checked; the first problem as one line, or None."""
        why = self._options_problem()
        if why:
            return why
        if self.config.explicit and (self.row_layouts or self.qk_clip_tau is not None
                                     or self.tp_newton_schulz != "gather"):
            return ("row_layouts, qk_clip_tau and tp_newton_schulz='gram' need the automatic distributed_config: "
                    "your gather puts each matrix together whole, and the rows of your local pieces are not known here")
        for name, layout in self.row_layouts.items():
            p = self.param_by_name.get(name)
            if p is None or self.group_of[name]["algorithm"] != "muon":
                return f"row_layouts names no Muon parameter: {name}"
            why = mlr.row_layout_problem(name, layout, tuple(p.shape)[-2:], name in self.expert_stacks,
                                     self.qk_clip_tau is not None)
            if why:
                return why
        if self.ns_blocks != "whole" and not self.row_layouts:
            return f"ns_blocks={self.ns_blocks!r} needs row_layouts (which rows make which block)"
        if self.qk_clip_tau is not None and not self._clip_names():
            return f"qk_clip_tau needs row_layouts with segments named {' or '.join(QK_SEGMENTS)} (the rows it scales)"
        return None

    def _options_problem(self):
        """The lesson's check of ns_blocks, tp_newton_schulz and qk_clip_tau (one line), or None."""
        try:
            mlr.check_large_run_options(ns_blocks=self.ns_blocks, tp_newton_schulz=self.tp_newton_schulz,
                                       qk_clip_tau=self.qk_clip_tau)
        except ValueError as e:
            return str(e)
        return None

    def _clip_names(self):
        """The parameters QK-clip scales: those laid out with a "q" or "k" segment, sorted (the same on every rank)."""
        return sorted(n for n, layout in self.row_layouts.items() if set(layout.names) & set(QK_SEGMENTS))

    def _large_run_options(self):
        """What every rank must agree on (compared across ranks at construction)."""
        return (sorted(self.row_layouts.items(), key=lambda item: item[0]), self.ns_blocks, self.tp_newton_schulz,
                self.qk_clip_tau)

    def _swap_descriptions(self, problem):
        """Every rank's Copies (one all_gather_object), so that every rank makes the same plan."""
        mine = [describe(n, self._group_index(n), p, n in self.expert_stacks)
                for n, p in self.param_by_name.items()]
        options = None if problem else self._large_run_options()
        if self.axis.size == 1:
            everyone = [(problem, mine, options)]
        else:
            everyone = [None] * self.axis.size
            dist.all_gather_object(everyone, (problem, mine, options), group=self.axis.group)
        problems = [(self.axis.ranks[i], p) for i, (p, _, _) in enumerate(everyone) if p]
        problems += [(self.axis.ranks[i], f"row_layouts, ns_blocks, tp_newton_schulz or qk_clip_tau differ from "
                                          f"rank {self.axis.ranks[0]}'s: every rank must pass the same")
                     for i, (_, _, o) in enumerate(everyone) if not problems and o != everyone[0][2]]
        if problems:
            rank, why = problems[0]
            raise ValueError(why if rank == self.me else f"rank {rank}: {why}")
        copies, seen = [], set()
        for _, theirs, _ in everyone:
            for c in theirs:
                if (c.name, c.mesh_ranks) not in seen and (c.mesh_ranks or c in mine):
                    seen.add((c.name, c.mesh_ranks))
                    copies.append(c)
        self.names = sorted({c.name for _, theirs, _ in everyone for c in theirs})  # what grad presence votes on
        return copies

    def _plan_automatic(self, copies):
        muon_copies = [c for c in copies if self.param_groups[c.group]["algorithm"] == "muon"]
        steps = {i: g["ns_steps"] for i, g in enumerate(self.param_groups) if g["algorithm"] == "muon"}
        self.matrices, self.ns_flops, self.owners = plan_matrices(
            muon_copies, steps, self.me, self.world, self.config.assign, self._flops_of, self._tp_dim_of)
        outside = sorted({m.name for m in self.matrices if not set(m.holders) | {m.owner} <= set(self.axis.ranks)})
        if outside:
            raise ValueError(f"matrices held by ranks outside the optimizer's group: {', '.join(outside)}")
        # Plain tensors and all-Replicate DTensors: orthogonalized where they are, on every rank that holds them.
        me = self.me
        self.local_matrices = {c.name: [matrix_name(c, e if c.expert_stack else -1, 1) for e in range(c.n_matrices)]
                               for c in muon_copies if c.local and (not c.mesh_ranks or me in c.mesh_ranks)}
        self.index = {r: i for i, r in enumerate(self.axis.ranks)}
        self.param_of_matrix = {m.name: m.copy.name for m in self.matrices}
        self.param_of_matrix.update({m: name for name, names in self.local_matrices.items() for m in names})

    def _tp_dim_of(self, copy):
        """Section 3c: the mesh dim named "tp" if tp_newton_schulz="gram" and it cuts this 2-D matrix's long side
        (Shard, more than one rank), else -1 (gathered whole; so are expert stacks and blocked matrices)."""
        names = copy.mesh_dim_names
        if (self.tp_newton_schulz != "gram" or copy.expert_stack or "tp" not in names
                or (self.ns_blocks != "whole" and copy.name in self.row_layouts)):
            return -1
        d = names.index("tp")
        p = copy.placements[d]
        return d if type(p) is Shard and copy.mesh_shape[d] > 1 and mlr.gram_eligible(copy.shape, p.dim) else -1

    def _flops_of(self, copy, steps):
        """Newton-Schulz FLOPs of one matrix of `copy`: whole, or block by block (section 3b)."""
        layout = self.row_layouts.get(copy.name)
        if layout is None or self.ns_blocks == "whole":
            return newton_schulz_flops(copy.matrix_shape, steps)
        return mlr.newton_schulz_flops_of(copy.matrix_shape, steps, layout.blocks(self.ns_blocks == "heads"))

    def _plan_rows(self):
        """Section 3b on this rank's local pieces: the runs of equal block height (blocks) and of equal head
        (QK-clip) of every laid-out parameter, in its local flat order."""
        self.block_runs, self.clip_runs = {}, {}
        self.clip_names = self._clip_names() if self.qk_clip_tau is not None else []
        for name, layout in self.row_layouts.items():
            p = self.param_by_name[name]
            coordinate = tuple(p.device_mesh.get_coordinate()) if isinstance(p, DTensor) else ()
            rows = local_rows(describe(name, 0, p, name in self.expert_stacks), coordinate)
            if self.ns_blocks != "whole":
                self.block_runs[name] = runs(torch.tensor(layout.block_heights(self.ns_blocks == "heads"))[rows])
            if name in self.clip_names:
                self.clip_runs[name] = runs(torch.tensor(layout.qk_row_heads())[rows])

    def _plan_explicit(self, copies):
        muon = [n for n in self.param_by_name if self.group_of[n]["algorithm"] == "muon"]
        self.ns_flops = {n: newton_schulz_flops(self.config.global_shapes[n], self.group_of[n]["ns_steps"])
                         for n in muon}
        ranks = self.axis.ranks
        owned = (self.config.assign(self.ns_flops, {n: ranks for n in muon}, self.world)
                 if self.config.assign is not None
                 else {r: [n for n, o in assign_owners(self.ns_flops, len(ranks), self.config.global_shapes).items()
                            if ranks[o] == r]
                       for r in ranks})
        self.owners = check_owners(owned, muon, self.world)
        strangers = sorted(n for n, r in self.owners.items() if r not in ranks)
        if strangers:
            raise ValueError(f"bad owner assignment: owned outside the optimizer's group: {', '.join(strangers)}")
        self.matrices, self.local_matrices, self.index = [], {}, {}
        self.block_runs, self.clip_runs, self.clip_names = {}, {}, []

    # -- what the plan says, for people ------------------------------------
    @property
    def assignments(self):
        """{matrix: owner rank} of every distributed matrix; local ones are orthogonalized where they are."""
        return dict(self.owners)

    def format_assignments(self):
        """The assignment as a table: per rank, how many matrices, their GFLOP and their names."""
        world = self.world
        load, _ = mo.load_balance(self.ns_flops, self.owners, world)
        rows = [[r, sum(o == r for o in self.owners.values()), f"{load[r] / 1e9:.4f}",
                 " ".join(n for n, o in self.owners.items() if o == r) or "-"] for r in range(world)]
        table = mt.format_table(["rank", "matrices", "NS GFLOP", "owns"], rows, [">", ">", ">", "<"])
        local = sorted(n for names in self.local_matrices.values() for n in names)
        return table + (f"\nlocal on every holder (plain or all-Replicate): {' '.join(local)}" if local else "")

    # -- state ---------------------------------------------------------------
    def _state_of(self, name):
        """This parameter's state, created on first use as torch does (zeros, step 0), as DTensors like p."""
        p = self.param_by_name[name]
        state = self.state[p]
        if not state:
            zeros = lambda: like_param(p, torch.zeros_like(local_of(p), memory_format=torch.contiguous_format))
            if self.group_of[name]["algorithm"] == "muon":
                state["momentum_buffer"] = zeros()
            else:  # torch.optim.AdamW's: the moments, and amsgrad's running maximum
                state.update(step=torch.tensor(0.0), exp_avg=zeros(), exp_avg_sq=zeros())
                if self.group_of[name]["amsgrad"]:
                    state["max_exp_avg_sq"] = zeros()
        return state

    def load_state_dict(self, state_dict):
        """torch's load (state by position or by name, as set_optimizer_state_dict gives it), then the groups
        re-indexed (torch replaces the group dicts) and checked."""
        super().load_state_dict(state_dict)
        problem = self._index_groups()
        if problem:
            raise ValueError(f"loaded optimizer state: {problem}")
        self.init_state()  # a parameter the checkpoint had no state for starts from zeros

    def init_state(self):
        """Create every parameter's state now (zeros, step 0), e.g. as the target of a checkpoint load."""
        for name in self.param_by_name:
            self._state_of(name)

    def state_bytes(self):
        return sum(local_of(t).numel() * local_of(t).element_size()
                   for s in self.state.values() for t in s.values() if torch.is_tensor(t))

    # -- the step -----------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ledger.step += 1
        # Every check before anything changes, and voted on: a group's options (they may have been changed, or
        # loaded, since construction) and every gradient; one rank's problem stops every rank, here.
        group_problem = self._index_groups()
        grads, problem = self._local_grads()
        active = self._vote_on_gradients(grads, group_problem or problem)
        updates, momenta = {}, {}
        # Flat views of every local tensor: elementwise math does not care about shape, and an empty
        # shard's local shape may differ between FSDP2's parameter and a gradient made by distribute_tensor.
        flat = lambda t: local_of(t).view(-1)
        for name in [n for n in active if self.group_of[n]["algorithm"] == "muon"]:
            group, buffer = self.group_of[name], flat(self._state_of(name)["momentum_buffer"])
            # Your gather / redistribute (explicit form) may fail the checks after them: the new momentum is
            # kept aside until they pass, so that a refused step changes nothing.
            momenta[name] = buffer.clone() if self.config.explicit else buffer
            update = muon_update(momenta[name], grads[name].reshape(-1), group)
            updates[name] = update.view(local_of(self.param_by_name[name]).shape)
        orthos = self._orthogonalize(updates)
        for name in [n for n in active if self.group_of[n]["algorithm"] == "adamw"]:
            state = {k: flat(t) for k, t in self._state_of(name).items()}  # "step" too: a view, updated in place
            adamw_step_(flat(self.param_by_name[name]), grads[name].reshape(-1), state, self.group_of[name])
        if self.config.explicit:  # the checks passed: the new momentum now
            for name, momentum in momenta.items():
                flat(self.state[self.param_by_name[name]]["momentum_buffer"]).copy_(momentum)
        for name, ortho in orthos.items():
            shape = (self.config.global_shapes[name] if self.config.explicit
                     else tuple(self.param_by_name[name].shape)[-2:])  # an expert's (out, in)
            apply_muon_update_(flat(self.param_by_name[name]), ortho.reshape(-1), self.group_of[name], shape,
                               self.block_runs.get(name))  # blocks: each run of rows with its block's shape (3b)
        return loss

    def _local_grads(self):
        """{name: local gradient or None} and the first problem with them (one line, or None)."""
        grads, problem = {}, None
        for name, p in self.param_by_name.items():
            g = p.grad
            if g is not None and problem is None:
                if isinstance(p, DTensor) and not (isinstance(g, DTensor) and g.placements == p.placements
                                                   and g.device_mesh == p.device_mesh):
                    placements = g.placements if isinstance(g, DTensor) else "a plain tensor"
                    problem = placements_problem(f"the gradient of {name}", g.placements, g.device_mesh.shape) \
                        if isinstance(g, DTensor) else None
                    problem = problem or (f"the gradient of {name} is {placements}, the parameter "
                                          f"{p.placements}: give it the parameter's placements")
                elif g.shape != p.shape or local_of(g).numel() != local_of(p).numel():
                    problem = (f"the gradient of {name} has shape {tuple(g.shape)} (here {tuple(local_of(g).shape)}), "
                               f"the parameter {tuple(p.shape)} (here {tuple(local_of(p).shape)})")
            grads[name] = None if g is None else local_of(g)
        return grads, problem

    def _vote_on_gradients(self, grads, problem):
        """The names to update this step, the same on every rank; raise on every rank if any found a problem."""
        flags = torch.tensor([n in grads and grads[n] is not None for n in self.names] + [problem is not None],
                             device=self._device())  # NCCL reduces device tensors only
        votes = dm.any_rank(flags, self.axis, self.ledger, "grad presence")
        self._refuse_on_every_rank(problem, votes[-1])
        present = {n for n, v in zip(self.names, votes[:-1].tolist()) if v}
        for name in present & set(grads):
            if grads[name] is None:  # a gradient elsewhere but not here: zeros, as DDP's reduction would give
                grads[name] = torch.zeros_like(local_of(self.param_by_name[name]))
        return [n for n in self.param_by_name if n in present]

    def _refuse_on_every_rank(self, problem, someone=None, phase=""):
        """Raise on every rank if any rank found a problem: `someone` is the vote already taken, or None to take
        it now (one MAX all-reduce, `phase` in the ledger). A refusal names the rank: this rank raises its own
        problem, the others name the (highest) rank that refused, from one more MAX all-reduce of the rank, made
        only then (the vote is a byte a rank: too small for a rank of a large cluster)."""
        if someone is None:
            flag = torch.tensor([problem is not None], device=self._device())
            someone = dm.any_rank(flag, self.axis, self.ledger, phase)[0]
        if not someone:
            return
        rank = torch.tensor([self.me + 1 if problem else 0], dtype=torch.int64, device=self._device())
        rank = int(dm.all_reduce(rank, self.axis, self.ledger, "refusal", dist.ReduceOp.MAX)) - 1
        if problem:
            raise ValueError(f"rank {self.me}: {problem}")
        raise ValueError(f"rank {rank} refused the step (it raised why); nothing changed")

    def _orthogonalize(self, updates):
        """{name: bf16 update of this rank's local shard} -> {name: its orthogonalized local shard}."""
        if self.config.explicit:
            return self._orthogonalize_explicit(updates)
        group_of = {}
        orthos = {}
        local_full = {}
        for name, matrices in self.local_matrices.items():  # no exchange: the whole matrix is here
            if name in updates:
                stack = updates[name].view(-1, *updates[name].shape[-2:])
                for i, m in enumerate(matrices):
                    local_full[m], group_of[m] = stack[i], self.group_of[name]
        if local_full:
            done = self._newton_schulz(local_full, group_of)
            for name, matrices in self.local_matrices.items():
                if name in updates:
                    orthos[name] = torch.stack([done[m] for m in matrices]).view(updates[name].shape)
        active = [m for m in self.matrices if m.copy.name in updates and (m.gather or m.scatter)]
        full = self._gather_at_owners(updates, active)
        for m in active:
            if m.owner == self.me:
                group_of[m.name] = self.param_groups[m.copy.group]
        pieces = [m for m in active if m.owner == self.me and m.tp_dim >= 0]  # in plan order: the same on each
        orthogonal = self._newton_schulz({n: t for n, t in full.items() if n not in {m.name for m in pieces}},
                                         group_of)
        for m in pieces:  # section 3c: with every rank of this row's TP group, one all-reduce per iteration
            g = group_of[m.name]
            with record_function("newton-schulz"):
                orthogonal[m.name] = mlr.newton_schulz_tp(full[m.name], m.copy.shape, self._tp_axis(m), self.ledger,
                                                         g["ns_steps"], g["ns_coefficients"], g["eps"])
            self.ledger.record_compute(m.name, m.shape, self.ns_flops[m.name])
        orthos.update(self._scatter_from_owners(orthogonal, updates, active))
        return orthos

    def _tp_axis(self, m):
        """The TP group of this rank's row of m's mesh, as the lesson's Axis (what newton_schulz_tp sums over)."""
        group = self.param_by_name[m.copy.name].device_mesh.get_group(m.tp_dim)
        ranks = tuple(dist.get_process_group_ranks(group))
        return dm.Axis("TP", len(ranks), ranks.index(self.me), ranks, group)

    def _newton_schulz(self, full, group_of):
        """{matrix: full bf16 update} -> {matrix: orthogonalized}, by the lesson's newton_schulz_owned; laid-out
        matrices block by block (torch's 2-D path, batched_ns or not: a block is its own matrix)."""
        per_head = self.ns_blocks == "heads"
        blocks = {m: self.row_layouts[self.param_of_matrix[m]].blocks(per_head) for m in full
                  if self.ns_blocks != "whole" and self.param_of_matrix[m] in self.row_layouts}
        return mo.newton_schulz_owned(full, group_of, self.ledger, self.batched_ns, mlr.Blocks(blocks))

    def _gather_at_owners(self, updates, active):
        me, dtype = self.me, torch.bfloat16
        transfers, receiving = [], []
        for m in active:
            for source, destination, numel, positions, offsets in m.gather:
                part = updates[m.copy.name].view(-1)[positions] if source == me else None
                transfers.append((self.index[source], self.index[destination], numel, part))
                if destination == me:
                    receiving.append((m, offsets))
        parts = mo.send_parts(transfers, self.axis, self.ledger, "gather at owner", dtype, self._device())()
        full = {}
        for (m, offsets), part in zip(receiving, parts):
            if covers(offsets, math.prod(m.shape)):  # the whole matrix in one part (e.g. a world of one): no copy
                full[m.name] = part.view(m.shape)
                continue
            if m.name not in full:
                full[m.name] = torch.empty(m.shape, dtype=dtype, device=part.device)
            full[m.name].view(-1)[offsets] = part
        return full

    def _scatter_from_owners(self, orthogonal, updates, active):
        me, dtype = self.me, torch.bfloat16
        transfers, receiving = [], []
        for m in active:
            for source, destination, numel, offsets, positions in m.scatter:
                part = orthogonal[m.name].reshape(-1)[offsets] if source == me else None
                transfers.append((self.index[source], self.index[destination], numel, part))
                if destination == me:
                    receiving.append((m, positions))
        parts = mo.send_parts(transfers, self.axis, self.ledger, "scatter from owner", dtype, self._device())()
        local = {}
        for (m, positions), part in zip(receiving, parts):
            name = m.copy.name
            if covers(positions, updates[name].numel()):  # this rank's whole shard in one part: no copy
                local[name] = part
                continue
            if name not in local:
                local[name] = torch.empty(updates[name].numel(), dtype=dtype, device=part.device)
            local[name][positions] = part
        return local

    def _orthogonalize_explicit(self, updates):
        """Your gather, Newton-Schulz on the owners, your redistribute; shapes checked on the way."""
        full = self.config.gather(dict(updates), dict(self.owners))
        me = self.me
        wrong = [f"gather gave {n} as {tuple(full[n].shape) if n in full else None}, expected "
                 f"{tuple(self.config.global_shapes[n])}" for n in updates if self.owners[n] == me
                 and (n not in full or tuple(full[n].shape) != tuple(self.config.global_shapes[n]))]
        self._refuse_on_every_rank(wrong[0] if wrong else None, phase="explicit checks")
        orthogonal = mo.newton_schulz_owned({n: full[n] for n in updates if self.owners[n] == me},
                                            self.group_of, self.ledger, self.batched_ns)
        local = self.config.redistribute(orthogonal, dict(self.owners))
        wrong = [f"redistribute gave no piece of {n} the size of this rank's parameter" for n in updates
                 if n not in local or local[n].numel() != updates[n].numel()]
        self._refuse_on_every_rank(wrong[0] if wrong else None, phase="explicit checks")
        return {n: local[n] for n in updates}

    def _device(self):
        return self.param_groups[0]["params"][0].device

    # -- QK-clip --------------------------------------------------------------
    @torch.no_grad()
    def clip_qk_(self, max_logits):
        """Kimi K2's per-head QK-clip, after step(): collective, every rank of the group calls it. The
        contract (max_logits, one float32 per query head of the full matrix; refusals, naming the rank; the
        multipliers returned) is the lesson's: help(muon_large_runs.LargeRuns.clip_qk_), and so is its one
        collective, mlr.exchange_max_logits: ONE all-reduce MAX over the optimizer's group of n ranks of
        H + 1 float32 values, the heads of every parameter of clip_names in that order, then the refusing
        rank: each rank sends and receives 2 (n - 1) x ceil((H + 1) / n) x 4 bytes (a ring's count; the
        Ledger's phase "QK-clip maxima"), e.g. 72 B for H = 10 heads on 4 ranks. For separate W_q and W_k
        of multi-head attention, pass the same maxima under both names (under GQA, leave W_k out: its keys
        are shared). A head's rows are held here if any of its scaled rows is in this rank's local shard,
        wherever FSDP2 and TP cut (section 3b); each run of them is multiplied by its head's multiplier
        (mlr.qk_clip_scales), bit-identical to torch's step then those rows times it.
        """
        heads_of = mlr.qk_heads(self.row_layouts, self.clip_names)
        problem = self._options_problem() or mlr.max_logits_problem(max_logits, heads_of)
        maxima = mlr.exchange_max_logits(max_logits, heads_of, problem, self.me, self.axis, self.ledger,
                                         self._device())
        out = {}
        for name, s in maxima.items():
            scales = mlr.qk_clip_scales(s, self.qk_clip_tau, self.row_layouts[name].shares_keys)
            flat = local_of(self.param_by_name[name]).view(-1)
            for start, stop, head in self.clip_runs[name]:
                if scales[head] != 1.0:
                    flat[start:stop].mul_(scales[head])
            held = {head for _, _, head in self.clip_runs[name]}
            out[name] = [m if h in held else None for h, m in enumerate(scales)]
        return out


# =============================================================================
# 6. Checkpoints through torch.distributed.checkpoint, across meshes
# =============================================================================
# The optimizer's state is sharded exactly as its parameter is (section 5): a
# momentum buffer or AdamW moment is a DTensor with the parameter's mesh and
# placements, on the ranks that hold the parameter, whoever owns the matrix.
# So torch.distributed.checkpoint (DCP) reshards it as it reshards the weights:
# each rank writes its local shards with their global offsets, and a load on
# another mesh (4 x 2 -> 2 x 2, -> 8 x 1, or into one process with plain
# tensors) reads, for each of its own shards, the overlapping pieces of the
# saved ones. The state dict is keyed by parameter name, never by position or
# owner, so a different assignment of owners on the new mesh changes nothing.
#
#   {"params": {name: parameter},
#    "optim":  {name: {"momentum_buffer"} or {"step", "exp_avg", "exp_avg_sq"}}}
#
# The checkpoint is torch's own recipe, as for AdamW under FSDP2: torch's
# get_optimizer_state_dict keys the state by fully qualified name (it maps the
# optimizer's params, group by group, to model.named_parameters()), and
# set_optimizer_state_dict gives the loaded state back through our
# load_state_dict. The optimizer's part is only to be an honest
# torch.optim.Optimizer: its params are the model's own parameters, its state
# exists from construction (so torch never runs its zero-gradient "init" step on
# it), and its load re-indexes and re-checks the groups torch replaced.
#
#   {"model": get_model_state_dict(model),                 each a DTensor (or plain) parameter
#    "optim": get_optimizer_state_dict(model, optimizer)}  {"state": {fqn: {"momentum_buffer"} or
#                                                           {"step", "exp_avg", "exp_avg_sq"}},
#                                                           "param_groups": [{"params": [fqn...], options}]}
#
# DCP loads in place: build the model and optimizer on the new mesh, take the
# same dict there as the target, dcp.load into it, then hand it to
# set_model_state_dict and set_optimizer_state_dict. process_group: the
# optimizer's (on a mesh smaller than the world, the other ranks would never
# join a collective of the whole world); None without a process group at all.

def checkpoint_state(model, optimizer):
    """torch's state dict of the model and its optimizer (live tensors: a DCP load writes into them)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def save_checkpoint(path, model, optimizer):
    """dcp.save of checkpoint_state: nothing but torch's recipe (a thin wrapper for the demo and the tests)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(checkpoint_state(model, optimizer), checkpoint_id=path, process_group=optimizer.axis.group)


def load_checkpoint(path, model, optimizer):
    """dcp.load into this rank's shards on whatever mesh the model now lives (or plain tensors, no process
    group), then torch's set_model_state_dict and set_optimizer_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = checkpoint_state(model, optimizer)
    dcp.load(state, checkpoint_id=path, process_group=optimizer.axis.group, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
