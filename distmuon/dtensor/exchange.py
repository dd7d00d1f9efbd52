"""DTensorMuon's strategy: the lesson's owner strategy on placements (gather at owner, Newton-Schulz, scatter back).

Part of DTensorMuon (distmuon/dtensor/), sections 3 and 5 of its reading order: plan() makes the plan of section 3,
start() and finish() run stage 3 of a step on it (all matrices at once, or a group at a time: exchange_groups). It
is built from the lesson's parts: the owners by longest-processing-time (distmuon/owners.py's assign_owners), one
all-to-all for every part of every matrix each way (send_parts; per group of them, started and finished apart so
that groups can overlap) and Newton-Schulz at the owner (newton_schulz_owned, the lesson's orthogonalize; over a
matrix put together there, newton_schulz_overwriting: its operations and bits, one matrix less at the peak). What
later sections add comes from the optimizer's other parts, each in its own module: the Gram form on TP pieces
(opt.large_runs, rows.py, 3c) and NorMuon's rows (opt.normuon_rows, normuon.py). Your own gather and redistribute
(section 4) replace this strategy whole: explicit.py.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from distmuon import owners
from distmuon.checks import ORTHOGONALIZED, ns_coefficients_of
from distributed_muon_cpu import orthogonalize
from distmuon.dtensor.plan import exchange_groups, exchange_limit, matrix_name, plan_matrices


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for a loop over the parts of a step (on again after, if it was): an
    owner of a matrix in 14,336 pieces (Llama 3 70B on 16,384 ranks) makes 28,672 transfers a step, each a few tuples
    that only reference counting frees, and the collections their allocations set off cost five times the loop
    (notes/measured/at_scale_2core.md)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def covers(box, shape):
    """Whether a box ((start, stop) along each dim) is the whole of a matrix of that shape."""
    return all(start == 0 and stop == size for (start, stop), size in zip(box, shape))


def as_slices(box):
    """A box as the slices that index it."""
    return tuple(slice(start, stop) for start, stop in box)


def place_part(full, m, box, part):
    """Write one part of matrix m (bf16, flat) at its box of the owner's matrix in full (made on the first part), or
    take it as the matrix where it covers it."""
    if covers(box, m.shape):
        full[m.name] = part.view(m.shape)
        return
    if m.name not in full:
        full[m.name] = torch.empty(m.shape, dtype=torch.bfloat16, device=part.device)
    full[m.name][as_slices(box)].copy_(part.view(tuple(b - a for a, b in box)))


def newton_schulz_overwriting(matrix, steps, coefficients, eps):
    """The lesson's newton_schulz of a bf16 matrix that the caller gives up, written over it: the same operations in
    the same order on the same layouts, hence the same bits (tests/test_dtensor_step_memory.py), but the normalization
    in place and each iteration's product X <- a X + poly X written (addmm's out=) into the buffer the last one read
    from, `matrix` and one more in turn. So two matrices at the peak beside the small Gram matrix and its polynomial
    (one of each alive), not three (the input, the last iterate, the next). The result lies in `matrix`'s storage or
    in the other buffer."""
    tall = matrix.size(-2) > matrix.size(-1)
    x = matrix.mT if tall else matrix  # Newton-Schulz orients it wide, as the lesson does
    x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    buffers = (None, matrix.view(x.shape))  # the next iterate's: a new one first, then the input's storage, in turn
    for a, b, c in ns_coefficients_of(coefficients, steps):
        gram = x @ x.mT
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        del gram  # not alive beside the next one
        out = buffers[0] if buffers[0] is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        x = torch.addmm(x, poly, x, beta=a, out=out)
        del poly
        buffers = (buffers[1], out)
    return x.mT if tall else x


def flat_if_contiguous(box):
    """A box of a matrix as a flat view where its elements lie one after another (rows), else as it is (a strided
    view, columns): either way no copy here; the exchange copies it once, into its message."""
    return box.view(-1) if box.is_contiguous() else box


class Started:
    """A step's exchange between start() and finish(): its matrices (active), the gather in flight, the local shapes
    of the parameters ({name: shape}) and the updates of the matrices orthogonalized where they are (whole)."""

    def __init__(self, active, gathered, shapes, whole):
        self.active, self.gathered, self.shapes, self.whole = active, gathered, shapes, whole

    def take_gathered(self):
        """Wait for the gather and let go of it (its buffers, and the parts sent): {matrix: put together here}."""
        gathered, self.gathered = self.gathered, None
        return gathered()


class OwnerExchange:
    """Who orthogonalizes which matrix, and the transfers that take its pieces there and back (one part of
    DTensorMuon). After plan(): matrices (each distributed Muon matrix, its owner and this rank's transfers),
    ns_flops and owners ({matrix: FLOPs, owner rank}), local_matrices (plain and all-Replicate parameters,
    orthogonalized where they are) and param_of_matrix ({matrix: its parameter})."""

    def __init__(self, config, batched_ns=False):
        self.config, self.batched_ns = config, batched_ns

    # -- the plan -------------------------------------------------------------
    def plan(self, opt, copies):
        muon_copies = [c for c in copies if opt.param_groups[c.group]["algorithm"] in ORTHOGONALIZED]
        steps = {i: g["ns_steps"] for i, g in enumerate(opt.param_groups) if g["algorithm"] in ORTHOGONALIZED}
        group = opt.axis.ranks if len(opt.axis.ranks) < opt.world else None  # None: the world holds them all
        self.matrices, self.ns_flops, self.owners = plan_matrices(
            muon_copies, steps, opt.me, opt.world, self.config.assign, opt.large_runs.flops_of, opt.large_runs.tp_dim_of,
            group)
        # Plain tensors and all-Replicate DTensors: orthogonalized where they are, on every rank that holds them.
        self.local_matrices = {c.name: [matrix_name(c, e if c.expert_stack else -1, 1) for e in range(c.n_matrices)]
                               for c in muon_copies if c.local and (not c.mesh_ranks or opt.me in c.mesh_ranks)}
        ranks = opt.axis.ranks  # global rank -> index in the optimizer's group (a range's own index: O(1))
        self.index = ranks.index if isinstance(ranks, range) else {r: i for i, r in enumerate(ranks)}.__getitem__
        self.param_of_matrix = {m.name: m.copy.name for m in self.matrices}
        self.param_of_matrix.update({m: name for name, names in self.local_matrices.items() for m in names})

    def exchange_groups(self, opt, present, exchange_bytes):
        """The step's Muon parameters (present: the names voted present) in groups of at most exchange_bytes of bf16
        matrices each (a larger parameter alone), every group its own exchanges: [(names, exchanged, rows)]. The
        groups of distributed parameters come from the plan, in its order, so every rank makes the same ones
        (exchanged: True; rows: whether it has NorMuon's rows to send); the parameters orthogonalized where they are
        follow, in groups that move nothing (exchanged and rows: False), of exchange_limit's bytes."""
        exchanged = exchange_groups([m for m in self.matrices if m.copy.name in present], exchange_bytes)
        shapes = [opt.param_by_name[n].shape[-2:] for n in self.local_matrices]
        exchange_bytes = exchange_limit(exchange_bytes, shapes, len(opt.axis.ranks))
        planned = {n for names in exchanged for n in names}
        local = {n: 2 * opt.param_by_name[n].numel() for n in self.local_matrices if n in present and n not in planned}
        normuon = {m.copy.name for m in self.matrices if m.name in opt.normuon_rows.receivers}
        return ([(names, True, bool(normuon.intersection(names))) for names in exchanged]
                + [(names, False, False) for names in owners.chunk_names(list(local), local, exchange_bytes)])

    # -- stage 3 of a step: start(updates), then finish(started)() -------------------
    def start(self, opt, updates, exchanged=True):
        """The gather at owners of these updates' matrices, started: what finish() takes. The updates of the matrices
        that travel are taken out of `updates` (their bytes live on in the send buffer and at the owners only)."""
        active = [m for m in self.matrices if m.copy.name in updates and (m.gather or m.scatter)]
        shapes = {name: update.shape for name, update in updates.items()}
        whole = {name: updates[name] for name in self.local_matrices if name in updates}  # no exchange: kept
        return Started(active, self.gather_at_owners(opt, updates, active) if exchanged else dict, shapes, whole)

    def finish(self, opt, started, exchanged=True, rows=True):
        """Newton-Schulz of what start() gathered and of the matrices whole here, then the scatter from owners
        started: a function that waits and returns {name: its orthogonalized local shard} (NorMuon's rows beside,
        if rows: this group has any). Read right to left, as the lesson's Owner.orthogonalize: scatter(Newton-Schulz
        here(started))."""
        return self.scatter(opt, started, self.newton_schulz_here(opt, started), exchanged, rows)

    def scatter(self, opt, started, done, exchanged=True, rows=True):
        """The scatter from owners of done ({matrix: O} of every matrix whole here) started, with NorMuon's v and g
        (opt.normuon_rows) where this group has any: a function that waits and returns {name: its orthogonalized
        local shard}, NorMuon's parts normalized. The matrices orthogonalized where they are need no scatter."""
        orthos = {name: (done[matrices[0]] if len(matrices) == 1 and name not in opt.expert_stacks
                         else torch.stack([done[m] for m in matrices]).view(started.whole[name].shape))
                  for name, matrices in self.local_matrices.items() if name in started.whole}
        normuon_here = {m: done[m] for name in orthos if opt.group_of[name]["algorithm"] == "normuon"
                        for m in self.local_matrices[name]}  # NorMuon's matrices whole here: normalized here
        stepped = [m for m in self.matrices if m.copy.name in started.shapes]  # empty shards too: they hold v
        normuon_rows = opt.normuon_rows
        travelling = (normuon_rows.at_owners(opt, done, stepped)  # NorMuon's v and g
                      if normuon_rows.receivers and exchanged and rows else None)
        scattered = self.scatter_from_owners(opt, done, started.shapes, started.active) if exchanged else dict
        del done

        def wait():
            orthos.update(scattered())
            return normuon_rows.normalized(opt, orthos, travelling() if travelling else {}, normuon_here)
        return wait

    def newton_schulz_here(self, opt, started):
        """{matrix: O} of every matrix whole here: those the gather put together at this owner (waited for; TP
        pieces, tp_newton_schulz="gram" (3c), with their TP group, by opt.large_runs) and the matrices of
        started.whole, orthogonalized where they are. The gather's buffers are let go, and the matrices once
        orthogonalized."""
        full = started.take_gathered()  # the gather's buffers go with it: only the matrices put together stay
        owned = [m for m in started.active if m.owner == opt.me]
        group_of = {m.name: opt.param_groups[m.copy.group] for m in owned}
        for name, matrices in self.local_matrices.items():  # no exchange: the whole matrix is here
            if name in started.whole:
                stack = started.whole[name].view(-1, *started.whole[name].shape[-2:])
                for i, m in enumerate(matrices):
                    full[m], group_of[m] = stack[i], opt.group_of[name]
        pieces = [m for m in owned if m.tp_dim >= 0]  # in plan order: the same on each rank of a TP group
        gathered_pieces = {m.name: full.pop(m.name) for m in pieces}
        made = [m.name for m in owned if m.name in full]  # its own, or its own update's (bf16_update: never the state)
        done = self.newton_schulz(opt, full, group_of, made)
        if pieces:
            done.update(opt.large_runs.newton_schulz_pieces(opt, gathered_pieces, pieces, group_of, self.ns_flops))
        return done

    def newton_schulz(self, opt, full, group_of, made=()):
        """{matrix: full bf16 update} -> {matrix: orthogonalized}, by the lesson's newton_schulz_owned; laid-out
        matrices block by block (torch's 2-D path, batched_ns or not: a block is its own matrix). The matrices put
        together here (made: names), one at a time, written over themselves (newton_schulz_overwriting: torch's
        bits), unless batched_ns stacks them or they go block by block."""
        blocks = opt.large_runs.blocks_of(full, self.param_of_matrix)
        over = [] if self.batched_ns else [n for n in made if n not in blocks.blocks]
        over = {n: full.pop(n) for n in over}
        done = owners.newton_schulz_owned(full, group_of, opt.ledger, self.batched_ns, blocks)
        for name in list(over):
            done[name] = orthogonalize(name, over.pop(name), group_of[name], opt.ledger, newton_schulz_overwriting)
        return done

    def gather_at_owners(self, opt, updates, active):
        """Started: a function that waits and returns each matrix put together at its owner: every part a view of
        its holder's local tensor (all of it, or one expert of a stack), written into the owner's matrix as a box (a
        strided copy of whole runs), or taken as the matrix itself where one part covers it (e.g. a world of one).
        This rank's own parts are written before the exchange's buffers are made, and the updates that travel are
        taken out of `updates` and let go once copied into the send buffer: the owner holds its matrix and what it
        receives, not its update beside them."""
        me, dtype = opt.me, torch.bfloat16
        full, transfers, receiving = {}, [], []
        with gc_paused():
            for m in active:
                for source, destination, numel, at, box in m.gather:
                    part = None
                    if source == me:
                        part = (updates[m.copy.name] if at is None else updates[m.copy.name][at]).reshape(-1)
                        if destination == me:
                            place_part(full, m, box, part)
                            continue
                    transfers.append((self.index(source), self.index(destination), numel, part))
                    if destination == me:
                        receiving.append((m, box))
        for m in active:
            updates.pop(m.copy.name, None)
        part = None
        wait = owners.send_parts(transfers, opt.axis, opt.ledger, "gather at owner", dtype, opt.device)
        for i, (source, destination, numel, _) in enumerate(transfers):
            transfers[i] = (source, destination, numel, None)  # sent: copied into the send buffer

        def assemble():
            parts = wait()
            with gc_paused():
                for (m, box), received in zip(receiving, parts):
                    place_part(full, m, box, received)
            return full
        return assemble

    def scatter_from_owners(self, opt, orthogonal, shapes, active):
        """Started: a function that waits and returns each holder's part of every orthogonalized matrix: a box of
        the owner's (a strided view, copied once into the message), written as the holder's whole local tensor
        (shapes: {parameter: its local shape}) or one expert of its stack. The matrices are taken out of
        `orthogonal` as their parts are cut."""
        me, dtype = opt.me, torch.bfloat16
        transfers, receiving = [], []
        with gc_paused():
            for m in active:
                for source, destination, numel, at, box in m.scatter:
                    part = flat_if_contiguous(orthogonal[m.name][as_slices(box)]) if source == me else None
                    transfers.append((self.index(source), self.index(destination), numel, part))
                    if destination == me:
                        receiving.append((m, at))
                orthogonal.pop(m.name, None)  # kept by its parts where views, else freed before the send buffer
        part = None
        wait = owners.send_parts(transfers, opt.axis, opt.ledger, "scatter from owner", dtype, opt.device)
        shapes = {m.copy.name: shapes[m.copy.name] for m, _ in receiving}

        def place():
            local = {}
            for (m, at), part in zip(receiving, wait()):
                name = m.copy.name
                if at is None:  # this rank's whole local tensor in one part: no copy
                    local[name] = part
                    continue
                if name not in local:
                    local[name] = torch.empty(shapes[name], dtype=dtype, device=part.device)
                local[name][at].copy_(part.view(local[name][at].shape) if part.dim() == 1 else part)
            return {name: t.reshape(-1) for name, t in local.items()}
        return place

