"""The cost model's plans (benchmarks/cost_model.py): the lesson's optimizers built as muon_tools.plan_optimizer
builds them, on a virtual grid over meta parameters, and DTensorMuon's copies placed as FSDP2 x TP x EP place them,
planned by distmuon/dtensor/plan.py's plan_matrices."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import distributed_muon_cpu
from distmuon.dtensor import plan
import muon_tools
from distmuon.checks import ORTHOGONALIZED
from distmuon.dtensor.normuon import v_placements


# =============================================================================
# 3. The plans
# =============================================================================
# 3a. The lesson's strategies. The optimizer class itself, on the grid rank 0 plans with (distributed_muon_cpu.plan_grid),
# over meta tensors: nothing is allocated, everything a rank plans is computed. The lesson's grid takes any
# size (only the runner refuses more than MAX_WORLD ranks, each a process on this machine): a virtual grid
# starts none.

def virtual_grid(dp, tp, rank=0):
    return distributed_muon_cpu.plan_grid(dp, tp, rank)


def lesson_optimizer(specs, cfg):
    """The optimizer rank 0 of cfg's run builds (muon_tools.build_optimizer), on meta tensors."""
    params = {s.name: torch.empty(muon_tools.tp_local_shape(s, cfg.tp), device="meta") for s in specs}
    return muon_tools.build_optimizer(specs, cfg, virtual_grid(cfg.dp, cfg.tp), params)


# 3b. DTensorMuon over FSDP2 x TP x EP. A Copy per parameter and mesh, placed as torch places it (the rules
# below were read off real runs, and tests/test_cost_model.py checks them against the placements of real
# FSDP2 x TP runs): TP first (Shard(0) col / experts, Shard(1) row, Replicate for a TP module's unsplit
# parameter), then FSDP2 over "dp" on the tensor dim it shards (dim 0; an expert stack's dim 1 where dp
# divides it and every TP rank holds an expert, as dtensor_demo.parallelize asks): where TP already cuts
# that dim, FSDP2's is a _StridedShard(split_factor = TP size); a parameter TP leaves alone lives on its TP
# column's own dp sub-mesh (one Copy per column). HSDP adds a "replicate" mesh dim in front, Replicate() on it.

@dataclass(frozen=True)
class Mesh:
    """FSDP2 x TP (x EP over the "tp" dim, as the demo, or an "ep" dim) on world = replicate x dp x tp ranks,
    rank = row-major over (replicate, dp, tp). ep_dim: the mesh dim name expert stacks are cut on."""
    dp: int
    tp: int
    replicate: int = 1
    ep_dim: str = "tp"

    @property
    def world(self):
        return self.replicate * self.dp * self.tp

    @property
    def shape(self):
        return ((self.replicate,) if self.replicate > 1 else ()) + (self.dp, self.tp)

    @property
    def names(self):
        return (("replicate",) if self.replicate > 1 else ()) + ("dp", self.ep_dim)


def fsdp_placement(tp_placement, dim, tp):
    """FSDP2's placement on "dp" when it shards tensor dim `dim` of a parameter TP placed as tp_placement."""
    if isinstance(tp_placement, Shard) and tp_placement.dim == dim and tp > 1:
        return _StridedShard(dim, split_factor=tp)
    return Shard(dim)


def placed_copies(params, mesh, group_index):
    """[plan.Copy] of every parameter, in the order DTensorMuon's ranks swap them (rank 0's, then each further
    rank's new copies: those of the other TP columns). group_index: {group name: its index in the optimizer}."""
    ranks = torch.arange(mesh.world).view(mesh.shape)
    world, column = plan.ranks_of(ranks), [plan.ranks_of(ranks[..., t]) for t in range(mesh.tp)]  # as describe's
    rep = (Replicate(),) if mesh.replicate > 1 else ()
    tp_of = {"col": Shard(0), "row": Shard(1), "replicate": Replicate(), "expert": Shard(0)}
    whole, columns = [], {}
    for p in params:
        if p.tp is None:  # FSDP2 alone, on each TP column's own (replicate x) dp sub-mesh
            columns[p] = [plan.Copy(p.name, group_index[p.group], p.shape, column[t],
                                  mesh.shape[:-1], rep + (Shard(0),), False, mesh.names[:-1]) for t in range(mesh.tp)]
            continue
        on_tp = tp_of[p.tp]
        # an expert stack's dim 1 where dp divides it, unless a TP rank holds no expert (dtensor_demo.parallelize)
        every_ep_rank_has_one = mesh.ep_dim != "tp" or len(torch.arange(p.shape[0]).chunk(mesh.tp)) == mesh.tp
        dim = 1 if p.expert and p.shape[1] % mesh.dp == 0 and every_ep_rank_has_one else 0
        whole.append(plan.Copy(p.name, group_index[p.group], p.shape, world, mesh.shape,
                             rep + (fsdp_placement(on_tp, dim, mesh.tp), on_tp), p.expert, mesh.names))
    by_name = {c.name: c for c in whole}
    first = [by_name[p.name] if p.name in by_name else columns[p][0] for p in params]
    return first + [cs[t] for t in range(1, mesh.tp) for cs in columns.values()]


def param_order(params, groups):
    """The parameters as DTensorMuon indexes them: group by group, in the order of `groups` (names)."""
    return [p for g in groups for p in params if p.group == g]


# DTensorMuon's plan is its own: distmuon/dtensor/plan.py's plan_matrices (owners by assign_owners(holders=, load=)), each
# piece a box of ranges (its Cut), every rank's transfers its routes; so the bytes priced here are the bytes the
# optimizer moves, by construction. The plan as rank 0 makes it: the owners are the same on every rank.

def dtensor_plan(copies, group_ns_steps, world):
    """DTensorMuon's automatic plan (plan_matrices, without the Gram form): [plan.Matrix], ns_flops, owners."""
    return plan.plan_matrices(copies, group_ns_steps, 0, world)


def dtensor_transfers(matrices):
    """(gather, scatter): (sources, destinations, elements) tensors of every rank's transfers (plan.routes)."""
    gather, scatter = zip(*(plan.routes(m) for m in matrices)) if matrices else ((), ())
    cat = lambda moves: tuple(torch.cat(c) if c else torch.zeros(0, dtype=torch.int64)  # noqa: E731
                              for c in zip(*moves)) if moves else (torch.zeros(0, dtype=torch.int64),) * 3
    return cat(gather), cat(scatter)


@functools.lru_cache(maxsize=None)
def local_numels(shape, mesh_ranks, mesh_shape, placements, world):
    """Elements of the copy each rank holds: an int64 tensor over the world (0 off the copy's mesh; a plain
    tensor, mesh_ranks (), is whole everywhere)."""
    out = torch.zeros(world, dtype=torch.int64)
    if not mesh_ranks:
        return out + math.prod(shape)
    cut = plan.cut_of(shape, mesh_ranks, mesh_shape, placements)
    numels = (cut.stops - cut.starts).prod(dim=1)
    out[cut.ranks.reshape(-1)] = numels.repeat_interleave(cut.ranks.shape[1])
    return out


def held(copy, world):
    return local_numels(copy.shape, copy.mesh_ranks, copy.mesh_shape, copy.placements, world)


def v_of(copy):
    """NorMuon's v of a copy (distmuon/dtensor/normuon.py): its shape, one float32 per row of each matrix, and its
    placements, Replicate but where an expert stack's experts are cut."""
    return tuple(copy.shape[:-1]) + (1,), v_placements(copy.placements, copy.expert_stack)


def state_and_elements(copies, algorithm_of, world):
    """(state bytes per rank, {"muon", "adamw": elements per rank}) of the copies each rank holds (its own column's):
    DTensorMuon's state is like the parameter, Muon's momentum fp32, AdamW's two moments and a 4-byte step;
    NorMuon's v beside the momentum on every rank of the copy's mesh (the rows of the experts it holds)."""
    state, elements = torch.zeros(world, dtype=torch.int64), {"muon": torch.zeros(world, dtype=torch.int64),
                                                              "adamw": torch.zeros(world, dtype=torch.int64)}
    for c in copies:
        n, algorithm = held(c, world), algorithm_of(c)
        kind = "muon" if algorithm in ORTHOGONALIZED else "adamw"
        on = torch.zeros(world, dtype=torch.int64)
        on[list(c.mesh_ranks or range(world))] = 1
        state += 4 * n if kind == "muon" else (8 * n + 4) * on
        if algorithm == "normuon":
            shape, placements = v_of(c)
            state += 4 * local_numels(shape, c.mesh_ranks, c.mesh_shape, placements, world)
        elements[kind] += n
    return state.tolist(), {k: v.tolist() for k, v in elements.items()}
