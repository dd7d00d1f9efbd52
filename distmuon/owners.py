"""Orthogonalize each matrix once: the owner and comm-free strategies (Owner, CommFree; OwnerMuon, CommFreeMuon).

Section 7 of the lesson, in a file of its own: read distributed_muon_cpu.py's sections 1-6 first. The gather flow
of section 4 orthogonalizes a matrix on every rank that touches it. The two strategies here give every matrix ONE
owner among the DP x TP ranks, balanced by Newton-Schulz FLOPs. Each is a strategy that section 5's DistributedMuon
plugs into its step (its strategy=), with stage 3 replaced (comm-free: stages 1 and 4 extended):

    owner      ZeRO-1 unchanged; the parts of every matrix go to its owner and back (two all-to-alls)
    comm-free  ZeRO-1 keeps Muon matrices whole: reduced at the owner row, its update broadcast

and two options of their own: the step overlapped with its collectives (overlap=K, --overlap), and same-shape
matrices batched (batched_ns, --batched-ns). Launch recipes (the lesson's command line):

    python distributed_muon_cpu.py --strategy owner --explain   # one owner per matrix, and who owns what
    python distributed_muon_cpu.py --model thin --strategy comm-free   # 81 matrices with a small side
    python distributed_muon_cpu.py --strategy owner --overlap   # the step pipelined, collectives in flight
    python benchmarks/compare.py          # gather, owner, comm-free, AdamW ZeRO-1: bytes, FLOPs, balance, time

Import them: the optimizers are real torch.optim.Optimizers, section 5's with these strategies plugged in:
    from distmuon import OwnerMuon, CommFreeMuon   # = DistributedMuon(..., strategy=Owner(...) or CommFree(...))

A strategy of your own goes at the end, beside them (OPTIMIZERS), or into register: notes/08-strategies.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from distmuon.assignment import assign_owners, check_owners, load_balance, lpt_order  # noqa: F401 (7.1's names)
from distmuon.collectives import all_gather_single, reduce_scatter_sum, sum_in_order
from distmuon.checks import ORTHOGONALIZED
from distmuon.normuon import batched_problem, full_rows, normalized_part, normuon_rows, part_rows
from distmuon.strategy import DECLARED
from distributed_muon_cpu import (NS_COEFFICIENTS, NS_EPS, NS_STEPS, DistributedMuon, Gather, Unit, apply_muon_update_,
                                  newton_schulz, newton_schulz_flops, orthogonalize, tp_shard)
# (Bound here at import: whoever patches distributed_muon_cpu.newton_schulz patches it here too, as scaling.py does.)

# =============================================================================
# 7. Orthogonalize each matrix once: the owner and comm-free strategies
# =============================================================================
# In the gather flow a matrix is orthogonalized by every rank that touches it:
# TP x (DP shards it touches) times, up to DP x TP, and every one of those ranks
# receives the whole matrix. Zero-redundancy designs give every matrix ONE owner
# among all DP x TP ranks, balanced by Newton-Schulz FLOPs:
#
# owner (--strategy owner): ZeRO-1 is unchanged (the same buckets, reduce-scatter,
# momentum shards and parameter all-gather); only the middle changes. Every rank
# sends its momentum part of each matrix straight to the matrix's owner, all
# matrices in ONE all-to-all over the world; the owner puts the parts together,
# orthogonalizes, and a second all-to-all returns each rank exactly its part:
#
#   rank (0,0): part of W --\                             /--> rank (0,0): part of O
#   rank (0,1): part of W ---+--> owner: O = NS(W) -------+--> rank (0,1): part of O
#   ...                    --/                             \--> ...
#          gather at owner (one all_to_all)    scatter from owner (one all_to_all)
#
# comm-free (--strategy comm-free): ZeRO-1 shards Muon matrices WHOLE across DP
# (torchtitan's communication-free Muon). A matrix's owner row (a DP rank)
# keeps its full TP-local momentum; the gradient is reduced at that row instead
# of reduce-scattered, and instead of an all-gather of fp32 weights the row
# broadcasts its bf16 update, which every DP rank applies to its own copy of the
# weights (equal on every DP rank: the same arithmetic, the same bits). With
# TP = 1 nothing else moves: fewer bytes than AdamW ZeRO-1 (half of its
# matrices' all-gather, and no padding), hence "communication-free" Muon.
# With TP > 1 the TP pieces of the matrix still have to meet, at one rank of
# the owner row: the same gather at owner / scatter from owner as above, but
# inside the row's TP group only:
#
#     all DP ranks --grad reduce at owner--> owner row (d_o, 0..TP-1): momentum, TP-local, whole
#     (d_o, t)     --gather at owner (TP)--> owner (d_o, t_o): O = NS(W) --scatter from owner (TP)--> (d_o, t)
#     owner row    --update broadcast from owner--> all DP ranks
#
# A TP-replicated matrix (an MoE router) is the same on every TP rank, so only
# the owner's own TP column sends its parts; every holder gets O back.
#
# Seven sections: who owns what (7.1), the routes of a matrix's parts (7.2), the
# exchanges that move them, collectives in flight (7.3), Newton-Schulz at the
# owner, one matrix or one stack at a time (7.4), comm-free's reduce at and
# broadcast from the owner row (7.5), the step overlapped with its collectives
# (7.6), and the strategies, Owner and CommFree: plugged into section 5's optimizer,
# they replace its stage 3 (and, for comm-free, extend stages 1 and 4), every
# other stage its own (7.7).


# -----------------------------------------------------------------------------
# 7.1 Who owns what: longest-processing-time over Newton-Schulz FLOPs
# -----------------------------------------------------------------------------
# Each matrix to the rank with the least Newton-Schulz work so far, largest first
# (distmuon/assignment.py: lpt_order, assign_owners, check_owners, load_balance),
# the rule DTensorMuon's plan uses too.


# -----------------------------------------------------------------------------
# 7.2 Routes: where a matrix's parts are, and how they travel to its owner
# -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    """A rank's part of a matrix, as the exchanges with its owner see it."""

    rank: int  # index along the exchange axis of the rank that keeps it
    tp_rank: int  # which TP piece of the matrix it is a range of
    start: int  # its range of the flattened TP piece
    stop: int


@dataclass(frozen=True)
class Route:
    """How one matrix travels to its owner and back, along one exchange axis."""

    name: str
    owner: int  # index along the exchange axis
    shape: tuple  # TP-local shape
    tp_split_dim: int  # -1: not split (replicated, or TP = 1)
    tp_size: int
    holders: tuple  # the Part of every rank that keeps state for some of it: the update comes back to each
    senders: tuple  # the holders whose parts make up the full matrix, in (tp_rank, position) order


def plan_routes(matrices, owners, part_of, layout, grid, axis):
    """The routes of the matrices whose owner is on this rank's `axis` (all of them for the world).
    part_of(name, dp_rank): the slice of the flat TP piece that DP rank keeps state for."""
    dp, tp = grid.dp.size, grid.tp.size
    routes = []
    for name in matrices:
        if owners[name] not in axis.ranks:
            continue  # comm-free: another DP row's matrix, none of our business
        owner_tp = owners[name] % tp
        split = layout.tp_split_dims[name] if tp > 1 else -1
        holders = []
        for t in range(tp):
            for d in range(dp):
                part = part_of(name, d)
                if part.stop > part.start:
                    holders.append(Part(axis.ranks.index(d * tp + t), t, part.start, part.stop))
        senders = tuple(h for h in holders if split >= 0 or h.tp_rank == owner_tp)
        routes.append(Route(name, axis.ranks.index(owners[name]), layout.shapes[name], split, tp, tuple(holders),
                            senders))
    return routes


# -----------------------------------------------------------------------------
# 7.3 The exchanges: collectives in flight
# -----------------------------------------------------------------------------
# Section 2's collectives return their result (its reduce-scatter starts one and
# waits at once). Here a rank may start one and compute while it travels:
# torch's async_op=True returns a Work to wait on later, and every function
# below that starts one returns a function that waits for it and returns the
# result (later()). The tensors passed in must stay untouched until that wait.
# What was in flight while what ran is then worth a record of its own: section
# 2's Ledger keeps the order of launches, waits and orthogonalizations (a launch
# with no wait is one of section 2's collectives, over when it returns).

def later(work, phase, ledger, result):
    """A started collective: a function that waits for `work` (None: nothing to wait for) and
    returns result(). The wait is labelled with the phase, as the launch is, and recorded in the
    ledger; once waited for, the Work is let go, and with it the buffers it held (a send buffer)."""
    pending = [work] if work is not None else []

    def wait():
        if pending:
            with record_function(phase):
                pending.pop().wait()
            ledger.record_wait(phase)
        return result()
    return wait


def concat(tensors, dtype, device):
    """The tensors' elements one after another, in one 1-D tensor: a lone flat one as it is, else a new one, each copied
    once (a strided view of a matrix straight into its place, with no flat copy of its own first)."""
    if len(tensors) == 1 and tensors[0].dim() == 1 and tensors[0].is_contiguous() and tensors[0].dtype == dtype:
        return tensors[0]  # one part to send (e.g. the one other rank's of 2): no copy of it beside it
    if tensors and all(t.dim() == 1 for t in tensors):
        return torch.cat(tensors)
    out, start = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device), 0
    for t in tensors:
        out[start:start + t.numel()].view(t.shape).copy_(t)
        start += t.numel()
    return out


def exchange(sends, receive_numels, axis, ledger, phase, dtype, device):
    """All-to-all with uneven sizes, started: sends[i], a list of 1-D tensors, goes to rank i of `axis`, all of them
    in one send buffer (concat; a lone one is that buffer itself: it is read until the wait, so left unchanged).

    receive_numels[i] is how much rank i sends here (every rank knows the whole plan, so nobody has to ask).
    Returns a function that waits and returns one 1-D tensor per source rank. Each piece goes straight to its
    destination, so the byte count is exact: what a rank sends to the others, and receives from them."""
    send = concat([t for ts in sends for t in ts], dtype, device)
    received = send.new_empty(sum(receive_numels))
    split_sizes = [sum(t.numel() for t in ts) for ts in sends]
    work = None
    if axis.size == 1:
        received.copy_(send)
    else:
        with record_function(phase):
            work = dist.all_to_all_single(received, send, list(receive_numels), split_sizes,
                                          group=axis.group, async_op=True)
    others = [i for i in range(axis.size) if i != axis.rank]
    ledger.record_comm(phase, "all_to_all", axis, sum(split_sizes[i] for i in others),
                       sum(receive_numels[i] for i in others), send.dtype)
    return later(work, phase, ledger, lambda: list(received.split(list(receive_numels))))


def send_parts(transfers, axis, ledger, phase, dtype, device):
    """Move many parts in one all-to-all. transfers: (source, destination, numel, part) along `axis`,
    in an order every rank agrees on; `part` is the tensor on its source rank (None elsewhere).

    A part a rank sends to itself is handed over as it is (its shape too): no copy and no message.
    On a group of one nothing else exists, and no collective is called.
    Returns a function that waits and returns, in that order, the parts this rank receives.
    """
    me = axis.rank
    sends, receive = [[] for _ in range(axis.size)], [0] * axis.size
    for source, destination, numel, part in transfers:
        if source == destination:
            continue
        if source == me:
            sends[destination].append(part)
        if destination == me:
            receive[source] += numel
    wait = exchange(sends, receive, axis, ledger, phase, dtype, device) if axis.size > 1 else None

    def received_parts():
        received, offset, parts = wait() if wait else None, [0] * axis.size, []
        for source, destination, numel, part in transfers:
            if destination != me:
                continue
            if source == me:
                parts.append(part)
            else:
                parts.append(received[source][offset[source]:][:numel])
                offset[source] += numel
        return parts

    return received_parts


def gather_at_owner(updates, routes, axis, ledger, dtype, device):
    """Every rank's bf16 part of each routed matrix -> the full matrix, at its owner only.

    One all-to-all for all the routes. Returns a function that waits and returns
    {name: full matrix} of the matrices this rank owns.
    """
    me = axis.rank
    wait = send_parts([(p.rank, r.owner, p.stop - p.start, updates[r.name] if p.rank == me else None)
                       for r in routes for p in r.senders], axis, ledger, "gather at owner", dtype, device)

    def assemble():
        parts, full = iter(wait()), {}
        for r in routes:
            if r.owner != me:
                continue
            tp_locals = {}  # tp_rank -> its flattened TP-local matrix, part by part in DP order
            for p in r.senders:
                tp_locals.setdefault(p.tp_rank, []).append(next(parts))
            # One part is the whole TP piece (DP = 1, or comm-free): used as it is, not copied.
            mats = [(flats[0] if len(flats) == 1 else torch.cat(flats)).view(r.shape)
                    for _, flats in sorted(tp_locals.items())]
            full[r.name] = torch.cat(mats, dim=r.tp_split_dim) if r.tp_split_dim >= 0 else mats[0]
        return full

    return assemble


def scatter_from_owner(orthos, routes, axis, ledger, dtype, device):
    """The mirror of gather_at_owner: each owner's orthogonalized matrices -> every holder's part.

    Returns a function that waits and returns {name: this rank's part}.
    """
    me = axis.rank

    def part_of_ortho(r, p):  # the owner cuts the holder's part out: TP shard, then its flat range
        return tp_shard(orthos[r.name], r.tp_split_dim, p.tp_rank, r.tp_size).reshape(-1)[p.start:p.stop]

    wait = send_parts([(r.owner, p.rank, p.stop - p.start, part_of_ortho(r, p) if r.owner == me else None)
                       for r in routes for p in r.holders], axis, ledger, "scatter from owner", dtype, device)
    mine = [r.name for r in routes for p in r.holders if p.rank == me]
    return lambda: dict(zip(mine, wait()))


def orthogonalize_at_owners(updates, routes, newton_schulz_fn, axis, ledger, device):
    """gather at owner -> Newton-Schulz (owners only) -> scatter from owner: {name: this rank's part}."""
    dtype = torch.bfloat16  # the updates were cast to Newton-Schulz's input type before they travel
    full = gather_at_owner(updates, routes, axis, ledger, dtype, device)()
    return scatter_from_owner(newton_schulz_fn(full), routes, axis, ledger, dtype, device)()


# -----------------------------------------------------------------------------
# 7.4 Newton-Schulz at the owner: one matrix at a time, or one stack
# -----------------------------------------------------------------------------
# Batched Newton-Schulz (batched_ns, --batched-ns): an owner's same-shape matrices
# as one stack, newton_schulz with torch.baddbmm, one call for all of them. The
# same math but NOT the same bits: bf16 baddbmm and addmm round some near-ties
# differently, so a stack is used only when asked for. BATCHED_NS_BOUND is the
# largest |stack result - 2-D result|, relative to the largest entry of the 2-D
# result, that tests/test_math.py allows: a bf16 entry carries 8 significant bits
# (relative step 2**-8), and a few roundings that differ early grow through the 5
# iterations; 2**-5 leaves a margin over what was measured on many seeds and odd
# shapes (tests/test_math.py, notes/07-pitfalls.md).
BATCHED_NS_BOUND = 2.0**-5


def batched_newton_schulz(stack, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, eps=NS_EPS):
    """newton_schulz of a (batch, rows, cols) stack of same-shape matrices, one torch.baddbmm call
    for all of them per product: within BATCHED_NS_BOUND of torch's result, not bitwise equal."""
    return newton_schulz(stack, steps, coefficients, eps, fused_mm=torch.baddbmm)


def newton_schulz_owned(full, group_of, ledger, batched=False, blocks=None):
    """Newton-Schulz of every matrix an owner holds ({name: full matrix}): {name: ortho}.

    One matrix at a time by default: the 2-D path torch.optim.Muon takes, hence
    torch's bits. batched: one call per (shape, hyperparameters) stack, so many
    small matrices cost one call instead of many; not bitwise equal to torch, within
    BATCHED_NS_BOUND (above). Matrices `blocks` names (orthogonalize) go one by one.
    """
    orthos = {}
    if batched:
        stacks = {}
        for name, matrix in full.items():
            if blocks is not None and name in blocks.blocks:
                continue
            g = group_of[name]
            key = (matrix.shape, g["ns_steps"], repr(g["ns_coefficients"]), g["eps"])  # options as the group has them
            stacks.setdefault(key, (g, []))[1].append(name)
        for (shape, steps, _, eps), (g, names) in stacks.items():
            with record_function("newton-schulz"):
                stack = batched_newton_schulz(torch.stack([full[n] for n in names]), steps, g["ns_coefficients"], eps)
            orthos.update(zip(names, stack.unbind(0)))
            for name in names:
                ledger.record_compute(name, tuple(shape), newton_schulz_flops(shape, steps))
    for name, matrix in full.items():
        if name not in orthos:
            orthos[name] = (blocks.orthogonalize if blocks is not None else orthogonalize)(name, matrix, group_of[name],
                                                                                         ledger)
    return orthos


# -----------------------------------------------------------------------------
# 7.4b NorMuon at the owner: each row's second moment, and the rows it sends
# -----------------------------------------------------------------------------
# A param group of algorithm "normuon" divides each row of O by the root of its own second moment v, then rescales O
# to the norm it had: whole rows and the whole matrix, which the owner has (distmuon/normuon.py, "At an owner").


# -----------------------------------------------------------------------------
# 7.5 comm-free: the gradient reduced at the owner row, its update broadcast
# -----------------------------------------------------------------------------

def zeros_if_none(grad, param):
    """A rank without a gradient for a parameter others have one for adds zeros (as DDP does)."""
    return torch.zeros_like(param) if grad is None else grad


def reduce_at_owner(grads, owners, grid, ledger, device, async_op=False):
    """comm-free: every DP rank's TP-local gradient of each matrix -> its sum, on the owner row only.

    One all-to-all over DP carries the matrices given (a chunk of at most
    bucket_size elements) to their owner rows, which add the DP contributions in
    DP-rank order (exact here: section 6). The same bytes as a reduce-scatter,
    with matrices instead of equal shards as the unit.
    With async_op: a function that waits and returns the sums.
    """
    dp, tp = grid.dp, grid.tp.size
    mine = [n for n in grads if owners[n] // tp == dp.rank]
    if dp.size == 1:  # the only contribution is this rank's own: nothing to move or add
        sums = {n: grads[n].reshape(-1) for n in mine}
        return (lambda: sums) if async_op else sums
    # This rank's own contribution stays where it is: nothing sent to itself, nothing copied.
    sends = [[grads[n].reshape(-1) for n in grads if owners[n] // tp == d] if d != dp.rank else []
             for d in range(dp.size)]
    numel = sum(grads[n].numel() for n in mine)
    wait = exchange(sends, [numel if d != dp.rank else 0 for d in range(dp.size)], dp, ledger,
                    "grad reduce at owner", torch.float32, device)

    def add_up():
        received = [flat.split([grads[n].numel() for n in mine]) if d != dp.rank else None
                    for d, flat in enumerate(wait())]
        return {n: sum_in_order([grads[n].reshape(-1) if d == dp.rank else received[d][i] for d in range(dp.size)])
                for i, n in enumerate(mine)}

    return add_up if async_op else add_up()


def broadcast_from_owner(orthos, numels, owners, grid, ledger, device, apply, async_op=False,
                         phase="update broadcast from owner", dtype=torch.bfloat16):
    """comm-free, the mirror of reduce_at_owner: the owner row's orthogonalized TP-local matrices (bf16,
    orthos: {name: flat} on the owner row, what its own update took; numels: {name: numel} of the
    matrices to move, the same on every rank) -> every other DP rank, which applies the same update to
    its own copy of the weights, apply(name, ortho). Those copies are equal on every DP rank, so each
    ends with the owner row's weights, bit for bit, for half the bytes of sending them in fp32.
    With async_op: a function that waits and applies them."""
    dp, tp = grid.dp, grid.tp.size
    if dp.size == 1:  # no other DP rank to send to
        return (lambda: None) if async_op else None
    mine = [orthos[n] for n in numels if owners[n] // tp == dp.rank]
    sends = [mine if d != dp.rank else [] for d in range(dp.size)]
    theirs = [[n for n in numels if owners[n] // tp == d] if d != dp.rank else [] for d in range(dp.size)]
    wait = exchange(sends, [sum(numels[n] for n in names) for names in theirs], dp, ledger, phase, dtype, device)

    def apply_received():
        for names, flat in zip(theirs, wait()):
            for name, ortho in zip(names, flat.split([numels[n] for n in names])):
                apply(name, ortho)

    return apply_received if async_op else apply_received()


# -----------------------------------------------------------------------------
# 7.6 The step overlapped with its collectives (overlap=K, --overlap K)
# -----------------------------------------------------------------------------
# Stages 1-4 above run one after the other, so a rank's core sits idle while its
# messages travel, and its transfers wait while it computes. With overlap, the
# step is pipelined unit by unit (a unit is a ZeRO-1 bucket; for comm-free's
# matrices, a chunk of them of at most bucket_size elements) and every
# collective is started asynchronously:
#
#   every gradient reduction starts at once; then, iteration i of the loop:
#     unit i      1->2  wait for its summed gradient, update momentum / AdamW,
#                       start its gather at owner                          -> G(i)
#     unit i-K    3     wait G(i-K), Newton-Schulz of what this rank owns,
#                       start its scatter from owner                       -> S(i-K)
#     unit i-2K   3, 4  wait S(i-2K), apply the update, start the param all-gather
#   and at the end, wait for every param all-gather. With K = 1:
#
#   main thread: | state 0 | state 1 | NS 0        | state 2 | NS 1        | apply 0 | ...
#   in flight:   | R1 R2 ... Rn, G0  | G1, R2..Rn  | S0      | G2, S0 ...  | A0      | ...
#
# So the Newton-Schulz of a unit runs while the gradients of later units are
# still being reduced (R), later units' parts travel to their owners (G) and
# earlier units' results travel back (S) and their parameters are all-gathered
# (A). Every rank starts the same collectives in the same order on each group,
# which is all that asynchronous collectives need to match up. Nothing is
# computed differently: the same elements go through the same operations, so
# the bits are the same.
#
# Why K (the lookahead) and not just 1: a gather at owner cannot complete before
# every rank has started it. With K = 1 the ranks move in lock-step, one unit at
# a time, and a rank that owns nothing in a unit waits for the one that owns its
# matrix; K units of slack let them drift apart by up to K units (what each K
# cost on 2 cores: benchmarks/overlap.py, notes/measured/overlap_2rank_2core.txt).
# Whether overlap is faster at all depends on having something to overlap with: a
# core or a copy engine that is idle while messages travel (notes/08-strategies.md).
# On one rank nothing travels: the stages run in turn, bucket by bucket, whatever K is.
OVERLAP_DEFAULT = 2  # --overlap without a number


def all_gather_async(shard, axis, ledger, phase):
    """Section 2's all_gather, started: a function that waits and returns its result."""
    if axis.size == 1:
        return lambda: shard
    out = shard.new_empty(axis.size * shard.numel())
    with record_function(phase):
        work = all_gather_single(out, shard, group=axis.group, async_op=True)
    ledger.record_ring(phase, "all_gather", axis, shard)
    return later(work, phase, ledger, lambda: out)


def reduce_scatter_async(bucket, axis, ledger, phase):
    """Section 2's reduce_scatter, started: a function that waits and returns this rank's shard."""
    if axis.size == 1:
        return lambda: bucket
    with record_function(phase):
        work, shard = reduce_scatter_sum(bucket, axis)
    ledger.record_ring(phase, "reduce_scatter", axis, bucket[:bucket.numel() // axis.size])
    return later(work, phase, ledger, shard)


def start_reduce(opt, unit, active):
    """Stage 1 of a unit started (every bucket's reduce-scatter, every chunk's reduce at owner): a function that
    waits and returns {name: this rank's part of the gradient summed over DP}, as section 5's stage 1 does."""
    waits = [(b, reduce_scatter_async(opt.grad_bucket(b), opt.grid.dp, opt.ledger, "grad reduce-scatter"))
             for b in unit.buckets]
    chunks = [opt.strategy.reduce_chunk(opt, chunk, active, async_op=True) for chunk in unit.chunks]

    def wait():
        grads = {}
        for bucket, shard in waits:
            grads.update(opt.grad_parts(bucket, shard(), active))
        for reduced in chunks:
            grads.update(reduced())
        return grads
    return wait


def start_gather(opt, unit, active):
    """Stage 4 of a unit started: a function that waits and puts the weights in place."""
    waits = [(b, all_gather_async(opt.param_shard(b), opt.grid.dp, opt.ledger, "param all-gather"))
             for b in unit.buckets]
    chunks = [opt.strategy.broadcast_chunk(opt, chunk, active, async_op=True) for chunk in unit.chunks]

    def wait():
        for bucket, gathered in waits:
            opt.copy_in(bucket, gathered())
        for applied in chunks:
            applied()
    return wait


def overlapped_stages(opt, active, k):
    """The stages of every unit pipelined K units deep (above), each collective started as soon as it can be: the
    owner strategies' schedule with overlap=K, made of the same steps as section 5's stages in turn."""
    strategy, axis, dtype, device = opt.strategy, opt.strategy.axis(opt), torch.bfloat16, opt.device
    units = strategy.units(opt)
    # Which matrices of each unit travel to an owner: the same on every rank of the axis, so a unit without any
    # starts no exchange anywhere.
    routes = [strategy.routes_of(u, active) for u in units]
    reduced = [start_reduce(opt, u, active) for u in units]  # 1: every reduction starts now
    gathered, scattered, gathered_params = {}, {}, []
    for i in range(len(units) + 2 * k):
        if i < len(units):  # unit i: 1 -> 2, then start its gather at owner
            updates = opt.update_state(reduced[i]())
            if routes[i]:
                gathered[i] = gather_at_owner(updates, routes[i], axis, opt.ledger, dtype, device)
        if i - k in gathered:  # unit i-k: 3, while later units' transfers and reductions fly
            orthos = strategy.newton_schulz(opt, gathered.pop(i - k)())
            scattered[i - k] = strategy.scatter(opt, orthos, routes[i - k])
        if 0 <= i - 2 * k < len(units):  # unit i-2k: the end of 3, then start 4
            if i - 2 * k in scattered:
                for name, ortho_part in scattered.pop(i - 2 * k)().items():
                    opt.apply_update(name, ortho_part)
            gathered_params.append(start_gather(opt, units[i - 2 * k], active))
    for wait in gathered_params:
        wait()


def chunk_names(names, numel, size):
    """Consecutive names in chunks of at most `size` elements (a larger one alone)."""
    chunks, current, total = [], [], 0
    for name in names:
        if current and total + numel[name] > size:
            chunks.append(tuple(current))
            current, total = [], 0
        current.append(name)
        total += numel[name]
    return chunks + ([tuple(current)] if current else [])


def check_owner_options(name=str, *, owners=None, overlap=0, batched_ns=False):
    """The owner strategies' own arguments, each refused in one line naming it (spelled by `name`: a keyword, or
    the runner's flag)."""
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"{name('overlap')} must be an integer >= 0 (got {overlap!r})")
    if not isinstance(batched_ns, bool):
        raise ValueError(f"{name('batched_ns')} must be True or False (got {batched_ns!r})")
    if owners is not None and not (isinstance(owners, dict) and all(isinstance(v, (list, tuple)) for v in owners.values())):
        raise ValueError(f"{name('owners')} must be a dict {{rank: [matrix names]}} (got {owners!r:.80})")


# -----------------------------------------------------------------------------
# 7.7 The strategies: Owner and CommFree, plugged into section 5's DistributedMuon
# -----------------------------------------------------------------------------

class Owner(Gather):
    """The owner strategy: ZeRO-1 exactly as in section 5 (the same buckets, reduce-scatter, momentum parts and
    all-gather); stage 3 is gather at owner -> Newton-Schulz on the owner -> scatter from owner.

    owners: {rank: [matrix names]} to override the balanced assignment (every Muon matrix exactly once).
    overlap: 0 (off), or K >= 1: pipeline the step bucket by bucket with asynchronous collectives, Newton-Schulz
        K units behind the reductions (7.6); the same bytes in more, smaller all-to-alls, and the same bits.
    batched_ns: orthogonalize an owner's same-shape matrices in one batched call. Faster for many small
        matrices, but not bitwise equal to torch: within BATCHED_NS_BOUND (7.4). Off by default.
    """

    name = "owner"
    phases = ("grad presence", "grad reduce-scatter", "gather at owner", "scatter from owner", "param all-gather")
    own_options = ("overlap", "batched_ns")  # the run's flags set these (owners= is for a caller's own assignment)
    orthogonalizes_once = holds_rows = True  # each matrix on its owner alone, which holds it whole

    def __init__(self, owners=None, overlap=0, batched_ns=False):
        check_owner_options(owners=owners, overlap=overlap, batched_ns=batched_ns)
        self.owner_override, self.overlap, self.batched_ns = owners, overlap, batched_ns
        self.owners = None

    def axis(self, opt):
        return opt.grid.world  # parts travel across the whole grid

    def plan(self, opt):
        world, shapes, large_runs = opt.grid.world.size, opt.layout.global_shapes, opt.large_runs
        if self.batched_ns:
            problem = batched_problem([n for n in opt.muon_names if opt.group_of[n]["algorithm"] == "normuon"])
            if problem:
                raise ValueError(problem)
        steps = {n: opt.group_of[n]["ns_steps"] for n in opt.muon_names}  # LargeRuns counts by blocks where it has them
        self.ns_flops = {n: newton_schulz_flops(shapes[n], steps[n]) if large_runs is None else
                         large_runs.flops(n, shapes[n], steps[n]) for n in opt.muon_names}
        owned = self.assign(opt)
        self.owners = (check_owners(owned, opt.muon_names, world) if owned is not None
                       else assign_owners(self.ns_flops, world, shapes, self.owners))
        self.routes = plan_routes(opt.muon_names, self.owners, lambda n, d: self.part_of(opt, n, d), opt.layout,
                                  opt.grid, self.axis(opt))

    def assign(self, opt):
        """The owners by a rule of its own, {rank: [matrix names]} (checked: every Muon matrix exactly once), or None
        for the balanced assignment (7.1; matrices already owned keep their owners). Owner's rule: the owners= given."""
        return self.owner_override

    def units(self, opt):
        """Without overlap, every bucket at once, so that stage 3 moves every matrix in one exchange each way; with
        it (or on one rank, where nothing travels), bucket by bucket."""
        if self.overlap or opt.grid.world.size == 1:
            return [Unit(buckets=(b,)) for b in opt.layout.buckets]
        return [Unit(buckets=opt.layout.buckets)]

    def routes_of(self, unit, active):
        names = {n for b in unit.buckets for n in b.names} | {n for c in unit.chunks for n in c}
        return [r for r in self.routes if r.name in names and r.name in active]

    def newton_schulz(self, opt, full):
        return newton_schulz_owned(full, opt.group_of, opt.ledger, self.batched_ns, opt.large_runs)

    def scatter(self, opt, orthos, routes):
        """Scatter from owner, started: a function that waits and returns {name: this rank's part}; NorMuon's
        matrices (7.4b) with their new v and g beside, and their parts normalized."""
        axis = self.axis(opt)
        parts = scatter_from_owner(orthos, routes, axis, opt.ledger, torch.bfloat16, opt.device)
        normuon = [r for r in routes if opt.group_of[r.name]["algorithm"] == "normuon"]
        if not normuon:
            return lambda: self.normalized(opt, parts(), {})
        stats = normuon_rows(opt, orthos) if any(r.owner == axis.rank for r in normuon) else {}
        rows = send_parts([(r.owner, p.rank, full_rows(r) + 1, stats[r.name] if r.owner == axis.rank else None)
                           for r in normuon for p in r.holders], axis, opt.ledger, "NorMuon rows", torch.float32,
                          opt.device)
        mine = [(r, p) for r in normuon for p in r.holders if p.rank == axis.rank]
        return lambda: self.normalized(opt, parts(), dict(zip(mine, rows())))

    def normalized(self, opt, parts, rows):
        """NorMuon's parts, from {(route, part): its v and g}: each element divided by its row's divisor, times g."""
        for (r, p), stats in rows.items():
            elements = part_rows(r.shape, r.tp_split_dim, p.tp_rank, p.start, p.stop)
            parts[r.name] = normalized_part(parts[r.name], elements, stats, opt.group_of[r.name]["normuon_eps"])
        return parts

    def orthogonalize(self, opt, unit, updates, active):
        """Stage 3 of a unit: gather at owner -> Newton-Schulz -> scatter from owner, each waited for at once."""
        routes = self.routes_of(unit, active)
        if not routes:
            return {}
        full = gather_at_owner(updates, routes, self.axis(opt), opt.ledger, torch.bfloat16, opt.device)()
        return self.scatter(opt, self.newton_schulz(opt, full), routes)()

    def stages(self, opt, active):
        """With overlap (on more than one rank), the stages pipelined K units deep (7.6); else in turn."""
        if self.overlap and opt.grid.world.size > 1:
            overlapped_stages(opt, active, self.overlap)
        else:
            opt.stages_in_turn(active)


class CommFree(Owner):
    """The comm-free strategy: Muon matrices sharded whole across DP, outside the buckets. Stage 1 adds the
    gradient reduce at the owner row, stage 3 exchanges TP pieces inside the owner's row only, stage 4 adds the
    broadcast from the owner row; the matrices travel in chunks of at most bucket_size elements (7.5)."""

    name = "comm-free"
    phases = ("grad presence", "grad reduce-scatter", "grad reduce at owner", "gather at owner", "scatter from owner",
              "param all-gather", "update broadcast from owner")

    def axis(self, opt):
        return opt.grid.tp  # the TP pieces of a matrix meet inside the owner's row

    def bucketed(self, opt, name):
        return opt.group_of[name]["algorithm"] not in ORTHOGONALIZED  # matrices live whole, on their owner's row

    def part_of(self, opt, name, dp_rank):
        if self.bucketed(opt, name):
            return super().part_of(opt, name, dp_rank)
        on_owner_row = self.owners[name] // opt.grid.tp.size == dp_rank
        return slice(0, math.prod(opt.layout.shapes[name]) if on_owner_row else 0)

    def plan(self, opt):
        super().plan(opt)
        # The matrices in chunks of at most bucket_size elements: what one reduce at owner or broadcast from owner
        # carries, as a bucket bounds one reduce-scatter (why not one message for all: notes/08-strategies.md).
        numel = {n: opt.param_by_name[n].numel() for n in opt.muon_names}
        self.chunks = chunk_names(opt.muon_names, numel, opt.bucket_size)
        self.sent_updates, self.sent_rows = {}, {}  # {matrix: the owner row's update; NorMuon's v and g}, 3 to 4

    def units(self, opt):
        if self.overlap or opt.grid.world.size == 1:
            return [Unit(buckets=(b,)) for b in opt.layout.buckets] + [Unit(chunks=(c,)) for c in self.chunks]
        return [Unit(buckets=opt.layout.buckets, chunks=tuple(self.chunks))]

    def normalized(self, opt, parts, rows):
        """The owner row's part of each whole matrix (all of its TP piece) and, for NorMuon, its v and g, kept until
        stage 4 sends them to the other DP rows; then Owner's normalized."""
        self.sent_updates.update((n, p) for n, p in parts.items() if not self.bucketed(opt, n))
        self.sent_rows.update((r.name, stats) for (r, p), stats in rows.items())
        return super().normalized(opt, parts, rows)

    def reduce_chunk(self, opt, chunk, active, async_op=False):
        """Stage 1 for a chunk of matrices: their gradients summed at their owner rows (7.5); with async_op, started
        (a function that waits and returns them)."""
        grads = {n: zeros_if_none(opt.param_by_name[n].grad, opt.param_by_name[n]) for n in chunk if n in active}
        return reduce_at_owner(grads, self.owners, opt.grid, opt.ledger, opt.device, async_op)

    def broadcast_chunk(self, opt, chunk, active, async_op=False):
        """Stage 4 for a chunk: the owner rows' updates to every other DP row, which applies each to its own copy of
        the weights, the owner row's arithmetic on the same weights; with async_op, started."""
        numels = {n: opt.param_by_name[n].numel() for n in chunk if n in active}
        orthos = {n: self.sent_updates.pop(n) for n in numels if n in self.sent_updates}
        normuon = {n: opt.layout.global_shapes[n][0] + 1 for n in numels if opt.group_of[n]["algorithm"] == "normuon"}
        received = {n: self.sent_rows.pop(n) for n in normuon if n in self.sent_rows}  # the owner row's own

        def apply(name, ortho):
            group, (tp_rank, tp) = opt.group_of[name], (opt.grid.tp.rank, opt.grid.tp.size)
            if name in normuon:  # NorMuon: this row's whole TP piece, each element by its row (7.4b)
                split = opt.layout.tp_split_dims[name] if tp > 1 else -1
                rows = part_rows(opt.layout.shapes[name], split, tp_rank, 0, numels[name])
                ortho = normalized_part(ortho, rows, received[name], group["normuon_eps"])
            runs = opt.large_runs.whole_runs.get(name) if opt.large_runs is not None else None
            apply_muon_update_(opt.param_by_name[name].view(-1), ortho, group, opt.layout.global_shapes[name], runs)
        rows = broadcast_from_owner({n: received[n] for n in normuon if n in received}, normuon, self.owners,
                                    opt.grid, opt.ledger, opt.device, received.__setitem__, True,
                                    "NorMuon rows broadcast", torch.float32) if normuon else (lambda: None)
        updates = broadcast_from_owner(orthos, numels, self.owners, opt.grid, opt.ledger, opt.device, apply, True)

        def wait():
            rows()
            updates()
        return wait if async_op else wait()


def with_strategy(optimizer, strategy, kwargs):
    """DistributedMuon's keywords with the strategy an OwnerMuon or CommFreeMuon is built around; one given too is
    refused as Python refuses a keyword a function does not take (TypeError), saying what to write instead."""
    if "strategy" in kwargs:
        raise TypeError(f"{optimizer} takes no strategy: it is DistributedMuon(params, strategy="
                        f"{type(strategy).__name__}(...)); for another strategy, build DistributedMuon with it")
    return dict(kwargs, strategy=strategy)


class OwnerMuon(DistributedMuon):
    """DistributedMuon with the owner strategy plugged in (Owner's arguments, then DistributedMuon's); a subclass
    with another strategy_class (Owner's arguments too) plugs in that one."""

    strategy_class = Owner

    def __init__(self, params, *, owners=None, overlap=0, batched_ns=False, **kwargs):
        strategy = self.strategy_class(owners, overlap, batched_ns)
        super().__init__(params, **with_strategy(type(self).__name__, strategy, kwargs))


class CommFreeMuon(OwnerMuon):
    """DistributedMuon with the comm-free strategy plugged in (CommFree's arguments, then DistributedMuon's)."""

    strategy_class = CommFree


# Every strategy, by the name --strategy takes: the optimizer with it plugged in (register adds one).
OPTIMIZERS = {"gather": DistributedMuon, "owner": OwnerMuon, "comm-free": CommFreeMuon}
STRATEGIES = BUILT_IN = tuple(OPTIMIZERS)  # their names, in order; BUILT_IN: this module's, which stay


def strategy_class(name: str) -> type:
    """The class of the strategy OPTIMIZERS[name] plugs in: what it declares (distmuon.strategy.DECLARED) is what the
    runner, large runs and the benchmarks read of it, never its name. KeyError for a name not registered."""
    return OPTIMIZERS[name].strategy_class


def strategies_where(test: Callable[[type], bool]) -> tuple:
    """The names of the strategies whose class passes `test` (e.g. lambda s: s.holds_rows), in OPTIMIZERS' order."""
    return tuple(name for name in OPTIMIZERS if test(strategy_class(name)))


def register(optimizer_class: type) -> None:
    """Add a strategy: `optimizer_class`, a DistributedMuon subclass whose strategy_class declares what DECLARED
    names, goes into OPTIMIZERS (and STRATEGIES) under that class's name, for the runner's --strategy, checks and
    accounting. In this process only: a spawned rank has it if what it runs registers it too. Refused in one line
    (ValueError): not such a class, a declaration missing, or a name taken."""
    global STRATEGIES
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, DistributedMuon)):
        raise ValueError(f"register takes a subclass of DistributedMuon (got {optimizer_class!r:.80})")
    cls = optimizer_class.strategy_class
    missing = [a for a in DECLARED if not hasattr(cls, a)]
    if missing:
        raise ValueError(f"{optimizer_class.__name__}'s strategy_class {cls.__name__} declares no {', '.join(missing)} "
                         f"(distmuon/strategy.py's Strategy)")
    if cls.name in OPTIMIZERS:
        raise ValueError(f"strategy {cls.name!r} is registered already, by {OPTIMIZERS[cls.name].__name__}")
    OPTIMIZERS[cls.name] = optimizer_class
    STRATEGIES = tuple(OPTIMIZERS)


def unregister(name: str) -> None:
    """Take a strategy that register added out again (the three of this module stay); ValueError, one line, if not."""
    global STRATEGIES
    if name not in OPTIMIZERS or name in BUILT_IN:
        added = [n for n in OPTIMIZERS if n not in BUILT_IN]
        raise ValueError(f"strategy {name!r} is not one register added (added: {', '.join(added) or 'none'})")
    del OPTIMIZERS[name]
    STRATEGIES = tuple(OPTIMIZERS)
