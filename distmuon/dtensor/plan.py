"""The plan: every Muon matrix of DTensorMuon, its holders and owner, and the transfers that bring it there and back.

Part of DTensorMuon (distmuon/dtensor/), section 3 of its reading order (with 3c: TP pieces orthogonalized where
they lie, tp_newton_schulz="gram"). Made once at construction from shapes and placements only: every rank makes
the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Shard

from distmuon.dtensor.placements import local_indices, sharded_dims
from distmuon.owners import check_owners, lpt_order
from distributed_muon_cpu import newton_schulz_flops

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


def describe(name, group_index, p, expert_stack):
    """The Copy of parameter p as this rank sees it (what the ranks swap at construction)."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        return Copy(name, group_index, tuple(p.shape), tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.mesh.shape),
                    tuple(p.placements), expert_stack, tuple(mesh.mesh_dim_names or ()))
    return Copy(name, group_index, tuple(p.shape), (), (), (), expert_stack)
