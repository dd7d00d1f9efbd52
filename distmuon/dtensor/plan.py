"""The plan: every Muon matrix of DTensorMuon, its holders and owner, and the transfers that bring it there and back.

Part of DTensorMuon (distmuon/dtensor/), section 3 of its reading order (with 3c: TP pieces orthogonalized where
they lie, tp_newton_schulz="gram"). Made once at construction from shapes and placements only: every rank makes
the same plan.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from distmuon.dtensor.placements import dim_ranges, sharded_dims
from distmuon.assignment import assign_owners, check_owners
from distmuon.owners import chunk_names
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
# their descriptions at construction (an all_gather_object of a digest, then of
# the descriptions where the digests differ) and each plans the union: a copy is keyed by (name, mesh ranks), and each copy's matrices
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
# What the plan keeps grows with this rank's share, not with the model: a piece
# is a box, one range per tensor dim (section 2), so a copy's pieces are a few
# integers per rank of its mesh (Cut, one for all the copies of one shape and
# layout, let go after the plan where it has many), a rank keeps only its own
# transfers (its piece, one tuple for a layout; every piece's only where it owns
# the matrix, made again from the Cut as they are read), and a transfer is the
# box of the owner's matrix it fills and the holder's local tensor (or one
# expert of its stack) it comes from: a view at the holder, a strided copy of
# whole runs at the owner, never an index per element. A mesh's ranks are a
# range where evenly spaced (ranks_of). The plan of Llama 3 70B for one of
# 16,384 ranks takes under a second and keeps 0.16 MB, 0.65 % of the rank's
# 24.8 MB of parameters (benchmarks/at_scale.py --plan-only).
#
# Owners: the lesson's assign_owners balances over ranks 0..n-1, but a matrix
# may only go to a rank that holds some of it (else it would travel whole to a
# stranger). So it is the lesson's longest-processing-time rule (assign_owners,
# holders= and load=) with the candidates restricted: matrices in the lesson's lpt_order (decreasing FLOPs,
# equal FLOPs shape by shape), each to the least-loaded of ITS holders (ties:
# the lowest rank). When every rank holds a piece of everything (FSDP2 on dims
# the mesh divides) that is exactly the lesson's assign_owners, assignment for
# assignment (tested). One assignment over all holder sets, so each rank's load
# counts every matrix it owns.

@dataclass(frozen=True)
class Copy:
    """One copy of a parameter: the DTensor (or plain tensor) that the ranks of one mesh hold. A parameter has one
    copy, or one per sub-mesh where FSDP2 places it on each rank's own (the MoE router on a dp x tp mesh: one copy
    per TP column), and each copy is stepped as a parameter of its own."""

    name: str
    group: int  # index of its param group
    shape: tuple  # global shape
    mesh_ranks: tuple  # global ranks of its mesh, row-major (ranks_of: a range where evenly spaced); () if local
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


@dataclass(frozen=True, eq=False)
class Cut:
    """A distributed copy's pieces, one per coordinate of its sharded mesh dims (its key), keys in row-major order:
    ranks[k] the ranks holding piece k (its replicas, row-major over the Replicate dims), starts[k] / stops[k] the
    range of each tensor dim it holds (section 2: a piece is a box). Every rank of the mesh at once, in tensors of
    pieces x dims: no element is ever listed."""

    ranks: torch.Tensor  # (pieces, replicas) int64
    starts: torch.Tensor  # (pieces, tensor dims) int64
    stops: torch.Tensor
    slot: dict  # {rank: (piece, replica)}, filled on demand (position)

    def position(self, rank):
        """(piece, replica) of `rank` in this cut, or None where it is off the mesh."""
        if rank not in self.slot:
            where = torch.nonzero(self.ranks == rank)
            self.slot[rank] = tuple(where[0].tolist()) if where.numel() else None
        return self.slot[rank]


def once(memo, key, make):
    """make(), once per key of memo: in one plan, the matrices of one layout share their pieces (matrix_pieces),
    hence their holders' ranks, and their transfers where they share an owner too; across plans, kept_while_few."""
    if key not in memo:
        memo[key] = make()
    return memo[key]


def kept_while_few(make):
    """make, remembered by its arguments: once for all the copies of one shape on one mesh with the same placements.
    What is about many ranks (more than FEW pieces) is let go at the end of each plan (forget_many), the rest kept
    for the process (a training on a few ranks that builds its optimizer again finds its cuts made)."""
    made = {}

    @functools.wraps(make)
    def remembered(*key):
        return once(made, key, lambda: make(*key))
    remembered.made = made
    return remembered


@kept_while_few
def cut_of(shape, mesh_ranks, mesh_shape, placements):
    """The Cut of a copy (kept_while_few)."""
    cut = sharded_dims(placements)
    order = list(cut) + [i for i in range(len(mesh_shape)) if i not in cut]  # sharded dims first: key-major
    pieces = math.prod(mesh_shape[i] for i in cut)
    ranks = (torch.arange(mesh_ranks.start, mesh_ranks.stop, mesh_ranks.step) if isinstance(mesh_ranks, range)
             else torch.tensor(mesh_ranks, dtype=torch.int64))
    ranks = ranks.view(mesh_shape).permute(order).reshape(pieces, -1)
    starts, stops = [], []
    for d, size in enumerate(shape):
        start, stop = dim_ranges(size, mesh_shape, placements, d)
        starts.append(start.expand(mesh_shape).permute(order).reshape(pieces, -1)[:, 0])
        stops.append(stop.expand(mesh_shape).permute(order).reshape(pieces, -1)[:, 0])
    return Cut(ranks, torch.stack(starts, 1), torch.stack(stops, 1), {})


def cut_of_copy(copy):
    return cut_of(copy.shape, copy.mesh_ranks, copy.mesh_shape, copy.placements)


def held_by(cut, expert):
    """(held, numels) of one matrix of a copy (one expert of a stack, or the 2-D parameter: expert -1), from its
    Cut: whether each piece holds some of it, and how many of its elements."""
    lengths = cut.stops - cut.starts
    numels = lengths[:, -2] * lengths[:, -1]
    held = numels > 0
    if expert >= 0:
        held &= (cut.starts[:, 0] <= expert) & (expert < cut.stops[:, 0])
    return held, torch.where(held, numels, 0)


@kept_while_few
def matrix_pieces(shape, mesh_ranks, mesh_shape, placements, expert):
    """(held, numels, holders) of one matrix of a copy (an expert of a stack, or the 2-D parameter: expert -1):
    whether each piece holds some of it, how many of its elements, and the ranks that hold some, sorted."""
    cut = cut_of(shape, mesh_ranks, mesh_shape, placements)
    held, numels = held_by(cut, expert)
    return held, numels, torch.sort(cut.ranks[held].reshape(-1)).values


@dataclass
class Matrix:
    """One Newton-Schulz input and how it travels; transfers hold only what this rank takes part in."""

    name: str  # e.g. "layers.0.moe.w1[3]", or "router.weight@1,3,5,7" when copies live on several meshes
    copy: Copy
    expert: int  # -1 for a 2-D parameter
    holders: torch.Tensor = field(repr=False)  # global ranks that hold some of it, sorted (int64)
    owner: int = -1
    shape: tuple = ()  # what the owner puts together: the (out, in) matrix, or its TP piece (section 3c)
    tp_dim: int = -1  # section 3c: the mesh dim whose ranks orthogonalize their pieces together; -1: whole at owner
    held: torch.Tensor = field(default=None, repr=False)  # whether each piece of its copy's Cut holds some of it
    numels: torch.Tensor = field(default=None, repr=False)  # and how many of its elements
    lines: tuple = field(default=(), repr=False)  # 3c: the long dim's ranges (start, stop) this TP piece is made of
    # What gather and scatter read (transfers_of): where this rank owns it, both (owned); else, where it holds
    # some of it, its piece (me, numel, at, sends), one tuple for every matrix of one layout.
    owned: tuple = None
    piece: tuple = None

    # gather and scatter alike: (source, destination, numel, at, box), at the holder's end and box at the owner's:
    # at, the part in its holder's local tensor (None for all of it, else its index along an expert stack's dim 0:
    # one expert's (rows, cols), contiguous); box, the (start, stop) of each dim of the part in the owner's matrix
    # (`shape`). Each only where this rank is that end (else None). An owner's in OwnedPieces, read as a list.
    @property
    def gather(self):
        """This rank's transfers that bring m to its owner."""
        if self.owned is not None:
            return self.owned[0]
        if self.piece is None or not self.piece[3]:
            return ()
        me, numel, at, _ = self.piece
        return ((me, self.owner, numel, at, None),)

    @property
    def scatter(self):
        """This rank's transfers that bring the orthogonalized m back from its owner."""
        if self.owned is not None:
            return self.owned[1]
        if self.piece is None:
            return ()
        me, numel, at, _ = self.piece
        return ((self.owner, me, numel, at, None),)

    def box(self, start, stop):
        """A piece's part of this matrix (start, stop: its ranges of the copy's dims, lists), as (start, stop) of
        each dim of the owner's matrix (`shape`)."""
        box = list(zip(start[-2:], stop[-2:]))
        if self.lines:  # a TP piece: its lines one after another
            long_dim = 0 if self.copy.shape[0] > self.copy.shape[1] else 1
            begin, end = box[long_dim]
            offset = 0
            for a, b in self.lines:
                if a <= begin < b:
                    box[long_dim] = (offset + begin - a, offset + end - a)
                    break
                offset += b - a
        return tuple(box)

    def at(self, start):
        """Where a piece's part of this matrix lies in its holder's local tensor: None (all of it) or an expert's
        index along the local stack's dim 0 (start: the piece's starts)."""
        return self.expert - start[0] if self.expert >= 0 else None


def matrix_name(copy, expert, copies_of_name):
    where = "@" + ",".join(map(str, copy.mesh_ranks)) if copies_of_name > 1 else ""
    return copy.name + (f"[{expert}]" if expert >= 0 else "") + where


def routes(m):
    """Every rank's transfers of matrix m (owner known): (gather, scatter), each (sources, destinations, numels)
    int64 tensors in plan order. A piece goes to the owner from its replica that sits where the owner sits along
    the Replicate dims (the owner itself if it holds the piece) and comes back to every replica; the transfers
    plan_matrices gives each rank are its own of these (transfers_of: the same rule)."""
    cut = cut_of_copy(m.copy)
    replica = cut.position(m.owner)[1]
    held, numels = (m.held, m.numels) if m.held is not None else matrix_pieces(
        m.copy.shape, m.copy.mesh_ranks, m.copy.mesh_shape, m.copy.placements, m.expert)[:2]
    keys = torch.nonzero(held).view(-1)
    pieces = cut.ranks.index_select(0, keys)
    sources, numels = pieces[:, replica], numels.index_select(0, keys)
    owner = torch.full_like(sources, m.owner)
    back = pieces.reshape(-1)
    return ((sources, owner, numels),
            (torch.full_like(back, m.owner), back, numels.repeat_interleave(cut.ranks.shape[1])))


FEW = 64  # pieces (or ranks) that the plan lists as Python objects; more are kept as tensors (a choice, not measured)


class OwnedPieces(Sequence):
    """An owner's transfers of its matrix m, one way (gather, or scatter): one a piece (the gather, from the replica
    where the owner sits) or one a replica of every piece (the scatter), as transfers_of says. Made into tuples as
    they are read, from the Cut of m's copy made again, which says which pieces hold some of m (the ranges of each
    dim, section 2: a fraction of a millisecond at 16,384 pieces, beside the tuples themselves). So the owner of a
    matrix in 13,312 pieces (Llama 3 405B on 16,384 ranks) keeps a few integers, not a table of the pieces
    (266 KB) nor 26,624 tuples of boxes (6 MB)."""

    def __init__(self, m, me, pieces, replicas, replica, scatter):
        self.m, self.me, self.pieces, self.replicas, self.replica, self.scatter = (
            m, me, pieces, replicas, replica, scatter)

    def cut(self):
        """The Cut of m's copy: the one kept where it is (kept_while_few), else made again and not kept."""
        c = self.m.copy
        key = (c.shape, c.mesh_ranks, c.mesh_shape, c.placements)
        return cut_of.made.get(key) or cut_of.__wrapped__(*key)

    def rows(self):
        """Each piece that holds some of m: its ranks, then its starts and stops (Python's ints), from the Cut."""
        m, cut = self.m, self.cut()
        held = m.held if m.held is not None else held_by(cut, m.expert)[0]  # the plan's, or a TP piece's (3c)
        return torch.cat([cut.ranks, cut.starts, cut.stops], 1).index_select(0, torch.nonzero(held).view(-1)).tolist()

    def transfers(self, rows):
        """The transfers of these rows (rows()), one way."""
        m, me, replica, replicas = self.m, self.me, self.replica, self.replicas
        dims = (len(rows[0]) - replicas) // 2 if rows else 0
        for row in rows:
            ranks, start, stop = row[:replicas], row[replicas:replicas + dims], row[replicas + dims:]
            box, at = m.box(start, stop), m.at(start)
            numel = (stop[-2] - start[-2]) * (stop[-1] - start[-1])  # of m: one expert's, in a stack
            if self.scatter:
                yield from ((me, r, numel, at if r == me else None, box) for r in ranks)
            else:
                yield ranks[replica], me, numel, at if ranks[replica] == me else None, box

    def __len__(self):
        return self.pieces * (self.replicas if self.scatter else 1)

    def __iter__(self):
        return self.transfers(self.rows())

    def __getitem__(self, i):
        return list(self)[i]

    def __eq__(self, other):
        return isinstance(other, Sequence) and list(self) == list(other)

    def __add__(self, other):  # m.gather + m.scatter: the list of both, as with lists
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    def __repr__(self):  # as the list it reads as (a Matrix's repr shows its transfers)
        return repr(list(self))


def transfers_of(m, me, replica):
    """This rank's part of routes(m), for Matrix.gather and .scatter: (owned, piece). Where it owns m, every
    piece's, both ways (OwnedPieces; listed where there are a few: read every step); else, where it holds some of
    m, its own piece (me, numel, at, sends: whether it is the replica that sends it, the one where the owner sits,
    `replica`)."""
    cut = cut_of_copy(m.copy)
    if me == m.owner:
        pieces, replicas = int(m.held.sum()), cut.ranks.shape[1]
        ways = tuple(OwnedPieces(m, me, pieces, replicas, replica, scatter) for scatter in (False, True))
        if pieces > FEW:
            return ways, None
        rows = ways[0].rows()  # a few: listed once, both ways, and read every step
        return tuple(list(way.transfers(rows)) for way in ways), None
    mine = cut.position(me)
    if mine is None or not bool(m.held[mine[0]]):
        return None, None
    return None, (me, int(m.numels[mine[0]]), m.at(cut.starts[mine[0]].tolist()), mine[1] == replica)


# -----------------------------------------------------------------------------
# 3c. Newton-Schulz on TP pieces, without gathering the matrix (tp_newton_schulz="gram")
# -----------------------------------------------------------------------------
# When TP cuts a matrix along its LONG side (the columns of a wide one, the rows
# of a tall one: large_runs.gram_eligible), Newton-Schulz needs only the small Gram matrix
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


def tp_pieces(copy, tp_dim, copies_of_name):
    """[Matrix] of each TP piece of a 2-D copy cut along its long side on mesh dim tp_dim (each with its pieces of
    the copy's Cut and the long dim's ranges it is made of), or None if a piece is not whole lines (keep the gather)."""
    cut = cut_of_copy(copy)
    rows, cols = copy.shape
    long_dim = 0 if rows > cols else 1
    sharded = sharded_dims(copy.placements)
    after = math.prod(copy.mesh_shape[i] for i in sharded[sharded.index(tp_dim) + 1:])
    key = (torch.arange(cut.ranks.shape[0]) // after) % copy.mesh_shape[tp_dim]  # each piece's TP coordinate
    every, numels, _ = matrix_pieces(copy.shape, copy.mesh_ranks, copy.mesh_shape, copy.placements, -1)
    out = []
    for t in range(copy.mesh_shape[tp_dim]):
        held = every & (key == t)
        spans = sorted({(int(cut.starts[k, long_dim]), int(cut.stops[k, long_dim]))
                        for k in torch.nonzero(held).view(-1).tolist()})
        lines = []
        for a, b in spans:  # the ranges merged where they touch
            if lines and a <= lines[-1][1]:
                lines[-1] = (lines[-1][0], max(lines[-1][1], b))
            else:
                lines.append((a, b))
        n_lines = sum(b - a for a, b in lines)
        if int(numels[held].sum()) != n_lines * copy.shape[1 - long_dim]:
            return None
        shape = (n_lines, cols) if long_dim == 0 else (rows, n_lines)
        out.append(Matrix(f"{matrix_name(copy, -1, copies_of_name)}|tp{t}", copy, -1,
                          torch.sort(cut.ranks[held].reshape(-1)).values, shape=shape, tp_dim=tp_dim,
                          held=held, numels=torch.where(held, numels, 0), lines=tuple(lines)))
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
        c = in_pieces[0].copy
        long_dim = 0 if c.shape[0] > c.shape[1] else 1
        cost = {m.name: gram_flops(m.shape, long_dim, group_ns_steps[c.group]) for m in in_pieces}
        work.append((-sum(cost.values()), in_pieces[0].name, in_pieces, cost))
    for _, _, in_pieces, cost in sorted(work, key=lambda w: w[:2]):
        c, tp_dim = in_pieces[0].copy, in_pieces[0].tp_dim
        mesh_rows = torch.tensor(c.mesh_ranks).view(c.mesh_shape).movedim(tp_dim, -1).reshape(-1, c.mesh_shape[tp_dim])
        row = min(mesh_rows.tolist(), key=lambda ranks: max(load[r] for r in ranks))
        for m, rank in zip(in_pieces, row):
            owners[m.name], flops[m.name] = rank, cost[m.name]
            load[rank] += cost[m.name]
    return load, flops, owners


def as_ranks(holders):
    """Sorted int64 ranks as a Python sequence: a range where they are evenly spaced (a TP column, every rank: no
    list of 16,384 ints per matrix kept at once), else a list."""
    if len(holders) <= FEW:  # Python's ints, faster than tensor ops on them
        ranks = holders.tolist()
        step = ranks[1] - ranks[0] if len(ranks) > 1 else 0
        if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return range(ranks[0], ranks[-1] + 1, step)
        return ranks
    step = holders[1:] - holders[:-1]
    if bool((step == step[0]).all()) and int(step[0]) > 0:
        return range(int(holders[0]), int(holders[-1]) + 1, int(step[0]))
    return holders.tolist()


def ranks_of(ranks):
    """Global ranks (of a mesh, row-major, or of a process group) as a range where they are evenly spaced and
    increasing, else a tuple: what a Copy or an Axis keeps of 16,384 ranks is 48 bytes, not 16,384 Python ints."""
    ranks = as_ranks(torch.as_tensor(ranks, dtype=torch.int64).reshape(-1))
    return ranks if isinstance(ranks, range) else tuple(ranks)


def forget_many():
    """Let go of the cuts (and their pieces) of more than FEW pieces that the plans made (kept_while_few)."""
    for made, pieces in ((cut_of.made, lambda cut: len(cut.ranks)), (matrix_pieces.made, lambda held: len(held[0]))):
        for key in [key for key, value in made.items() if pieces(value) > FEW]:
            del made[key]


def plan_matrices(copies, group_ns_steps, me, world, assign=None, flops_of=None, tp_dim_of=None, group=None):
    """Every distributed matrix of `copies`, with owners and this rank's transfers; and the owners. What each matrix
    keeps is what this rank's steps read: its transfers (an owner's in OwnedPieces), not every piece's holders and
    sizes (holders, held, numels: None after the plan, but for the TP pieces of 3c; routes() finds them again), and
    the cuts of many pieces are let go (forget_many): what construction keeps grows with this rank's share.

    assign: None for the lesson's assign_owners among each matrix's holders, or a callable
        (ns_flops, holders, world) -> {rank: [names]}
        (the matrices gathered whole; TP pieces, section 3c, go to the rows of ranks gram_owners picks).
    flops_of: None, or a callable (copy, steps) -> Newton-Schulz FLOPs of one of its matrices (blocks: section 3b).
    tp_dim_of: None, or a callable copy -> the mesh dim whose TP pieces are orthogonalized in place (3c), or -1.
    group: None, or the global ranks of the optimizer's group (fewer than the world): a matrix held or owned by a
        rank outside it is refused.
    """
    flops_of = flops_of or (lambda c, steps: newton_schulz_flops(c.matrix_shape, steps))
    copies_of_name = {}
    for c in copies:
        copies_of_name[c.name] = copies_of_name.get(c.name, 0) + 1
    matrices, gram = [], []
    for c in copies:
        if c.local:
            continue
        tp_dim = tp_dim_of(c) if tp_dim_of else -1
        in_pieces = tp_pieces(c, tp_dim, copies_of_name[c.name]) if tp_dim >= 0 else None
        if in_pieces:
            gram.append(in_pieces)
            continue
        for e in range(c.n_matrices) if c.expert_stack else [-1]:
            held, numels, holders = matrix_pieces(c.shape, c.mesh_ranks, c.mesh_shape, c.placements, e)
            matrices.append(Matrix(matrix_name(c, e, copies_of_name[c.name]), c, e, holders,
                                   shape=tuple(c.matrix_shape), held=held, numels=numels))
    ns_flops = {m.name: flops_of(m.copy, group_ns_steps[m.copy.group]) for m in matrices}
    holders = {m.name: m.holders for m in matrices}
    load, gram_flops, gram_owners = gram_owners_of(gram, group_ns_steps, world)
    memo = {}  # within this plan, where every matrix (and so the id of its pieces' tensors) is alive
    if assign is None:
        owners = assign_owners(ns_flops, world, {m.name: tuple(m.copy.matrix_shape) for m in matrices},
                               holders={n: once(memo, id(h), lambda h=h: as_ranks(h)) for n, h in holders.items()},
                               load=load)
    else:
        owners = check_owners(assign(ns_flops, {n: tuple(h.tolist()) for n, h in holders.items()}, world),
                              list(ns_flops), world)
        strangers = [f"{n} (rank {owners[n]}; holders {holders[n].tolist()})" for n in owners
                     if not bool((holders[n] == owners[n]).any())]
        if strangers:
            raise ValueError("bad owner assignment: owned by a rank that holds none of it: " + "; ".join(strangers))
    matrices += [m for in_pieces in gram for m in in_pieces]
    ns_flops.update(gram_flops)
    owners.update(gram_owners)
    for m in matrices:
        m.owner = owners[m.name]
        sender = cut_of_copy(m.copy).position(m.owner)[1]  # the replica whose pieces go to the owner
        key = (id(m.held), m.owner if m.owner == me else -1, sender, m.expert, m.lines)  # a piece: one a layout
        m.owned, m.piece = once(memo, key, lambda m=m, sender=sender: transfers_of(m, me, sender))
    inside = torch.tensor(group) if group is not None else None
    outside = sorted({m.name for m in matrices if inside is not None and (
        not bool(torch.isin(m.holders, inside).all()) or m.owner not in group)})
    if outside:
        raise ValueError(f"matrices held by ranks outside the optimizer's group: {', '.join(outside)}")
    for m in matrices:
        if not m.lines:
            m.holders = m.held = m.numels = None
    forget_many()
    return matrices, ns_flops, owners


MESHES = weakref.WeakKeyDictionary()  # DeviceMesh -> mesh_description(it), while the mesh lives


def mesh_description(mesh):
    """(its ranks row-major (ranks_of), its shape, its dim names) of a DeviceMesh, read once a mesh
    (DeviceMesh.mesh is made anew at each call): equal meshes, by DeviceMesh's own ==, have the same ranks, shape
    and names."""
    known = MESHES.get(mesh)
    if known is None:
        ranks = mesh.mesh
        known = MESHES[mesh] = (ranks_of(ranks), tuple(ranks.shape), tuple(mesh.mesh_dim_names or ()))
    return known


def describe(name, group_index, p, expert_stack):
    """The Copy of parameter p as this rank sees it (what the ranks swap at construction)."""
    if isinstance(p, DTensor):
        mesh_ranks, mesh_shape, dim_names = mesh_description(p.device_mesh)
        return Copy(name, group_index, tuple(p.shape), mesh_ranks, mesh_shape, tuple(p.placements), expert_stack,
                    dim_names)
    return Copy(name, group_index, tuple(p.shape), (), (), (), expert_stack)


ONE_PER_OWNER = "one_per_owner"  # DTensorMuon's exchange_bytes="one_per_owner": a group, one matrix of each owner


def exchange_limit(exchange_bytes, matrix_shapes, world):
    """DTensorMuon's exchange_bytes in bytes, for the matrices orthogonalized where they are (no owner: every holder
    does them): as given, or for ONE_PER_OWNER the world's size times the largest matrix's bf16 bytes (matrix_shapes:
    theirs), as many as a group of equal matrices, one for each rank, would hold."""
    if exchange_bytes != ONE_PER_OWNER:
        return exchange_bytes
    return world * 2 * max((math.prod(shape) for shape in matrix_shapes), default=1)


def one_per_owner(matrices):
    """The parameters of `matrices` (the plan's, in its order: the same on every rank) in groups where no owner has
    two matrices (name tuples): each parameter in the first group after the last one that holds a matrix of any of
    its owners. So an owner holds one matrix at a time, and an owner's k-th matrix goes in group k where each
    parameter has one owner: every owner with matrices left works in each group. A parameter with two matrices of
    one owner (an expert stack on fewer ranks than experts) makes a group alone. One pass: a step makes them."""
    owners_of = {}
    for m in matrices:
        owners_of.setdefault(m.copy.name, []).append(m.owner)
    groups, alone, next_free = [], set(), {}  # next_free: owner -> the first group it can join
    for name, owners in owners_of.items():
        if len(set(owners)) < len(owners):
            alone.add(len(groups))
            groups.append([name])
            continue
        i = max(next_free.get(o, 0) for o in owners)
        while i in alone:
            i += 1
        if i == len(groups):
            groups.append([])
        groups[i].append(name)
        next_free.update((o, i + 1) for o in owners)
    return [tuple(names) for names in groups]


def exchange_groups(matrices, exchange_bytes):
    """DTensorMuon's exchange_bytes: the parameters of `matrices` (in their order: the plan's, the same on every
    rank) in groups of at most exchange_bytes of bf16 matrices each, a larger parameter alone, or one_per_owner's
    groups (name tuples)."""
    if exchange_bytes == ONE_PER_OWNER:
        return one_per_owner(matrices)
    sizes = {}
    for m in matrices:
        sizes[m.copy.name] = sizes.get(m.copy.name, 0) + 2 * math.prod(m.shape)
    return chunk_names(list(sizes), sizes, exchange_bytes)
