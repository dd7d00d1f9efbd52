"""NorMuon on placements: DTensorMuon's param groups of algorithm "normuon" (distmuon/normuon.py says what NorMuon is).

Part of DTensorMuon (distmuon/dtensor/), beside its exchange (section 5). NorMuon keeps one float32 per row of each
matrix, v, and needs the whole matrix to update it (the mean of each row's squares) and to find the rescale g (its
Frobenius norm). The owner, which puts the whole matrix together anyway, does both; the state lives with the
parameter as every other state here does, so that torch's checkpoint helpers reshard it:

    v: a DTensor of shape (rows, 1), or (experts, rows, 1) for an expert stack, on the parameter's mesh, Replicate
       on every mesh dim but one that cuts an expert stack's experts (dim 0), which keeps its cut: every rank of the
       mesh holds the whole v of each matrix it has any of, empty shards included.
    the owner     updates its v of the matrix (its own copy), finds g, and sends v and g (rows + 1 float32) to every
                  other rank holding that v: one all-to-all for all the step's NorMuon matrices ("NorMuon rows")
    every holder  copies the owner's v into its own, and divides each element of its part of O by its row's
                  sqrt(v) + eps, times g: the owner's arithmetic, elementwise, its bits

A matrix that is whole on every rank (a plain tensor, an all-Replicate DTensor) is orthogonalized where it is: every
rank updates its own v the same way, and nothing moves.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from distmuon import normuon
from distmuon import owners
from distmuon.dtensor.placements import SHARD_PLACEMENTS, dim_ranges, local_box, local_of, local_shape
from distmuon.dtensor.plan import describe


def v_placements(placements, expert_stack):
    """v's placements: the parameter's cut of an expert stack's experts (dim 0) kept, Replicate elsewhere."""
    return tuple(p if expert_stack and isinstance(p, SHARD_PLACEMENTS) and p.dim == 0 else Replicate()
                 for p in placements)


def v_zeros(p, expert_stack):
    """NorMuon's state v for parameter p, before its first step: zeros, as a DTensor like p's (see above)."""
    shape = tuple(p.shape[:-1]) + (1,)
    if not isinstance(p, DTensor):
        return torch.zeros(shape, device=p.device)
    placements, mesh = v_placements(p.placements, expert_stack), p.device_mesh
    local = local_shape(shape, tuple(mesh.shape), placements, tuple(mesh.get_coordinate()))
    stride = tuple(torch.empty(shape, device="meta").stride())
    return DTensor.from_local(torch.zeros(local, device=local_of(p).device), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


def experts_of_v(copy, coordinate):
    """The experts (or [0] for a 2-D matrix) whose v the rank at `coordinate` of copy's mesh holds, in its order."""
    if not copy.expert_stack:
        return [0]
    return list(range(*local_box((copy.shape[0], 1), copy.mesh_shape, v_placements(copy.placements, True),
                                 coordinate)[0]))


def v_holders(copy, expert):
    """The ranks (global, row-major over the mesh) that hold the v of one matrix of a distributed copy (expert -1:
    the 2-D parameter): every rank of its mesh, but where a stack's experts are cut, those holding `expert`."""
    ranks = torch.tensor(copy.mesh_ranks).view(copy.mesh_shape)
    if not copy.expert_stack:
        return ranks.reshape(-1)
    start, stop = dim_ranges(copy.shape[0], copy.mesh_shape, v_placements(copy.placements, True), 0)
    return ranks[((start <= expert) & (expert < stop)).expand(copy.mesh_shape)]


def describe_of(opt, name):
    """The plan's Copy of a parameter as this rank sees it."""
    return describe(name, 0, opt.param_by_name[name], name in opt.expert_stacks)


class NorMuonRows:
    """The rows of every NorMuon matrix of a DTensorMuon: who sends v and g to whom, and the normalized parts."""

    def plan(self, opt, matrices):
        """For each distributed NorMuon matrix: the ranks (global) that hold its v, besides its owner."""
        self.receivers, self.layouts = {}, {}  # layouts: row_layout's, made at a parameter's first step
        self.quotients = {}  # during a step: O / d of the 2-D matrices owned here whose local part is whole rows
        for m in matrices:
            if opt.param_groups[m.copy.group]["algorithm"] == "normuon":
                self.receivers[m.name] = v_holders(m.copy, max(m.expert, 0)).tolist()

    @staticmethod
    def v_of(opt, name, expert):
        """This rank's v of one matrix of parameter `name`: a (rows, 1) view of its state."""
        v = local_of(opt.state_of(name)["normuon_v"])
        if v.dim() == 2:
            return v
        p = opt.param_by_name[name]
        return v[experts_of_v(describe_of(opt, name), tuple(p.device_mesh.get_coordinate())).index(expert)]

    def at_owners(self, opt, orthogonal, stepped):
        """Start the rows exchange for the matrices of this step's parameters (stepped: the same on every rank of a
        matrix's mesh): every NorMuon matrix this rank owns has its v updated and g found here, and both go to
        every other rank holding its v. Returns a function that waits and returns {matrix: (v, g)}."""
        me, transfers, receiving = opt.me, [], []
        self.quotients = {}
        for m in stepped:
            if m.name not in self.receivers:
                continue
            stats = None
            if m.owner == me:
                v, g = self.updated(opt, opt.param_groups[m.copy.group], m.copy.name, m.expert, orthogonal[m.name])
                stats = torch.cat([v.view(-1), g.view(1)])
            for r in self.receivers[m.name]:
                transfers.append((opt.exchange.index(m.owner), opt.exchange.index(r), m.shape[0] + 1, stats))
                if r == me:
                    receiving.append(m)
        wait = owners.send_parts(transfers, opt.axis, opt.ledger, "NorMuon rows", torch.float32, opt.device)
        return lambda: {m.name: stats for m, stats in zip(receiving, wait())}

    def normalized(self, opt, orthos, received, whole_here):
        """{parameter: this rank's local O, flat} -> NorMuon's parameters normalized, float32: every matrix's v copied
        in from its owner's (received: {matrix: its v and g}), then each element by its row's divisor, times g.
        whole_here: {matrix: its full O} of NorMuon's matrices whole here (opt.exchange.local_matrices), normalized
        here. Without either, orthos as it is."""
        local_full = {m: (name, e if name in opt.expert_stacks else -1, whole_here[m])
                      for name, matrices in opt.exchange.local_matrices.items()
                      for e, m in enumerate(matrices) if m in whole_here}
        if not received and not local_full:
            return orthos
        g_of = {}
        for m in opt.exchange.matrices:
            if m.name in received:
                stats = received[m.name]
                self.v_of(opt, m.copy.name, m.expert).view(-1).copy_(stats[:-1])  # the owner's: the same bits
                g_of[m.copy.name, max(m.expert, 0)] = stats[-1]
        out = dict(orthos)
        for matrix, (name, expert, full) in local_full.items():  # whole here: every rank updates its v alike
            g_of[name, max(expert, 0)] = self.updated(opt, opt.group_of[name], name, expert, full)[1]
        for name in {n for n, _ in g_of}:
            if name not in out or opt.group_of[name]["algorithm"] != "normuon":
                continue
            rows_here, experts, rows, cols = self.layout(opt, name)
            eps = opt.group_of[name]["normuon_eps"]
            v = local_of(opt.state_of(name)["normuon_v"]).reshape(-1)  # this rank's v, its experts one after another
            g = torch.stack([g_of[name, e] for e in experts]).repeat_interleave(rows)  # each of those rows' g
            if name in self.quotients:  # owned here, its O / d made for g: these rows of it are this rank's part's
                out[name] = (self.quotients.pop(name)[rows_here] * g[rows_here, None]).reshape(-1)
            elif isinstance(rows_here, slice):  # whole rows, one after another: each row's divisor and g broadcast
                o = orthos[name].view(rows_here.stop - rows_here.start, cols)
                out[name] = normuon.normalized(o, normuon.divisor(v[rows_here], eps)[:, None], g[rows_here, None]).view(-1)
            else:  # a box of rows and columns (of each expert held): each row's divisor and g broadcast along its part
                (e0, e1), (r0, r1), (c0, c1) = rows_here
                slots = [experts.index(e) for e in range(e0, e1)]
                row_of = lambda t: t.view(len(experts), rows)[slots, r0:r1, None]  # noqa: E731
                o = orthos[name].view(e1 - e0, r1 - r0, c1 - c0)
                out[name] = normuon.normalized(o, row_of(normuon.divisor(v, eps)), row_of(g)).view(-1)
        self.quotients = {}  # none outlives its step
        return out

    def updated(self, opt, group, name, expert, full):
        """Where a matrix is whole (its owner, or every rank of a local one): its v updated from the full O and its g
        found, O / d kept where normalized() can take its rows from it. Returns (v, g)."""
        o = full.float()  # once: both take it in float32 (a float32 O is used as it is)
        v = normuon.second_moment_(o, self.v_of(opt, name, expert), group["beta2"])
        quotient = normuon.divided(o, normuon.divisor(v, group["normuon_eps"]))
        self.keep(opt, name, expert, quotient)
        return v, normuon.rescale(o, v, group["normuon_eps"], quotient)

    def keep(self, opt, name, expert, quotient):
        """Keep O / d of a whole 2-D matrix made here for its g, if this rank's part of it is whole rows one after
        another: normalized() then takes its part's rows of it (the same division of the same elements) rather
        than dividing them again."""
        if expert < 0 and isinstance(self.layout(opt, name)[0], slice):
            self.quotients[name] = quotient

    def layout(self, opt, name):
        """row_layout(opt, name), made at the parameter's first step and kept."""
        if name not in self.layouts:
            self.layouts[name] = self.row_layout(opt, name)
        return self.layouts[name]

    @staticmethod
    def row_layout(opt, name):
        """Where each element of this rank's local part of parameter `name` finds its row's v, from the placements
        alone (the same at every step): (rows_here, experts, rows, cols). rows_here: the rows of this rank's v that
        its part covers, a slice when the part is whole rows one after another (as FSDP2's Shard(0) cuts and a
        world of one give: O / d * g broadcast row by row then), else its box ((e0, e1), (r0, r1), (c0, c1)): the
        experts (e0, e1 = 0, 1 for a 2-D matrix), rows and columns it holds. experts: the experts (or [0]) whose v
        this rank holds, in its order; rows, cols: a matrix's shape."""
        p = opt.param_by_name[name]
        copy = describe_of(opt, name)
        coordinate = tuple(p.device_mesh.get_coordinate()) if isinstance(p, DTensor) else ()
        box = local_box(copy.shape, copy.mesh_shape, copy.placements, coordinate)
        rows, cols = copy.matrix_shape
        experts = experts_of_v(copy, coordinate)
        (e0, e1), (r0, r1), (c0, c1) = box if copy.expert_stack else ((0, 1),) + box
        if (e1 - e0) * (r1 - r0) * (c1 - c0) == 0:
            return slice(0, 0), experts, rows, cols
        first = experts.index(e0) * rows + r0
        if (c0, c1) == (0, cols) and (e1 - e0 == 1 or (r0, r1) == (0, rows)) and \
                experts[experts.index(e0):experts.index(e0) + e1 - e0] == list(range(e0, e1)):
            return slice(first, first + (e1 - e0 - 1) * rows + r1 - r0), experts, rows, cols
        return ((e0, e1), (r0, r1), (c0, c1)), experts, rows, cols
