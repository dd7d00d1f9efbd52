"""The DTensor tests' runs beyond the demo's own: the explicit distributed_config on plain row-chunked tensors,
parameters placed by hand on any mesh with param groups of any options, refused steps, and Runs: many runs, each
on its own (sub-)mesh, in one spawn of ranks (starting ranks costs more than a small run). Each has its reference:
torch.optim.Muon / AdamW (or NorMuon's, muon_tools.NorMuonReference) in one process."""

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import muon_tools
from distmuon.dtensor import DistributedConfig, DTensorMuon
from dtensor_accounting import LessonRuns, run_lesson_rank
from dtensor_run import (DemoConfig, build_on_mesh, exact_grads, give_grads, local_copies, mesh_of,
                         run_demo_rank)

# The explicit form (distmuon/dtensor/, section 4), on parallelism DTensor does not describe: plain
# tensors, each rank keeping its torch.chunk of every matrix's rows (uneven,
# possibly empty). The gather and redistribute below are deliberately plain
# (a padded all-gather and a broadcast per matrix): what a user might write
# first; the optimizer only checks what they return.
EXPLICIT_SHAPES = {"a.weight": (30, 20), "b.weight": (20, 30), "c.weight": (7, 5)}


@dataclass(frozen=True)
class ExplicitRun:
    """The explicit form on every rank of the spawn, with the demo's hyperparameters; short_gather: at step 2,
    rank 0's gather gives every matrix it owns a row short (the step must be refused, nothing changed)."""

    demo: DemoConfig = DemoConfig()
    short_gather: bool = False


def rows_of(full, rank, world):
    chunks = full.chunk(world, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def explicit_config(world, assign=None):
    def gather(updates, owners):
        full = {}
        for name, local in updates.items():
            rows = -(-EXPLICIT_SHAPES[name][0] // world)  # pad: Gloo's all_gather needs equal sizes
            padded = local.new_zeros(rows, local.shape[1])
            padded[:local.shape[0]] = local
            pieces = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(pieces, padded)
            if owners[name] == dist.get_rank():
                counts = [rows_of(torch.empty(EXPLICIT_SHAPES[name]), r, world).shape[0] for r in range(world)]
                full[name] = torch.cat([p[:c] for p, c in zip(pieces, counts)])
        return full

    def redistribute(orthos, owners):
        local = {}
        for name, owner in owners.items():
            # contiguous(): Newton-Schulz returns a tall matrix as a transposed view, and a collective sends storage
            full = (orthos[name].contiguous() if owner == dist.get_rank()
                    else torch.empty(EXPLICIT_SHAPES[name], dtype=torch.bfloat16))
            dist.broadcast(full, src=owner)
            local[name] = rows_of(full, dist.get_rank(), world)
        return local

    return DistributedConfig(assign=assign, gather=gather, redistribute=redistribute, global_shapes=EXPLICIT_SHAPES)


def run_explicit_rank(rank, run, device):
    """Every rank: its rows of each EXPLICIT_SHAPES matrix, the demo's steps with exact gradients."""
    torch.set_num_threads(1)
    cfg = run.demo
    world = dist.get_world_size()
    torch.manual_seed(cfg.seed)
    full = {n: torch.randn(s) for n, s in EXPLICIT_SHAPES.items()}
    params = {n: nn.Parameter(rows_of(t, rank, world).clone()) for n, t in full.items()}
    config = explicit_config(world)
    if run.short_gather:  # at step 2, rank 0's gather gives every matrix it owns a row short
        gather = config.gather
        config = replace(config, gather=lambda u, o: {n: t[:-1] if rank == 0 and step == 2 else t
                                                      for n, t in gather(u, o).items()})
    opt = DTensorMuon([dict(params=list(params.items()), algorithm="muon", lr=cfg.lr,
                            weight_decay=cfg.weight_decay, momentum=cfg.momentum)], distributed_config=config)
    out = dict(rank=rank, owners=opt.owners)
    for step in range(1, cfg.steps + 1):
        for name, g in exact_grads(EXPLICIT_SHAPES, cfg.seed, step).items():
            params[name].grad = rows_of(g, rank, world).clone()
        if run.short_gather and step == 2:
            out.update(refused_step(opt, params))
            break
        opt.step()
    return dict(out, params={n: p.detach() for n, p in params.items()})


def refused_step(opt, params):
    """{"error": what opt.step() raised here ("" if nothing), "unchanged": whether every local parameter and
    state tensor kept its bits}: a step that must be refused, tried."""
    before = local_copies(params.items()), local_state(opt)
    error = ""
    try:
        opt.step()
    except ValueError as e:
        error = str(e)
    after = local_copies(params.items()), local_state(opt)
    tensors = lambda snapshot: list(snapshot[0].values()) + [t for s in snapshot[1].values() for t in s.values()]
    return dict(error=error, unchanged=all(torch.equal(a, b) for a, b in zip(tensors(before), tensors(after))))


def run_explicit_reference(run):
    """{name: full matrix} after the demo's steps of torch.optim.Muon on the same start and gradients."""
    torch.set_num_threads(1)
    cfg = run.demo
    torch.manual_seed(cfg.seed)
    params = {n: nn.Parameter(torch.randn(s)) for n, s in EXPLICIT_SHAPES.items()}
    opt = torch.optim.Muon(list(params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                           nesterov=True, adjust_lr_fn="original")
    for step in range(1, cfg.steps + 1):
        for name, g in exact_grads(EXPLICIT_SHAPES, cfg.seed, step).items():
            params[name].grad = g.clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


# Any param groups, on any mesh: parameters placed by hand (distribute_tensor)
# on meshes real training uses, with param groups of different options. Each is
# checked against torch.optim.Muon / AdamW with the same groups (each expert of
# a stack its own 2-D matrix in its stack's group):
#   * equal-size groups (one matrix, one vector: groups told apart by identity, not by ==);
#   * four groups with different options (every adjust_lr_fn, Nesterov on and
#     off, ns_steps, betas and eps);
#   * HSDP: mesh (replicate, shard, tp), each matrix (Replicate, Shard(0), Shard(1))
#     as fully_shard(mesh=mesh["replicate", "shard"]) over TP leaves it;
#   * expert parallel: stacks (E, out, in) with experts over "ep" (Shard(0)) and
#     TP inside each expert (Shard(1) for w1, Shard(2) for w2), E uneven over ep.
# bad="option": after step 1, group 1 gets a bad adjust_lr_fn on every rank
# ("option@r": on rank r alone); the next step must be refused on every rank,
# ranks whose shard of that group is empty included, with nothing changed.
PLACEMENT = {"S0": Shard(0), "S1": Shard(1), "S2": Shard(2), "R": Replicate()}


@dataclass(frozen=True)
class PlacedRun:
    mesh: tuple  # mesh shape, over the first prod(mesh) ranks
    dims: tuple  # mesh dim names
    params: tuple  # (name, shape, placements as PLACEMENT keys, group index)
    groups: tuple  # per group: tuple of (option, value) pairs, "algorithm" among them
    expert_stacks: tuple = ()
    steps: int = 3
    seed: int = 0
    bad: str = ""


def placed_groups(run, tensors):
    """The run's param groups over `tensors` ({name: tensor}), named as DTensorMuon takes them."""
    return [dict(dict(options), params=[(n, tensors[n]) for n, _, _, g in run.params if g == i])
            for i, options in enumerate(run.groups)]


def placed_start(run):
    """{name: full initial tensor} and the exact gradients of step s (exact_grads), the same everywhere."""
    g = torch.Generator().manual_seed(run.seed)
    return {n: torch.randn(shape, generator=g) for n, shape, _, _ in run.params}


def local_state(opt):
    """{name: {state key: a CPU copy of this rank's local tensor}}."""
    return {n: local_copies(opt.state[p].items()) for n, p in opt.param_by_name.items()}


def run_placed_rank(rank, run, device):
    """Every rank of the run's mesh: its parameters placed, run.steps steps of exact gradients."""
    mesh, group = mesh_of(run.mesh, run.dims, device)
    if rank >= math.prod(run.mesh):
        return None
    placements = {n: [PLACEMENT[k] for k in where] for n, _, where, _ in run.params}
    shapes = {n: shape for n, shape, _, _ in run.params}
    params = {n: nn.Parameter(distribute_tensor(t.to(device), mesh, placements[n], src_data_rank=None))
              for n, t in placed_start(run).items()}
    opt = DTensorMuon(placed_groups(run, params), expert_stacks=run.expert_stacks, group=group)
    out = dict(rank=rank, error="", unchanged=None)
    for step in range(1, run.steps + 1):
        for n, g in exact_grads(shapes, run.seed, step).items():
            params[n].grad = distribute_tensor(g.to(device), mesh, placements[n], src_data_rank=None)
        if run.bad and step == 2:
            if run.bad == "option" or rank == int(run.bad.split("@")[1]):  # "option@r": on rank r alone
                opt.param_groups[1]["adjust_lr_fn"] = "bogus"
            out.update(refused_step(opt, params))
            break
        opt.step()
    where = {n: distribute_tensor(torch.arange(math.prod(shapes[n]), device=device).view(shapes[n]), mesh,
                                  placements[n], src_data_rank=None).to_local().reshape(-1).cpu() for n in params}
    return dict(out, params=local_copies(params.items()), where=where, ledger=asdict(opt.ledger), owners=opt.owners,
                placements={n: str(tuple(p.placements)) for n, p in params.items()})


def run_placed_reference(run):
    """{name: full tensor} after run.steps steps of torch.optim.Muon (the Muon groups, each expert its own matrix)
    and torch.optim.AdamW(foreach=False) (the AdamW groups), every option per group."""
    torch.set_num_threads(1)
    shapes = {n: shape for n, shape, _, _ in run.params}
    stacks = set(run.expert_stacks)
    pieces = lambda n, t: [t[e] for e in range(t.shape[0])] if n in stacks else [t]
    tensors = {n: [nn.Parameter(p.clone()) for p in pieces(n, t)] for n, t in placed_start(run).items()}
    groups = {"muon": [], "normuon": [], "adamw": []}
    for i, options in enumerate(run.groups):
        options = dict(options)
        kind = options.pop("algorithm", "muon")
        mine = [p for n, _, _, g in run.params if g == i for p in tensors[n]]
        groups[kind].append(dict(options, params=mine))  # every option as the group gives it: torch's own
    optimizers = ([torch.optim.Muon(groups["muon"])] if groups["muon"] else []) + \
                 ([muon_tools.NorMuonReference(groups["normuon"])] if groups["normuon"] else []) + \
                 ([torch.optim.AdamW(groups["adamw"], foreach=False)] if groups["adamw"] else [])
    for step in range(1, run.steps + 1):
        for n, g in exact_grads(shapes, run.seed, step).items():
            for p, piece in zip(tensors[n], pieces(n, g)):
                p.grad = piece.clone()
        for opt in optimizers:
            opt.step()
    return {n: torch.stack([p.detach() for p in ps]) if n in stacks else ps[0].detach() for n, ps in tensors.items()}


# Param groups of different options (PlacedRun), each as torch's own optimizer takes it: every adjust_lr_fn
# torch accepts, Nesterov on and off, another ns_steps, Muon's eps (Newton-Schulz's: 100 is above these updates'
# norms, so it scales them), AdamW's betas, eps, amsgrad (a second moment that falls: beta2 0.5) and maximize;
# groups 1, 2 and 3 hold one parameter each (equal sizes: a group is found by identity, not by ==), group 3 a
# vector beside group 1's matrix. tests/test_torch_options.py checks each option changes the result.
GROUPS = ((("algorithm", "muon"), ("lr", 0.02), ("weight_decay", 0.1)),
          (("algorithm", "muon"), ("lr", 0.03), ("weight_decay", 0.0), ("adjust_lr_fn", "spectral_unclamped"),
           ("nesterov", False), ("momentum", 0.9)),
          (("algorithm", "muon"), ("lr", 0.01), ("weight_decay", 0.05), ("adjust_lr_fn", "match_rms_adamw"),
           ("ns_steps", 3), ("eps", 100.0)),
          (("algorithm", "adamw"), ("lr", 0.01), ("weight_decay", 0.02), ("betas", (0.8, 0.5)), ("eps", 1e-6),
           ("amsgrad", True), ("maximize", True)))
# b's 3 rows over 4 ranks leave rank 3 nothing of group 1's only matrix
GROUPED = (("a", (6, 5), ("S0", "S1"), 0), ("b", (3, 7), ("S0", "R"), 1), ("c", (5, 9), ("R", "S1"), 2),
           ("d", (7,), ("S0", "R"), 3), ("e", (4, 4), ("S1", "S0"), 0))


def placed_runs(groups):
    """The meshes every optimizer here is held to, with param groups `groups` (GROUPS' shape: three Muon groups, then
    an AdamW one): GROUPED on 1x1, 2x2, 4x1; HSDP by hand; expert stacks over EP, with TP inside and uneven."""
    return {
        **{f"groups {m}x{n}": PlacedRun((m, n), ("dp", "tp"), GROUPED, groups) for m, n in [(1, 1), (2, 2), (4, 1)]},
        # HSDP by hand: (replicate, shard, tp), as fully_shard(mesh=mesh["replicate", "shard"]) over TP leaves them
        "hsdp by hand 2x2x2": PlacedRun((2, 2, 2), ("replicate", "shard", "tp"),
                                           (("w", (10, 6), ("R", "S0", "S1"), 0), ("v", (9, 12), ("R", "S0", "S0"), 0),
                                            ("n", (6,), ("R", "S0", "R"), 1)), groups[:1] + groups[3:]),
        # expert parallel: whole experts over ep, TP inside each expert (w1's rows, w2's columns)
        "ep 2 x tp 2": PlacedRun((2, 2), ("ep", "tp"), (("w1", (4, 6, 4), ("S0", "S1"), 0),
                                                           ("w2", (4, 4, 6), ("S0", "S2"), 0)),
                                    groups[:1], expert_stacks=("w1", "w2")),
        "ep 4, 6 experts": PlacedRun((4,), ("ep",), (("w1", (6, 5, 4), ("S0",), 0),
                                                          ("w2", (6, 4, 5), ("S0",), 0)),
                                        groups[:1], expert_stacks=("w1", "w2")),
    }


@dataclass(frozen=True)
class RefusedRun:
    """The demo on its mesh with what must be refused on every rank, in one line: "partial" (a gradient of pending
    reductions, Partial) or "assign" (an owner assignment that leaves every matrix without an owner)."""

    demo: DemoConfig
    bad: str


def run_refused_rank(rank, run, device):
    """{"rank", "error"}: what DTensorMuon raised here (the same on each rank of the mesh, never a hang)."""
    config = DistributedConfig(assign=lambda ns_flops, holders, world: {0: []}) if run.bad == "assign" else None
    try:
        built = build_on_mesh(run.demo, rank, device, config)
        if built is None:
            return None
        _, model, where, opt = built
        if run.bad == "partial":  # this one gradient alone, of pending reductions
            p = opt.param_by_name["layers.0.fc2.weight"]
            p.grad = DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh, [Partial(), Partial()],
                                        run_check=False, shape=p.shape, stride=p.stride())
        else:
            give_grads(model, run.demo, 1, where)
        opt.step()
    except ValueError as e:
        return dict(rank=rank, error=str(e))
    return dict(rank=rank, error="")


@dataclass(frozen=True)
class Runs:
    """Several runs (DemoConfig, LessonRuns, PlacedRun, ExplicitRun, RefusedRun) in ONE spawn of dp x tp ranks, one
    after another, each on its own (sub-)mesh."""

    runs: tuple
    dp: int = 8
    tp: int = 1
    timeout_s: float = muon_tools.TIMEOUT_S


RANK_BODIES = {DemoConfig: run_demo_rank, LessonRuns: run_lesson_rank, ExplicitRun: run_explicit_rank,
               PlacedRun: run_placed_rank, RefusedRun: run_refused_rank}  # each run's type: what every rank runs


def run_many_rank(rank, runs, device):
    torch.set_num_threads(1)
    results = []
    for run in runs.runs:
        results.append(RANK_BODIES[type(run)](rank, run, device))
        dist.barrier()  # the next run's checkpoint may be this one's: every rank done writing first
    return results
