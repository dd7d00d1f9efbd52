"""DTensorMuon's strategy: the lesson's owner strategy on placements (gather at owner, Newton-Schulz, scatter back).

Part of DTensorMuon (distmuon/dtensor/), sections 3-5 of its reading order: plan() makes the plan of section 3 (or
takes your distributed_config's owners, section 4), orthogonalize() runs stage 3 of a step on it. It is built from
the lesson's parts: the owners by longest-processing-time (distmuon/owners.py's lpt_order, assign_owners,
check_owners), one all-to-all for every part of every matrix each way (send_parts; or per group of them:
exchange_groups, started and finished apart so that groups can overlap), Newton-Schulz at the owner
(newton_schulz_owned, the lesson's orthogonalize), and the Gram form on TP pieces (distmuon/large_runs.py's
newton_schulz_tp).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.profiler import record_function

from distmuon import large_runs
from distmuon import owners
import distributed_muon_cpu
from distmuon.checks import ORTHOGONALIZED
from distmuon.dtensor.normuon import NorMuonRows
from distmuon.dtensor.plan import as_slices, covers, exchange_groups, matrix_name, plan_matrices
from distributed_muon_cpu import newton_schulz_flops


def place_part(full, m, box, part):
    """Write one part of matrix m (bf16, flat) at its box of the owner's matrix in full (made on the first part), or
    take it as the matrix where it covers it."""
    if covers(box, m.shape):
        full[m.name] = part.view(m.shape)
        return
    if m.name not in full:
        full[m.name] = torch.empty(m.shape, dtype=torch.bfloat16, device=part.device)
    full[m.name][as_slices(box)].copy_(part.view(tuple(b - a for a, b in box)))


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
        self.config, self.batched_ns, self.rows = config, batched_ns, NorMuonRows()

    # -- the plan -------------------------------------------------------------
    def plan(self, opt, copies):
        self.param_of_matrix = {}
        if self.config.explicit:
            self.plan_explicit(opt)
        else:
            self.plan_automatic(opt, copies)

    def plan_automatic(self, opt, copies):
        muon_copies = [c for c in copies if opt.param_groups[c.group]["algorithm"] in ORTHOGONALIZED]
        steps = {i: g["ns_steps"] for i, g in enumerate(opt.param_groups) if g["algorithm"] in ORTHOGONALIZED}
        self.matrices, self.ns_flops, self.owners = plan_matrices(
            muon_copies, steps, opt.me, opt.world, self.config.assign, opt.large_runs.flops_of, opt.large_runs.tp_dim_of)
        group = torch.tensor(opt.axis.ranks)
        outside = sorted({m.name for m in self.matrices
                          if not bool(torch.isin(m.holders, group).all()) or m.owner not in opt.axis.ranks})
        if outside:
            raise ValueError(f"matrices held by ranks outside the optimizer's group: {', '.join(outside)}")
        # Plain tensors and all-Replicate DTensors: orthogonalized where they are, on every rank that holds them.
        self.local_matrices = {c.name: [matrix_name(c, e if c.expert_stack else -1, 1) for e in range(c.n_matrices)]
                               for c in muon_copies if c.local and (not c.mesh_ranks or opt.me in c.mesh_ranks)}
        self.index = {r: i for i, r in enumerate(opt.axis.ranks)}  # global rank -> index in the optimizer's group
        self.param_of_matrix = {m.name: m.copy.name for m in self.matrices}
        self.param_of_matrix.update({m: name for name, names in self.local_matrices.items() for m in names})
        self.rows.plan(opt, self.matrices)  # NorMuon's: who holds each matrix's v

    def plan_explicit(self, opt):
        muon = [n for n in opt.param_by_name if opt.group_of[n]["algorithm"] in ORTHOGONALIZED]
        self.ns_flops = {n: newton_schulz_flops(self.config.global_shapes[n], opt.group_of[n]["ns_steps"])
                         for n in muon}
        ranks = opt.axis.ranks
        owned = (self.config.assign(self.ns_flops, {n: ranks for n in muon}, opt.world)
                 if self.config.assign is not None
                 else {r: [n for n, o in owners.assign_owners(self.ns_flops, len(ranks),
                                                              self.config.global_shapes).items() if ranks[o] == r]
                       for r in ranks})
        self.owners = owners.check_owners(owned, muon, opt.world)
        strangers = sorted(n for n, r in self.owners.items() if r not in ranks)
        if strangers:
            raise ValueError(f"bad owner assignment: owned outside the optimizer's group: {', '.join(strangers)}")
        self.matrices, self.local_matrices, self.index = [], {}, {}

    # -- stage 3 of a step ------------------------------------------------------
    def orthogonalize(self, opt, updates):
        """{name: bf16 update of this rank's local shard} -> {name: its orthogonalized local shard}."""
        if self.config.explicit:
            return self.orthogonalize_explicit(opt, updates)
        return self.finish(opt, self.start(opt, updates))()

    def exchange_groups(self, opt, present, exchange_bytes):
        """The step's Muon parameters (present: the names voted present) in groups of at most exchange_bytes of bf16
        matrices each (a larger parameter alone), every group its own exchanges: [(names, exchanged, rows)]. The
        groups of distributed parameters come from the plan, in its order, so every rank makes the same ones
        (exchanged: True; rows: whether it has NorMuon's rows to send); the parameters orthogonalized where they are
        follow, in groups that move nothing (exchanged and rows: False)."""
        exchanged = exchange_groups([m for m in self.matrices if m.copy.name in present], exchange_bytes)
        planned = {n for names in exchanged for n in names}
        local = {n: 2 * opt.param_by_name[n].numel() for n in self.local_matrices if n in present and n not in planned}
        normuon = {m.copy.name for m in self.matrices if m.name in self.rows.receivers}
        return ([(names, True, bool(normuon.intersection(names))) for names in exchanged]
                + [(names, False, False) for names in owners.chunk_names(list(local), local, exchange_bytes)])

    def start(self, opt, updates, exchanged=True):
        """The gather at owners of these updates' matrices, started: what finish() takes. The updates of the matrices
        that travel are taken out of `updates` (their bytes live on in the send buffer and at the owners only)."""
        active = [m for m in self.matrices if m.copy.name in updates and (m.gather or m.scatter)]
        shapes = {name: update.shape for name, update in updates.items()}
        whole = {name: updates[name] for name in self.local_matrices if name in updates}  # no exchange: kept
        return Started(active, self.gather_at_owners(opt, updates, active) if exchanged else dict, shapes, whole)

    def finish(self, opt, started, exchanged=True, rows=True):
        """Newton-Schulz of what start() gathered (and of the matrices whole here), the scatter from owners started:
        a function that waits and returns {name: its orthogonalized local shard}."""
        active, shapes, whole = started.active, started.shapes, started.whole
        group_of, orthos, local_full = {}, {}, {}
        for name, matrices in self.local_matrices.items():  # no exchange: the whole matrix is here
            if name in whole:
                stack = whole[name].view(-1, *whole[name].shape[-2:])
                for i, m in enumerate(matrices):
                    local_full[m], group_of[m] = stack[i], opt.group_of[name]
        whole_normuon = {}  # NorMuon's matrices whole here: (parameter, expert, O)
        if local_full:
            done = self.newton_schulz(opt, local_full, group_of)
            for name, matrices in self.local_matrices.items():
                if name in whole:
                    orthos[name] = torch.stack([done[m] for m in matrices]).view(whole[name].shape)
                    if opt.group_of[name]["algorithm"] == "normuon":
                        whole_normuon.update((m, (name, e if name in opt.expert_stacks else -1, done[m]))
                                             for e, m in enumerate(matrices))
        full = started.take_gathered()  # the gather's buffers go with it: only the matrices put together stay
        for m in active:
            if m.owner == opt.me:
                group_of[m.name] = opt.param_groups[m.copy.group]
        pieces = [m for m in active if m.owner == opt.me and m.tp_dim >= 0]  # in plan order: the same on each
        orthogonal = self.newton_schulz(opt, {n: t for n, t in full.items() if n not in {m.name for m in pieces}},
                                        group_of)
        for m in pieces:  # section 3c: with every rank of this row's TP group, one all-reduce per iteration
            g = group_of[m.name]
            with record_function("newton-schulz"):
                orthogonal[m.name] = large_runs.newton_schulz_tp(full[m.name], m.copy.shape, self.tp_axis(opt, m),
                                                                 opt.ledger, g["ns_steps"], g["ns_coefficients"],
                                                                 g["eps"])
            opt.ledger.record_compute(m.name, m.shape, self.ns_flops[m.name])
        del full  # the matrices put together, freed before the scatter's buffers are made: a lower peak
        stepped = [m for m in self.matrices if m.copy.name in shapes]  # empty shards too: they hold v
        rows = (self.rows.at_owners(opt, orthogonal, stepped)  # NorMuon's v and g
                if self.rows.receivers and exchanged and rows else None)
        scattered = self.scatter_from_owners(opt, orthogonal, shapes, active) if exchanged else dict
        del orthogonal

        def wait():
            orthos.update(scattered())
            if rows is None and not whole_normuon:
                return orthos
            return self.rows.normalized(opt, orthos, rows() if rows else {}, whole_normuon)
        return wait

    def tp_axis(self, opt, m):
        """The TP group of this rank's row of m's mesh, as the lesson's Axis (what newton_schulz_tp sums over)."""
        group = opt.param_by_name[m.copy.name].device_mesh.get_group(m.tp_dim)
        ranks = tuple(dist.get_process_group_ranks(group))
        return distributed_muon_cpu.Axis("TP", len(ranks), ranks.index(opt.me), ranks, group)

    def newton_schulz(self, opt, full, group_of):
        """{matrix: full bf16 update} -> {matrix: orthogonalized}, by the lesson's newton_schulz_owned; laid-out
        matrices block by block (torch's 2-D path, batched_ns or not: a block is its own matrix)."""
        blocks = opt.large_runs.blocks_of(full, self.param_of_matrix)
        return owners.newton_schulz_owned(full, group_of, opt.ledger, self.batched_ns, blocks)

    def gather_at_owners(self, opt, updates, active):
        """Started: a function that waits and returns each matrix put together at its owner: every part a view of
        its holder's local tensor (all of it, or one expert of a stack), written into the owner's matrix as a box (a
        strided copy of whole runs), or taken as the matrix itself where one part covers it (e.g. a world of one).
        This rank's own parts are written before the exchange's buffers are made, and the updates that travel are
        taken out of `updates` and let go once copied into the send buffer: the owner holds its matrix and what it
        receives, not its update beside them."""
        me, dtype = opt.me, torch.bfloat16
        full, transfers, receiving = {}, [], []
        for m in active:
            for source, destination, numel, at, box in m.gather:
                part = None
                if source == me:
                    part = (updates[m.copy.name] if at is None else updates[m.copy.name][at]).reshape(-1)
                    if destination == me:
                        place_part(full, m, box, part)
                        continue
                transfers.append((self.index[source], self.index[destination], numel, part))
                if destination == me:
                    receiving.append((m, box))
        for m in active:
            updates.pop(m.copy.name, None)
        part = None
        wait = owners.send_parts(transfers, opt.axis, opt.ledger, "gather at owner", dtype, opt.device)
        for i, (source, destination, numel, _) in enumerate(transfers):
            transfers[i] = (source, destination, numel, None)  # sent: copied into the send buffer

        def assemble():
            for (m, box), received in zip(receiving, wait()):
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
        for m in active:
            for source, destination, numel, box, at in m.scatter:
                part = orthogonal[m.name][as_slices(box)].reshape(-1) if source == me else None
                transfers.append((self.index[source], self.index[destination], numel, part))
                if destination == me:
                    receiving.append((m, at))
            orthogonal.pop(m.name, None)  # kept by its parts where they are views, else freed before the send buffer
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
                local[name][at].view(-1).copy_(part)
            return {name: t.reshape(-1) for name, t in local.items()}
        return place

    def orthogonalize_explicit(self, opt, updates):
        """Your gather, Newton-Schulz on the owners, your redistribute; shapes checked on the way, and voted on."""
        full = self.config.gather(dict(updates), dict(self.owners))
        wrong = [f"gather gave {n} as {tuple(full[n].shape) if n in full else None}, expected "
                 f"{tuple(self.config.global_shapes[n])}" for n in updates if self.owners[n] == opt.me
                 and (n not in full or tuple(full[n].shape) != tuple(self.config.global_shapes[n]))]
        opt.refuse_on_every_rank(wrong[0] if wrong else None, "explicit checks")
        orthogonal = owners.newton_schulz_owned({n: full[n] for n in updates if self.owners[n] == opt.me},
                                            opt.group_of, opt.ledger, self.batched_ns)
        local = self.config.redistribute(orthogonal, dict(self.owners))
        wrong = [f"redistribute gave no piece of {n} the size of this rank's parameter" for n in updates
                 if n not in local or local[n].numel() != updates[n].numel()]
        opt.refuse_on_every_rank(wrong[0] if wrong else None, "explicit checks")
        return {n: local[n] for n in updates}
