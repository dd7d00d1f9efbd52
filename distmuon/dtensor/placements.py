"""Placements: where each element of a DTensor parameter lives, on any rank (what replaces the lesson's dist_meta).

Part of DTensorMuon (distmuon/dtensor/), section 2 of its reading order (the package's docstring has it).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

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
# placements, mesh coordinate). Every cut is torch.chunk's of a range of one
# tensor dim, so along each dim a rank keeps ONE range (start, stop), and its
# local tensor is the box those ranges make: local_box below finds it for one
# rank with a few integers, dim_ranges for every rank of the mesh at once (a
# tensor of starts and stops per dim). Nothing is sized by the tensor: the plan
# of a 405B model on 16,384 ranks is ranges, not elements. Replicate dims copy
# and need no gather. A Partial placement (a pending sum) cannot be
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
# dim first and is right only when the later cuts are even (pytorch/pytorch
# issue 168134, "gaps in uneven strided shard"; the case measured:
# notes/measured/from_code_comments.md). The optimizer follows FSDP2, which holds the data,
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


def chunk_range(start, stop, n, c):
    """The range torch.chunk gives piece c of n of the range [start, stop): ceil-sized pieces first, the last ones
    smaller or empty (the ranks past the data). Integers, or int64 tensors (every piece at once)."""
    size = stop - start
    chunk = -(-size // n)
    low, high = c * chunk, (c + 1) * chunk
    if torch.is_tensor(low):
        return start + torch.minimum(low, size), start + torch.minimum(high, size)
    return start + min(low, size), start + min(high, size)


def cuts_of_dim(placements, dim):
    """The mesh dims that cut tensor dim `dim`, in the order their cuts apply (split_order's)."""
    return [i for i in split_order(placements) if placements[i].dim == dim]


def local_box(shape, mesh_shape, placements, coordinate):
    """The range (start, stop) of each tensor dim that the rank at `coordinate` holds: its local tensor is the box
    they make, in row-major order."""
    box = []
    for d, size in enumerate(shape):
        start, stop = 0, size
        for i in cuts_of_dim(placements, d):
            start, stop = chunk_range(start, stop, mesh_shape[i], coordinate[i])
        box.append((start, stop))
    return tuple(box)


def dim_ranges(size, mesh_shape, placements, dim):
    """(starts, stops) of tensor dim `dim` (of `size`) on every rank of the mesh at once: int64 tensors that
    broadcast to mesh_shape (their size 1 along the mesh dims that do not cut it)."""
    start, stop = torch.zeros((1,) * len(mesh_shape), dtype=torch.int64), torch.full((1,) * len(mesh_shape), size)
    for i in cuts_of_dim(placements, dim):
        along = [1] * len(mesh_shape)
        along[i] = mesh_shape[i]
        start, stop = chunk_range(start, stop, mesh_shape[i], torch.arange(mesh_shape[i]).view(along))
    return start, stop


def local_indices(shape, mesh_shape, placements, coordinate):
    """Global flat indices of the elements the rank at `coordinate` holds, in its local tensor's order (a check's
    tool: the optimizer itself keeps ranges, local_box's)."""
    index, stride, box = torch.zeros((), dtype=torch.int64), 1, local_box(shape, mesh_shape, placements, coordinate)
    for d in reversed(range(len(shape))):
        start, stop = box[d]
        index = (torch.arange(start, stop) * stride).view((-1,) + (1,) * index.dim()) + index
        stride *= shape[d]
    return index.reshape(-1)


@functools.lru_cache(maxsize=4096)  # construction checks every parameter: most share a few (shape, placements)
def local_shape(shape, mesh_shape, placements, coordinate):
    """The shape of the local tensor of the rank at `coordinate` (torch.chunk's sizes); tuples, as it is cached."""
    return tuple(stop - start for start, stop in local_box(shape, mesh_shape, placements, coordinate))


def local_shape_problem(name, p):
    """None when DTensor p's local tensor has the shape its placements give it here, else why not (one line)."""
    coordinate = p.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not on the parameter's mesh
        return None
    expected = local_shape(tuple(p.shape), tuple(p.device_mesh.shape), tuple(p.placements), tuple(coordinate))
    if tuple(p.to_local().shape) != expected:
        return (f"{name}: the local tensor on rank {dist.get_rank()} has shape {tuple(p.to_local().shape)}, where "
                f"placements {tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)} put {expected} "
                f"(TP cuts, then FSDP2: section 2); this layout is not known here")
    return None


def sharded_dims(placements):
    """The mesh dims that cut the tensor; the others (Replicate) copy it."""
    return tuple(i for i, p in enumerate(placements) if isinstance(p, SHARD_PLACEMENTS))



def local_of(t):
    """A DTensor's local tensor; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(p, tensor):
    """`tensor` (local shape) as p is: a DTensor with p's mesh and placements, or itself."""
    if isinstance(p, DTensor):
        return DTensor.from_local(tensor, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return tensor


