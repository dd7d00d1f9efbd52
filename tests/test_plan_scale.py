"""DTensorMuon's plan grows with this rank's share, not with the model: construction of a 17-billion-element model
(meta DTensors: no parameter is allocated) in a fraction of a second and a few megabytes, the plan it keeps a tiny
fraction of the local parameter bytes on a 2 x 2 mesh whose TP pieces are not contiguous, and Llama 3 70B planned
for 16,384 ranks (benchmarks/at_scale.py --plan-only prints 405B's)."""

import gc
import math
import os
import pickle
import sys
import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from conftest import ROOT

from distmuon import dtensor
from distmuon.dtensor import plan

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import at_scale  # noqa: E402
import cost_model  # noqa: E402

MB = 2 ** 20


def meta_blocks(mesh, placements, blocks, d):
    """[(name, DTensor parameter)] of `blocks` blocks of (4d x d, d x 4d) on `mesh`, on the meta device."""
    params = []
    for i in range(blocks):
        for name, shape, where in (("up", (4 * d, d), placements[0]), ("down", (d, 4 * d), placements[1])):
            local = torch.empty(shape, device="meta")
            params.append((f"{i}.{name}", torch.nn.Parameter(DTensor.from_local(local, mesh, where, run_check=False))))
    return params


def test_construction_does_not_grow_with_the_model(single_process_group):
    """16 matrices of 2**30 elements (each held whole by this world of one, on a 1 x 1 FSDP2 x TP mesh): one index
    per element would be 8 GiB a matrix; the plan is ranges, and construction stays within a few MB and a second."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    params = meta_blocks(mesh, ([Shard(0), Shard(0)], [Shard(0), Shard(1)]), 8, 2 ** 14)
    at_scale.reset_peak()
    before = at_scale.rss()[0]
    t0 = time.perf_counter()
    opt = dtensor.DTensorMuon([dict(params=params)], lr=0.02)
    seconds = time.perf_counter() - t0
    grew = at_scale.rss()[1] - before
    assert len(opt.matrices) == 16 and all(m.gather[0][2] == 2 ** 30 for m in opt.matrices)
    assert seconds < 5 and grew < 64 * MB, (seconds, grew / MB)


def test_the_plan_kept_is_a_tiny_fraction_of_the_local_parameters():
    """A 2 x 2 FSDP2 x TP mesh (_StridedShard x ColwiseParallel, Shard x RowwiseParallel: the row-parallel pieces
    are not contiguous), 8 blocks at d = 4096 (1.07 B parameters, shapes only): every rank's plan, pickled, is under
    0.1 % of its parameter bytes, and making it takes a few MB."""
    mesh_shape, ranks = (2, 2), tuple(range(4))
    col = (_StridedShard(0, split_factor=2), Shard(0))
    row = (Shard(0), Shard(1))
    d = 4096
    copies = [plan.Copy(f"{i}.{name}", 0, shape, ranks, mesh_shape, where, False, ("dp", "tp"))
              for i in range(8) for name, shape, where in (("up", (4 * d, d), col), ("down", (d, 4 * d), row))]
    local_bytes = 4 * sum(torch.Size(c.shape).numel() for c in copies) / len(ranks)  # fp32, even shards
    for me in ranks:
        at_scale.reset_peak()
        before = at_scale.rss()[0]
        matrices, _, owners = plan.plan_matrices(copies, {0: 5}, me, 4)
        grew = at_scale.rss()[1] - before
        kept = len(pickle.dumps([(m.gather, m.scatter) for m in matrices]))
        assert kept < local_bytes / 1000 and grew < 64 * MB, (me, kept, grew / MB)
        mine = [m for m in matrices if m.owner == me]
        assert mine and all(len(m.gather) == 4 for m in mine)  # every piece of what it owns, as one box each


def test_llama3_70b_plans_for_16384_ranks_in_seconds_and_keeps_what_this_rank_steps():
    """The plan of rank 0: each matrix keeps its own piece (one tuple for all the matrices of one layout), not every
    piece's holders and sizes; the owner of one matrix of 14,336 pieces keeps no table of them: its transfers are
    made from the Cut as they are read, and are the routes of every piece; the cuts of many pieces are let go, also
    after they are read (what it keeps in all: 0.16 MB, at_scale.py --plan-only)."""
    params = cost_model.param_order(cost_model.MODELS["llama3-70b"].params(), cost_model.GROUPS)
    copies = cost_model.placed_copies(params, cost_model.Mesh(2048, 8), {g: i for i, g in enumerate(cost_model.GROUPS)})
    muon = [c for c in copies if cost_model.GROUPS[c.group] == "muon"]
    t0 = time.perf_counter()
    matrices, _, owners = plan.plan_matrices(muon, {i: 5 for i in range(len(cost_model.GROUPS))}, 0, 16384)
    assert time.perf_counter() - t0 < 60
    assert len(matrices) == 80 * 7 and set(owners.values()) <= set(range(16384))
    assert len(set(owners.values())) == len(matrices)  # more ranks than matrices: each its own owner
    (owned,) = [m for m in matrices if m.owner == 0]
    assert isinstance(owned.gather, plan.OwnedPieces) and owned.piece is None
    assert len(owned.gather) == len(owned.scatter) == 14336
    gather, scatter = list(owned.gather), list(owned.scatter)
    assert all(len(cut.ranks) <= plan.FEW for cut in plan.cut_of.made.values())  # 16,384 pieces: let go, read too
    assert all(len(pieces[0]) <= plan.FEW for pieces in plan.matrix_pieces.made.values())
    (sources, _, numels), (_, destinations, back) = plan.routes(owned)
    assert [t[0] for t in gather] == sources.tolist() and [t[2] for t in gather] == numels.tolist()
    assert [t[1] for t in scatter] == destinations.tolist() and [t[2] for t in scatter] == back.tolist()
    assert sum(numels.tolist()) == math.prod(owned.shape) and all(t[1] == 0 for t in gather)
    others = [m for m in matrices if m is not owned]
    assert all(m.owned is None and m.gather == ((0, m.owner, m.piece[1], None, None),) for m in others)
    assert len({id(m.piece) for m in others}) == len({(m.copy.shape, m.copy.placements) for m in others})  # 1 a layout
    assert all(m.held is None and m.numels is None and m.holders is None for m in matrices)


def test_plan_only_prints_what_the_plans_of_70b_and_405b_keep_under_1_percent_of_the_ranks_parameters():
    """benchmarks/at_scale.py --plan-only's rows on 16,384 ranks: each plan in seconds, and what it keeps (matrices,
    FLOPs and owners: 0.16 MB for 70B, 0.27 MB for 405B, measured) under the issue's 1 % of the rank's parameters:
    24.8 MB for 70B (the smallest share: its hardest case), 127 MB for 405B."""
    lines = []
    at_scale.plan_only(lines.append, names=("llama3-70b", "llama3-405b"), worlds=(16384,))
    header, *rows = lines
    assert header.split()[:9] == ["model", "ranks", "mesh", "matrices", "plan", "s", "peak", "MB", "kept"]
    shares = {}
    for row, (name, n_matrices, params_mb) in zip(rows, (("llama3-70b", "560", 24.8), ("llama3-405b", "882", 127.0))):
        model, ranks, mesh, matrices, seconds, _, kept, local, share, copies, packed = row.split()
        assert (model, ranks, mesh, matrices) == (name, "16384", "2048x8", n_matrices) and float(seconds) < 30
        assert float(share) == pytest.approx(100 * float(kept) / float(local), abs=0.01)
        assert 0.05 < float(kept) and float(local) == pytest.approx(params_mb, abs=0.1)
        assert float(copies) < 1 and float(packed) < 1  # a mesh's ranks a range, not 16,384 ints a Copy
        shares[name] = float(share)
    assert max(shares.values()) < 1, shares


def test_as_ranks_is_a_range_exactly_where_the_ranks_are_evenly_spaced():
    """Both ways of as_ranks (Python's ints for a few ranks, tensor ops for many) give the ranks themselves, a range
    exactly where they are evenly spaced and increasing; ranks_of the same, else a tuple."""
    cases = [[5], [0, 1], [3, 7, 11], [0, 2, 3], [4, 4], list(range(0, 640, 10)), list(range(0, 650, 10)),
             list(range(0, 650, 10))[:-1] + [641], list(range(3, 3 + 1000))]
    for ranks in cases:
        got = plan.as_ranks(torch.tensor(ranks, dtype=torch.int64))
        even = len(ranks) > 1 and ranks[1] > ranks[0] and all(b - a == ranks[1] - ranks[0]
                                                              for a, b in zip(ranks, ranks[1:]))
        assert list(got) == ranks and isinstance(got, range) == even, (ranks[:4], len(ranks), got)
        kept = plan.ranks_of(ranks)  # what a Copy and an Axis keep
        assert list(kept) == ranks and isinstance(kept, range if even else tuple), (ranks[:4], len(ranks), kept)


def test_describe_reads_each_mesh_once_and_gives_what_the_mesh_says(single_process_group):
    """describe reads a mesh's ranks once (plan.mesh_description, kept while the mesh lives), and its Copies say
    what DeviceMesh.mesh and the dim names say, for every parameter on the mesh."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    params = meta_blocks(mesh, ([Shard(0), Shard(0)], [Shard(0), Shard(1)]), 3, 8)
    copies = [plan.describe(n, 0, p, False) for n, p in params]
    assert plan.mesh_description(mesh) is plan.mesh_description(mesh) and mesh in plan.MESHES
    assert all((c.mesh_ranks, c.mesh_shape, c.mesh_dim_names) == (tuple(mesh.mesh.reshape(-1).tolist()),
                                                                  tuple(mesh.mesh.shape), ("dp", "tp"))
               for c in copies)
    assert [c.placements for c in copies] == [tuple(p.placements) for _, p in params]


@pytest.mark.parametrize("mesh_shape", [(2, 1), (1, 2), (2, 2)])
def test_one_per_owner_gives_every_rank_one_matrix_in_every_group(mesh_shape):
    """DTensorMuon's exchange_bytes="one_per_owner" on at_scale.py's model (8 blocks, FSDP2 x TP as it places them):
    every group one matrix for each rank to orthogonalize, the groups that the world's size times the largest matrix's
    bf16 bytes makes (the plan's owners of equal matrices take turns)."""
    ranks, d = tuple(range(math.prod(mesh_shape))), 64
    dp, tp = mesh_shape
    col = (_StridedShard(0, split_factor=tp) if dp > 1 and tp > 1 else Shard(0), Shard(0))
    row = (Shard(0), Shard(1) if tp > 1 else Shard(0))
    copies = [plan.Copy(f"{i}.{name}", 0, shape, ranks, mesh_shape, where, False, ("dp", "tp"))
              for i in range(8) for name, shape, where in (("up", (4 * d, d), col), ("down", (d, 4 * d), row))]
    matrices, _, owners = plan.plan_matrices(copies, {0: 5}, 0, len(ranks))
    limit = plan.exchange_limit("one_per_owner", [m.shape for m in matrices], len(ranks))
    assert limit == len(ranks) * 2 * 4 * d * d and plan.exchange_limit(12345, [m.shape for m in matrices], 4) == 12345
    groups = plan.exchange_groups(matrices, "one_per_owner")
    assert len(groups) == 16 // len(ranks) and groups == plan.exchange_groups(matrices, limit)
    for names in groups:
        assert sorted(owners[n] for n in names) == list(ranks), (names, [owners[n] for n in names])


def test_one_per_owner_never_gives_an_owner_two_matrices_in_a_group_and_takes_every_parameter_once():
    """Matrices of four sizes (a GPT block's qkv, proj, fc, fc2) and an expert stack of more experts than ranks, on 4
    ranks: no owner twice in a group, each parameter in one group, as many groups as the busiest owner has matrices
    (the stack's, which has two matrices of one owner, in a group alone)."""
    ranks, d = (0, 1, 2, 3), 32
    shapes = {"qkv": (3 * d, d), "proj": (d, d), "fc": (4 * d, d), "fc2": (d, 4 * d)}
    copies = [plan.Copy(f"{i}.{name}", 0, shape, ranks, (4,), (Shard(0),), False, ("dp",))
              for i in range(5) for name, shape in shapes.items()]
    copies.append(plan.Copy("experts", 0, (6, d, d), ranks, (4,), (Shard(0),), True, ("dp",)))
    matrices, _, owners = plan.plan_matrices(copies, {0: 5}, 0, len(ranks))
    groups = plan.exchange_groups(matrices, "one_per_owner")
    assert sorted(n for names in groups for n in names) == sorted(c.name for c in copies)
    of = {}
    for m in matrices:
        of.setdefault(m.copy.name, []).append(m.owner)
    assert ("experts",) in groups and len(set(of["experts"])) < len(of["experts"])
    for names in groups:
        used = [o for n in names for o in of[n]]
        assert names == ("experts",) or len(used) == len(set(used)), (names, used)
    busiest = max(sum(1 for m in matrices if m.owner == r and m.copy.name != "experts") for r in ranks)
    assert len(groups) == busiest + 1


def test_an_owner_of_many_pieces_reads_its_transfers_as_the_routes_of_every_rank_say():
    """Past plan.FEW pieces an owner keeps its transfers as tensors (OwnedPieces), read as tuples: they are the
    routes every rank's plan agrees on (plan.routes, tensor ops over the whole cut), each box as many elements as
    its piece, the boxes the whole matrix, and a pickled plan reads the same."""
    world, shape = 2 * plan.FEW + 3, (4 * plan.FEW + 7, 96)  # uneven: the last pieces smaller, some empty
    copy = plan.Copy("w", 0, shape, tuple(range(world)), (world,), (Shard(0),), False, ("dp",))
    (m,), _, owners = plan.plan_matrices([copy], {0: 5}, 0, world)
    assert owners["w"] == 0 and isinstance(m.gather, plan.OwnedPieces) and isinstance(m.scatter, plan.OwnedPieces)
    (sources, _, numels), (_, destinations, back_numels) = plan.routes(m)
    gather, scatter = list(m.gather), list(m.scatter)
    assert [t[0] for t in gather] == sources.tolist() and [t[2] for t in gather] == numels.tolist()
    assert [t[1] for t in scatter] == destinations.tolist() and [t[2] for t in scatter] == back_numels.tolist()
    assert len(m.gather) == len(gather) < world and len(m.scatter) == len(scatter)  # the empty pieces move nothing
    assert all(math.prod(b - a for a, b in box) == numel for _, _, numel, _, box in gather)
    assert sum(t[2] for t in gather) == math.prod(shape) and m.gather[0] == gather[0]
    assert pickle.loads(pickle.dumps(m)).gather == gather and m.gather + m.scatter == gather + scatter


def test_a_plan_is_the_same_whether_a_mesh_s_ranks_are_a_range_or_a_tuple():
    """describe keeps a mesh's ranks as a range where they are evenly spaced (ranks_of): every rank's plan is the one
    the tuple of them gives, transfer for transfer (a 3 x 2 mesh of ranks 2..7 of 8, uneven shards, an expert stack,
    a TP-only copy on a column of ranks 3, 5, 7)."""
    def copies(ranks, column):
        return [plan.Copy("w", 0, (10, 7), ranks, (3, 2), (Shard(0), Shard(1)), False),
                plan.Copy("experts", 0, (5, 6, 4), ranks, (3, 2), (Shard(0), Shard(1)), True),
                plan.Copy("v", 0, (9, 3), column, (3,), (Shard(0),), False)]

    def read(matrices):
        return [(m.name, m.owner, list(m.gather), list(m.scatter)) for m in matrices]

    as_range = copies(plan.ranks_of(range(2, 8)), plan.ranks_of([3, 5, 7]))
    as_tuple = copies(tuple(range(2, 8)), (3, 5, 7))
    assert isinstance(as_range[0].mesh_ranks, range) and isinstance(as_range[2].mesh_ranks, range)
    for me in range(8):
        planned = plan.plan_matrices(as_range, {0: 5}, me, 8)[0]
        assert read(planned) == read(plan.plan_matrices(as_tuple, {0: 5}, me, 8)[0]) and len(planned) == 7
        assert sum(len(m.gather) for m in planned) > 0 or me < 2  # every rank of the mesh takes part


def test_the_exchange_pauses_the_garbage_collector_for_its_loops_only(single_process_group):
    """The exchange's loops over parts run with Python's cyclic collector off (exchange.gc_paused), and leave it as
    they found it, on or off, raised through or not, also around a whole step (a 1 x 1 mesh, torch's bits)."""
    from distmuon.dtensor import exchange

    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            with exchange.gc_paused():
                assert not gc.isenabled()
            assert gc.isenabled() == enabled
            with pytest.raises(KeyError), exchange.gc_paused():
                raise KeyError("inside")
            assert gc.isenabled() == enabled
    finally:
        gc.enable()
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    weight = torch.randn(12, 8)
    grad = torch.randint(-8, 8, (12, 8)) / 1024
    p = torch.nn.Parameter(DTensor.from_local(weight.clone(), mesh, [Shard(0), Shard(0)], run_check=False))
    p.grad = DTensor.from_local(grad.clone(), mesh, [Shard(0), Shard(0)], run_check=False)
    reference = torch.nn.Parameter(weight.clone())
    reference.grad = grad.clone()
    dtensor.DTensorMuon([("w", p)], lr=0.02).step()
    torch.optim.Muon([reference], lr=0.02).step()
    assert gc.isenabled() and torch.equal(p.to_local(), reference.detach())
    assert not torch.equal(reference.detach(), weight)
