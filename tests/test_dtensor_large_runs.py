"""DTensorMuon's issue-20 options on real FSDP2 x TP runs: fused blocks (ns_blocks), QK-clip (clip_qk_), Polar
Express's per-iteration coefficients, and Newton-Schulz on TP pieces (tp_newton_schulz="gram").

One spawn of 4 Gloo ranks runs every scenario one after another, on the meshes real runs use: FSDP2 x TP 2x2
(_StridedShard on dp, Shard(0) / Shard(1) on tp), 4x1 (FSDP2 alone), 1x4 (TP alone) and HSDP 2x1x2 (replicate x
shard x tp). The model is built with torch's own parallelize_module (ColwiseParallel, RowwiseParallel) and
fully_shard; every gradient is an exact multiple of 2**-10 (dtensor_run.exact_grads), given as a DTensor with the
parameter's placements.

References, single device, from the papers' equations (never the distributed code on one rank): the shared
independent references of tests/large_runs_reference.py (also the lesson's), group by group, each expert its own
matrix, and torch.optim.Muon itself:
  * blocks: torch.optim.Muon on each block of rows as its own parameter (Q, K, V of a fused QKV; each head's
    segments for "heads"; an expert's gate and up): torch.equal;
  * QK-clip: torch.optim.Muon's step, then head h's rows of W_q and W_k times sqrt(tau / S_h) where S_h, the max
    over every rank's logits (global_max, here), exceeds tau: torch.equal;
  * Polar Express: torch.optim.Muon with its Newton-Schulz (torch.optim._muon._zeropower_via_newtonschulz) swapped
    for one with one (a, b, c) per iteration and torch's op choice (torch.addmm): torch.equal;
  * Gram: torch.optim.Muon; not always bit-identical (float32 sums over ranks inside each iteration), held to the
    lesson's gram_tolerance (muon_tools/reference.py derives it from torch's own bf16 error on each step's input).

`python tests/test_dtensor_large_runs.py [seeds]` prints the Gram sweep's figures.
"""

import math
from dataclasses import asdict, dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import distributed_muon_cpu
from distmuon import checks
from distmuon import large_runs
import muon_tools

from distmuon import dtensor  # noqa: E402
from dtensor_run import exact_grads  # noqa: E402
import large_runs_reference  # noqa: E402

D = 8  # model width
# Row layouts of the FULL matrices. The fused QKV has GQA-like heights (q 3, k 2, v 2 rows per head), so its blocks
# differ in shape and so in adjusted lr; W_q and W_k are separate (4 heads of 3 rows), W_q laid out as GQA's (2 key
# heads of 2 query heads: QK-clip scales its q rows by gamma) and W_k as multi-head attention's (by sqrt(gamma), the
# same maxima: a check of each rule, not one model); W_o is laid out only to have
# a laid-out matrix that TP cuts by columns (RowwiseParallel); each expert of the stack is a fused SwiGLU gate | up.
LAYOUTS = {"qkv.weight": large_runs.RowLayout((3, 2, 2), 2, ("q", "k", "v")),
           "wq.weight": large_runs.RowLayout((3, 3), 2, ("q", "q")),
           "wk.weight": large_runs.RowLayout((3,), 4, ("k",)),
           "wo.weight": large_runs.RowLayout((3, 2), 2, ("a", "b")),
           "experts": large_runs.RowLayout((3, 3), 1, ("gate", "up"))}
HEADS = {"qkv.weight": 2, "wq.weight": 4, "wk.weight": 4}  # the parameters QK-clip scales
TAU = 20.0
GROUPS = (dict(lr=0.02, weight_decay=0.1), dict(lr=0.03, weight_decay=0.05, adjust_lr_fn="spectral_unclamped"))
GROUP_OF = {"qkv.weight": 1, "wo.weight": 1}  # the others: group 0


def group_of(name):
    """Its param group: GROUP_OF's, or a sweep layer's index mod 2 (both groups on every kind of shape)."""
    return int(name.split(".")[1][1:]) % 2 if name.startswith("layers.") else GROUP_OF.get(name, 0)


COLWISE = ("qkv", "wq", "wk", "fc", "gate")
ROWWISE = ("wo", "proj")
STEPS = 2
SEED = 0


class Model(nn.Module):
    """Attention's matrices (fused QKV, separate W_q / W_k, W_o), an MLP (fc tall, proj wide: both cut on their
    long side by TP; gate wide, cut on its short side), and an expert stack (4 experts, each (6, D))."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        linear = lambda d_in, d_out: nn.Linear(d_in, d_out, bias=False)
        self.qkv, self.wq, self.wk, self.wo = linear(D, 14), linear(D, 12), linear(D, 12), linear(12, 10)
        self.fc, self.proj, self.gate = linear(D, 40), linear(40, D), linear(D, 6)
        self.experts = nn.Parameter(torch.randn(4, 6, D))


SWEEP = 24  # matrices of random shapes in a sweep model (tp_newton_schulz="gram" on many shapes and seeds)


class Sweep(nn.Module):
    """SWEEP matrices of random shapes (seeded), tall ones for ColwiseParallel and wide ones for RowwiseParallel: TP
    cuts every one along its long side, in pieces as uneven as torch.chunk makes them."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.layers = nn.ModuleDict()
        for i in range(SWEEP):
            m = int(torch.randint(2, 40, (1,), generator=g))
            n = int(torch.randint(m + 1, 3 * m + 9, (1,), generator=g))
            self.layers[f"l{i}"] = nn.Linear(m, n, bias=False) if i % 2 == 0 else nn.Linear(n, m, bias=False)


def model_of(case):
    return Sweep(case.sweep) if case.sweep >= 0 else Model()


def tp_plan(case):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if case.sweep >= 0:
        return {f"layers.l{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(SWEEP)}
    return {**{n: ColwiseParallel() for n in COLWISE}, **{n: RowwiseParallel() for n in ROWWISE}}


@dataclass(frozen=True)
class Case:
    mesh: tuple  # (replicate, dp, tp)
    ns_blocks: str = "whole"
    ns_coefficients: object = distributed_muon_cpu.NS_COEFFICIENTS
    clip: bool = False
    gram: bool = False
    bad: str = ""  # "clip": refused clip_qk_ calls between the steps; "layouts": rank 1 passes other row_layouts
    save: str = ""  # a checkpoint folder, written after step 1
    resume: str = ""  # a checkpoint folder, loaded before step 2
    sweep: int = -1  # >= 0: the Sweep model of this seed instead of Model
    low_rank: bool = False  # gradients of rank 2 plus a little noise (grads_of), as momenta often are

    @property
    def label(self):
        r, d, t = self.mesh
        return (f"{'hsdp ' if r > 1 else ''}{'x'.join(map(str, self.mesh if r > 1 else self.mesh[1:]))} "
                f"{self.ns_blocks} {'polar' if self.ns_coefficients == 'polar_express' else 'jordan'}"
                f"{' clip' if self.clip else ''}{' gram' if self.gram else ''}"
                f"{' ' + self.bad if self.bad else ''}{' resumed' if self.resume else ''}"
                f"{f' sweep {self.sweep}' if self.sweep >= 0 else ''}{' low rank' if self.low_rank else ''}")


@dataclass(frozen=True)
class Spawn:
    cases: tuple
    dp: int = 4
    tp: int = 1
    timeout_s: float = 120.0


def max_logits(rank, step):
    """What rank `rank` computed in step `step`: per head a logit max in [0, 40) (tau = 20: some clip, some not), or
    -inf where it computed none; the last head of each parameter is computed by no rank (S = -inf: no clip). At
    step 2 rank 1 leaves out the fused QKV and rank 2 W_q and W_k (a name left out: -inf for every head)."""
    out = {}
    for i, (name, heads) in enumerate(sorted(HEADS.items())):
        g = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
        values = torch.rand(heads, generator=g) * 40
        computed = torch.tensor([(h + rank) % 2 == 0 and h < heads - 1 for h in range(heads)])
        out[name] = torch.where(computed, values, torch.tensor(-math.inf))
    out["wk.weight"] = out["wq.weight"].clone()  # W_q and W_k: the same heads' logits
    left_out = {1: {"qkv.weight"}, 2: {"wq.weight", "wk.weight"}}.get(rank, set()) if step == 2 else set()
    return {n: s for n, s in out.items() if n not in left_out}


def global_max(step, world=4):
    return {n: torch.stack([max_logits(r, step).get(n, torch.full((heads,), -math.inf)) for r in range(world)]).amax(0)
            for n, heads in HEADS.items()}


def held_heads(rank_result, name):
    """The heads of `name` (a matrix of D columns) whose q or k rows this rank's local shard holds, any element."""
    heads = torch.tensor(LAYOUTS[name].qk_row_heads())[rank_result["where"][name] // D]
    return set(heads[heads >= 0].tolist())


def build(case, rank):
    """The model on the case's mesh, parallelized by torch (TP, then FSDP2 / HSDP), and its DTensorMuon."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = DeviceMesh("cpu", torch.arange(4).view(case.mesh), mesh_dim_names=("replicate", "dp", "tp"))
    model = model_of(case)
    parallelize_module(model, mesh["tp"], tp_plan(case))
    if case.sweep < 0:
        model.experts = nn.Parameter(distribute_tensor(model.experts.detach(), mesh["tp"], [Shard(0)],
                                                       src_data_rank=None))
    fully_shard(model, mesh=mesh["replicate", "dp"] if case.mesh[0] > 1 else mesh["dp"])
    named = dict(model.named_parameters())
    groups = [dict(options, params=[(n, p) for n, p in named.items() if group_of(n) == i])
              for i, options in enumerate(GROUPS)]
    layouts = dict(LAYOUTS) if case.ns_blocks != "whole" or case.clip else {}
    if case.bad == "layouts" and rank == 1:
        layouts["wo.weight"] = large_runs.RowLayout((2, 3), 2, ("a", "b"))
    opt = dtensor.DTensorMuon(groups, expert_stacks={"experts"} if case.sweep < 0 else (),
                         ns_coefficients=case.ns_coefficients,
                         row_layouts=layouts, ns_blocks=case.ns_blocks, qk_clip_tau=TAU if case.clip else None,
                         tp_newton_schulz="gram" if case.gram else "gather")
    return model, opt, named


def grads_of(case, shapes, step):
    """{name: total gradient} of a step, multiples of 2**-10: dtensor_run's exact gradients (full rank), or
    (case.low_rank) a rank-2 product rounded to 2**-10 plus them / 64 rounded (noise ~1/100 of the entries)."""
    grads = exact_grads(shapes, SEED, step)
    if not case.low_rank:
        return grads
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        g = torch.Generator().manual_seed(SEED * 7919 + step * 131 + i)
        product = torch.randn(*shape[:-1], 2, generator=g) @ torch.randn(*shape[:-2], 2, shape[-1], generator=g)
        out[name] = (torch.round(product * 2**8) + torch.round(grads[name] * 2**4)) * 2.0**-10
    return out


def give_grads(named, case, step):
    from torch.distributed.tensor import distribute_tensor

    for name, g in grads_of(case, {n: tuple(p.shape) for n, p in named.items()}, step).items():
        p = named[name]
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)


def snapshot(opt, named):
    return [dtensor.local_of(p).detach().clone() for p in named.values()] + \
        [dtensor.local_of(t).clone() for s in opt.state.values() for t in s.values()]


BAD_CLIPS = [  # (what, the rank that passes it or -1 for every rank, the max_logits it passes, tau set on it)
    ("unknown name", 3, lambda m: dict(m, **{"fc.weight": torch.zeros(4)}), None),
    ("wrong length", 0, lambda m: dict(m, **{"wq.weight": torch.zeros(3)}), None),
    ("NaN", 1, lambda m: dict(m, **{"qkv.weight": torch.tensor([1.0, math.nan])}), None),
    ("float64", -1, lambda m: dict(m, **{"qkv.weight": m["qkv.weight"].double()}), None),
    ("tau <= 0", 2, lambda m: m, 0.0),
]


def run_case(rank, case):
    """Every rank: build, STEPS steps (QK-clip after each if asked), with the case's refusals on the way."""
    out = dict(rank=rank, error="", refusals=[], scales=[])
    try:
        model, opt, named = build(case, rank)
    except ValueError as e:
        return dict(out, error=str(e))
    first = 1
    if case.resume:
        dtensor.load_checkpoint(case.resume, model, opt)
        first = 2
    for step in range(first, STEPS + 1):
        give_grads(named, case, step)
        opt.step()
        if case.clip:
            out["scales"].append(opt.clip_qk_(max_logits(rank, step)))
        if case.save and step == 1:
            dtensor.save_checkpoint(case.save, model, opt)
        if case.bad == "clip" and step == 1:
            for what, culprit, bad, tau in BAD_CLIPS:
                before, error = snapshot(opt, named), ""
                mine = culprit in (-1, rank)
                if mine and tau is not None:
                    opt.qk_clip_tau = tau
                try:
                    opt.clip_qk_(bad(max_logits(rank, step)) if mine else max_logits(rank, step))
                except ValueError as e:
                    error = str(e)
                opt.qk_clip_tau = TAU
                same = all(torch.equal(a, b) for a, b in zip(before, snapshot(opt, named)))
                out["refusals"].append(dict(what=what, error=error, unchanged=same))
    from torch.distributed.tensor import distribute_tensor

    where = {n: distribute_tensor(torch.arange(p.numel()).view(p.shape), p.device_mesh, p.placements,
                                       src_data_rank=None).to_local().reshape(-1) for n, p in named.items()}
    return dict(out, params={n: dtensor.local_of(p).detach().clone() for n, p in named.items()}, where=where,
                ledger=asdict(opt.ledger), owners=opt.owners,
                placements={n: str(tuple(p.placements)) for n, p in named.items()})


def run_cases(rank, spawn, device):
    torch.set_num_threads(1)
    results = []
    for case in spawn.cases:
        results.append(run_case(rank, case))
        dist.barrier()  # a checkpoint written by one case is read by the next: every rank done first
    return results


MESHES = [(1, 2, 2), (1, 4, 1), (1, 1, 4), (2, 1, 2)]
# (mesh, seed, low-rank gradients) of each sweep
SWEPT = [((1, 2, 2), 1, False), ((1, 1, 4), 2, False), ((1, 2, 2), 3, False), ((1, 1, 4), 4, False),
         ((1, 2, 2), 5, True), ((1, 1, 4), 6, True)]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """{label: (case, [each rank's result])}, from ONE spawn of 4 ranks."""
    saved = str(tmp_path_factory.mktemp("dcp") / "blocks_clip_step_1")
    cases = []
    for mesh in MESHES:
        cases += [Case(mesh, "blocks", clip=True), Case(mesh, "heads", "polar_express", clip=True),
                  Case(mesh, ns_coefficients="polar_express"), Case(mesh, gram=True)]
    cases += [Case((1, 2, 2), "blocks", clip=True, bad="clip"), Case((1, 2, 2), "blocks", bad="layouts"),
              Case((1, 2, 2), "blocks", clip=True, save=saved)]
    cases += [Case(mesh, "blocks", clip=True, resume=saved) for mesh in [(1, 4, 1), (1, 1, 4)]]
    cases += [Case(mesh, gram=True, sweep=seed, low_rank=low) for mesh, seed, low in SWEPT]
    results = muon_tools.spawn_ranks(Spawn(tuple(cases)), run_cases)
    runs = {}
    for i, case in enumerate(cases):
        label = case.label + (" saved" if case.save else "")
        runs[label] = (case, [r[i] for r in results])
    return runs


# -- the independent references ----------------------------------------------------------------------------------
def per_matrix(tensors):
    """{name: tensor} with the expert stack as one matrix per expert, "experts[e]" (each its own matrix, as
    DTensorMuon orthogonalizes it)."""
    out = {n: t for n, t in tensors.items() if n != "experts"}
    out.update({f"experts[{e}]": t for e, t in enumerate(tensors.get("experts", ()))})
    return out


def stacked(tensors):
    """per_matrix's inverse."""
    out = {n: t for n, t in tensors.items() if not n.startswith("experts[")}
    experts = [t for n, t in tensors.items() if n.startswith("experts[")]
    return dict(out, experts=torch.stack(experts)) if experts else out


def stack_of(name):
    return name.split("[")[0]


def reference(case):
    """{name: full tensor} after STEPS steps of the lesson helper's independent reference (tests/
    large_runs_reference.py: torch.optim.Muon on the blocks as separate parameters, its Newton-Schulz swapped for one
    with a triple per iteration, QK-clip from the equations with the global maxima), group by group (Muon steps
    each parameter alone), each expert of the stack its own matrix with the expert's layout."""
    torch.set_num_threads(1)
    full = {n: p.detach().clone() for n, p in model_of(case).named_parameters()}
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    grads = [per_matrix(grads_of(case, shapes, step)) for step in range(1, STEPS + 1)]
    out = {}
    for i, options in enumerate(GROUPS):
        names = [n for n in per_matrix(full) if group_of(stack_of(n)) == i]
        result, _ = large_runs_reference.reference_muon(
            {n: per_matrix(full)[n] for n in names}, [{n: g[n] for n in names} for g in grads],
            lr=options["lr"], weight_decay=options["weight_decay"], momentum=0.95,
            adjust_lr_fn=options.get("adjust_lr_fn", "original"),
            coefficients=(checks.ns_coefficients_of("polar_express", distributed_muon_cpu.NS_STEPS)
                          if case.ns_coefficients == "polar_express" else None),
            layouts={n: LAYOUTS[stack_of(n)] for n in names if stack_of(n) in LAYOUTS},
            per_head=None if case.ns_blocks == "whole" else case.ns_blocks == "heads",
            tau=TAU if case.clip else None,
            max_logits=[{n: S for n, S in global_max(step).items() if n in names} for step in range(1, STEPS + 1)])
        out.update(result)
    return stacked(out)


def torch_reference(case, record):
    """torch.optim.Muon itself, whole matrices, Jordan's coefficients (the tp_newton_schulz="gram" runs);
    record: a list to which each Newton-Schulz call appends (step, name, its input, its output)."""
    torch.set_num_threads(1)
    full = {n: p.detach().clone() for n, p in model_of(case).named_parameters()}
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    params = {n: nn.Parameter(t.clone()) for n, t in per_matrix(full).items()}
    order = [n for i in range(len(GROUPS)) for n in params if group_of(stack_of(n)) == i]
    opt = torch.optim.Muon([dict(options, params=[params[n] for n in order if group_of(stack_of(n)) == i])
                            for i, options in enumerate(GROUPS)])
    newton_schulz = torch.optim._muon._zeropower_via_newtonschulz

    def recorded(grad, *args):  # torch calls it group by group, parameter by parameter: `order`, every step
        out = newton_schulz(grad, *args)
        record.append((len(record) // len(order) + 1, order[len(record) % len(order)], grad.clone(), out))
        return out

    with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz", recorded):
        for step in range(1, STEPS + 1):
            for name, g in per_matrix(grads_of(case, shapes, step)).items():
                params[name].grad = g.clone()
            opt.step()
    return stacked({n: p.detach() for n, p in params.items()})


def differences(ranks, ref):
    """{name: largest |rank's element - reference's|} over every rank; every element held somewhere."""
    out = {}
    for name, whole in ref.items():
        seen = torch.zeros(whole.numel(), dtype=torch.bool)
        worst = 0.0
        for r in ranks:
            local, where = r["params"][name].reshape(-1), r["where"][name]
            seen[where] = True
            if local.numel():
                worst = max(worst, (local - whole.reshape(-1)[where]).abs().max().item())
        assert seen.all(), name
        out[name] = worst
    return out


def assert_identical(ranks, ref, label):
    diffs = differences(ranks, ref)
    assert {n: d for n, d in diffs.items() if d != 0} == {}, label


# -- the checks ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("ns_blocks,coefficients", [("blocks", distributed_muon_cpu.NS_COEFFICIENTS),
                                                    ("heads", "polar_express")])
def test_blocks_and_qk_clip_equal_torch_on_the_blocks_then_the_clip(runs, mesh, ns_blocks, coefficients):
    """Each block of rows orthogonalized alone with its own adjusted lr, wherever FSDP2 and TP cut it, then QK-clip
    with the maxima of every rank: torch.equal to torch.optim.Muon on the blocks as separate parameters, then the
    rows of each clipped head times sqrt(min(1, tau / S))."""
    case, ranks = runs[Case(mesh, ns_blocks, coefficients, clip=True).label]
    assert len(ranks) == 4 and all(r["error"] == "" for r in ranks)
    ref = reference(case)
    assert_identical(ranks, ref, case.label)
    # the check bites: blocks are not the whole matrix, and the clip changed something
    whole = reference(Case(mesh, ns_coefficients=coefficients, clip=True))
    assert not torch.equal(whole["qkv.weight"], ref["qkv.weight"]) and torch.equal(whole["fc.weight"], ref["fc.weight"])
    unclipped = reference(Case(mesh, ns_blocks, coefficients))
    assert not torch.equal(unclipped["wq.weight"], ref["wq.weight"])
    assert torch.equal(unclipped["wo.weight"], ref["wo.weight"])  # not laid out with q or k: never clipped
    # every rank returned the multipliers of the global maxima for the heads it holds (None for the others; every
    # head held somewhere), some heads clipped, some not
    for step, S in enumerate([global_max(1), global_max(2)]):
        gammas = {n: [min(1.0, TAU / s) if s > TAU else 1.0 for s in S[n].tolist()] for n in HEADS}
        expected = {n: g if LAYOUTS[n].shares_keys else [math.sqrt(x) for x in g] for n, g in gammas.items()}
        held = [{n: held_heads(r, n) for n in HEADS} for r in ranks]
        for r, mine in zip(ranks, held):
            large_runs_reference.assert_qk_multipliers(r["scales"][step], expected, mine)
        assert all(set().union(*(mine[n] for mine in held)) == set(range(h)) for n, h in HEADS.items())
        assert any(len(mine[n]) < h for mine in held for n, h in HEADS.items())  # the None pattern is exercised
        multipliers = [m for n in HEADS for m in expected[n]]
        assert any(m < 1 for m in multipliers) and any(m == 1 for m in multipliers)
    assert all(S[n][-1] == -math.inf for S in [global_max(1)] for n in HEADS)  # a head no rank computed
    # the data path: one MAX all-reduce per clip of every head's maximum (2 + 4 + 4) and the refusal flag, float32,
    # padded to 12 for 4 ranks: a ring sends and receives 2 x 3 x 12 / 4 elements, 72 bytes, on every rank
    for r in ranks:
        clips = [c for c in r["ledger"]["comm"] if c["phase"] == "QK-clip maxima"]
        assert [(c["step"], c["op"], c["dtype"], c["sent"], c["received"]) for c in clips] == \
            [(s, "all_reduce", "float32", 72, 72) for s in (1, 2)]


def test_blocks_differ_in_height_so_in_lr_and_the_meshes_cut_them_everywhere(runs):
    """What the blocks runs exercised: blocks of different heights in one matrix (different adjusted lr per run of
    rows), FSDP2's _StridedShard x TP's Shard(0), TP's Shard(1), HSDP's Replicate, expert parallel."""
    heights = {len(rows) for rows in large_runs_reference.block_rows(LAYOUTS["qkv.weight"], False)}
    assert heights == {6, 4}
    lrs = {distributed_muon_cpu.adjusted_lr(0.03, "spectral_unclamped", (h, D)) for h in heights}
    assert len(lrs) == 2
    p = runs[Case((1, 2, 2), "blocks", clip=True).label][1][0]["placements"]
    assert p["qkv.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert p["wo.weight"] == "(Shard(dim=0), Shard(dim=1))"
    hsdp = runs[Case((2, 1, 2), "blocks", clip=True).label][1][0]["placements"]
    assert hsdp["wq.weight"].startswith("(Replicate(), ")
    # a head's rows straddle the FSDP2 shards: 14 rows over 4 ranks (4, 4, 4, 2) against heads of 7 rows
    where = runs[Case((1, 4, 1), "blocks", clip=True).label][1][1]["where"]["qkv.weight"]
    rows = sorted({i // D for i in where.tolist()})
    assert rows == [4, 5, 6, 7]


@pytest.mark.parametrize("mesh", MESHES)
def test_polar_express_equals_a_per_iteration_newton_schulz_swapped_into_torch(runs, mesh):
    """ns_coefficients="polar_express" (one triple per iteration, the paper's Algorithm 1): torch.equal to
    torch.optim.Muon with its Newton-Schulz swapped for one with a triple per iteration (large_runs_reference)."""
    case, ranks = runs[Case(mesh, ns_coefficients="polar_express").label]
    ref = reference(case)
    assert_identical(ranks, ref, case.label)
    jordan = reference(Case(mesh))
    assert all(not torch.equal(jordan[n], ref[n]) for n in ref)  # the coefficients mattered everywhere
    triples = checks.ns_coefficients_of("polar_express", distributed_muon_cpu.NS_STEPS)
    assert len(set(triples)) == distributed_muon_cpu.NS_STEPS  # a different polynomial at every iteration


def test_refused_clips_raise_on_every_rank_and_change_nothing(runs):
    """A bad max_logits (or tau) on one rank, or on all: clip_qk_ raises on EVERY rank before any weight changes,
    and the run then goes on to torch's result (nothing was half applied, no rank left behind)."""
    case, ranks = runs[Case((1, 2, 2), "blocks", clip=True, bad="clip").label]
    said = {"unknown name": "max_logits names 'fc.weight', which QK-clip does not scale",
            "wrong length": "max_logits['wq.weight'] must be a float32 tensor of shape (4,) "
                            "(got torch.float32 of shape (3,))",
            "NaN": "max_logits['qkv.weight'] holds NaN or +inf",
            "float64": "max_logits['qkv.weight'] must be a float32 tensor of shape (2,) (got torch.float64",
            "tau <= 0": "qk_clip_tau must be a number > 0 and finite (got 0.0)"}
    assert not any(muon_tools.is_secondhand(s) for s in said.values())  # culprit_failure names the culprit, not the rest
    for i, (what, culprit, _, _) in enumerate(BAD_CLIPS):
        for r in ranks:
            refusal = r["refusals"][i]
            assert refusal["what"] == what and refusal["unchanged"] is True, (what, r["rank"])
            if culprit in (-1, r["rank"]):  # its own problem, its rank named
                assert refusal["error"].startswith(f"rank {r['rank']}: {said[what]}"), (what, refusal["error"])
            else:
                assert refusal["error"] == f"rank {culprit} refused clip_qk_ (it raised why); nothing changed", \
                    (what, r["rank"], refusal["error"])
                assert muon_tools.is_secondhand(refusal["error"])
    assert_identical(ranks, reference(Case((1, 2, 2), "blocks", clip=True)), case.label)


def test_row_layouts_that_differ_between_ranks_are_refused_on_every_rank(runs):
    case, ranks = runs[Case((1, 2, 2), "blocks", bad="layouts").label]
    message = ("row_layouts, ns_blocks, tp_newton_schulz or qk_clip_tau differ from rank 0's: "
               "every rank must pass the same")
    assert [r["error"] for r in ranks] == [f"rank 1: {message}", message, f"rank 1: {message}", f"rank 1: {message}"]


@pytest.mark.parametrize("mesh", [(1, 4, 1), (1, 1, 4)])
def test_checkpoint_with_blocks_and_qk_clip_resumes_on_another_mesh(runs, mesh):
    """Saved on 2x2 after step 1 (torch's recipe: dcp.save of get_model_state_dict / get_optimizer_state_dict), loaded
    on 4x1 or 1x4, step 2 and its clip: torch.equal to the uninterrupted reference."""
    case, ranks = next(v for v in runs.values() if v[0].resume and v[0].mesh == mesh)
    assert all(r["error"] == "" for r in ranks) and all(len(r["scales"]) == 1 for r in ranks)
    assert_identical(ranks, reference(Case(mesh, "blocks", clip=True)), case.label)


GRAM = {"qkv.weight", "wq.weight", "wk.weight", "wo.weight", "fc.weight", "proj.weight"}  # TP cuts the long side


def gram_bound(record, name, shape):
    """(The lesson's gram_tolerance of the Newton-Schulz inputs torch's step recorded for `name`, how far the
    update moved the weight: sum over steps of adjusted_lr x the largest entry of torch's O)."""
    group = GROUPS[group_of(name)]
    inputs = [x for _, n, x, _ in record if n == name]
    assert len(inputs) == STEPS
    lr, adjust = group["lr"], group.get("adjust_lr_fn", "original")
    moved = sum(out.float().abs().max().item() for _, n, _, out in record if n == name)
    return muon_tools.gram_tolerance(inputs, lr, adjust, shape), distributed_muon_cpu.adjusted_lr(lr, adjust, shape) * moved


@pytest.mark.parametrize("mesh", MESHES)
def test_gram_newton_schulz_on_tp_pieces_is_within_its_bound_and_the_rest_equals_torch(runs, mesh):
    """tp_newton_schulz="gram": every 2-D matrix that TP cuts along its long side (fc and W_q-like tall ones under
    ColwiseParallel, proj and W_o wide under RowwiseParallel) is orthogonalized in pieces, one all-reduce of the
    Gram matrix per iteration over one TP group; the others (gate: TP cuts its short side; the expert stack) keep
    the gather and stay torch.equal. On 4x1 there is no TP: everything torch.equal.

    The bound: the lesson's gram_tolerance (muon_tools/reference.py derives it and states its assumption), from the
    Newton-Schulz inputs torch's own step records here. `python tests/test_dtensor_large_runs.py 10` counts
    how many come out bit-identical."""
    case, ranks = runs[Case(mesh, gram=True).label]
    tp = mesh[2]
    record = []
    ref = torch_reference(case, record)
    pieces = {c["name"] for r in ranks for c in r["ledger"]["compute"] if "|tp" in c["name"]}
    assert {n.split("|")[0] for n in pieces} == (GRAM if tp > 1 else set())
    diffs = differences(ranks, ref)
    assert {n: d for n, d in diffs.items() if n not in GRAM and d != 0} == {}
    if tp == 1:
        assert all(d == 0 for d in diffs.values())
        return
    assert len(pieces) == tp * len(GRAM)
    for name in GRAM:
        bound, moved = gram_bound(record, name, tuple(ref[name].shape))
        assert diffs[name] <= bound, (name, diffs[name], bound)
        assert bound <= moved / 4, (name, bound, moved)  # the bound is a quarter of the update at most: it bites
    # what travelled: the pieces' owners are one TP group per matrix, and each spent ns_steps Gram all-reduces
    # of m x m float32 (m the short side) plus one for the norm; the gather moved less than the whole matrices
    owners = ranks[0]["owners"]
    for name in GRAM:  # the TP pieces' owners: the tp ranks of one row of the mesh (ranks tp * row + 0 .. tp - 1)
        group = [owners[f"{name}|tp{t}"] for t in range(tp)]
        assert [o % tp for o in group] == list(range(tp)) and len({o // tp for o in group}) == 1, (name, group)
    for r in ranks:
        mine = [n for n in GRAM if r["rank"] in {owners[f"{n}|tp{t}"] for t in range(tp)}]
        step_1 = [c for c in r["ledger"]["comm"] if c["step"] == 1]
        grams = [c["sent"] for c in step_1 if c["phase"] == "TP Gram"]
        assert all(c["op"] == "all_reduce" and c["dtype"] == "float32" for c in step_1 if "Gram" in c["phase"])
        assert sorted(grams) == sorted(2 * (tp - 1) * -(-min(ref[n].shape) ** 2 // tp) * 4 for n in mine
                                       for _ in range(distributed_muon_cpu.NS_STEPS))
        assert len([c for c in step_1 if c["phase"] == "TP Gram norm"]) == len(mine)
    whole = runs[Case(mesh, ns_coefficients="polar_express").label][1]  # the same matrices, gathered whole
    sent = lambda rs: sum(c["sent"] for r in rs for c in r["ledger"]["comm"]
                          if c["phase"] == "gather at owner" and c["step"] == 1)
    assert sent(ranks) < sent(whole)


@pytest.mark.parametrize("mesh,seed,low_rank", SWEPT)
def test_gram_on_many_shapes_and_seeds_is_within_its_bound(runs, mesh, seed, low_rank):
    """The same bound on SWEEP matrices of random shapes per seed (tall under ColwiseParallel, wide under
    RowwiseParallel, TP pieces as uneven as torch.chunk cuts them), FSDP2 x TP 2x2 and TP 4. With full-rank
    gradients the bound is a small part of the update (it bites); with gradients of rank 2 plus noise torch's own
    bf16 result is far from the float64 iteration, the bound with it, and the Gram path stays within it (where the
    bound no longer bites: no bound can that ignores torch's own error; tests/test_large_runs.py shows, on single
    Newton-Schulz calls, such inputs break the shape-only bound this one replaced)."""
    case, ranks = runs[Case(mesh, gram=True, sweep=seed, low_rank=low_rank).label]
    record = []
    ref = torch_reference(case, record)
    assert len(ref) == SWEEP
    pieces = {c["name"].split("|")[0] for r in ranks for c in r["ledger"]["compute"] if "|tp" in c["name"]}
    assert pieces == set(ref)  # every one in TP pieces
    diffs = differences(ranks, ref)
    for name, whole in ref.items():
        bound, moved = gram_bound(record, name, tuple(whole.shape))
        assert diffs[name] <= bound, (name, tuple(whole.shape), diffs[name], bound)
        assert low_rank or bound <= moved / 4, (name, bound, moved)


def shape_only_tolerance(name, shape):
    group = GROUPS[group_of(name)]
    return muon_tools.batched_ns_tolerance(STEPS, group["lr"], group.get("adjust_lr_fn", "original"), shape,
                                   large_runs_reference.shape_only_gram_bound(shape))


def test_bad_options_are_refused_at_construction_in_one_line():
    """Every option of issue 20 checked before anything is planned (here one process, plain tensors; on a group the
    problem is swapped with the descriptions, so every rank raises it: the "layouts" run above)."""
    w, v = nn.Parameter(torch.randn(14, D)), nn.Parameter(torch.randn(2, 6, D))
    explicit = dtensor.DistributedConfig(gather=lambda u, o: u, redistribute=lambda o, w: o,
                                    global_shapes={"w": (14, D), "v": (6, D)})
    qkv = LAYOUTS["qkv.weight"]
    refused = [(dict(ns_blocks="rows"), "ns_blocks must be one of whole, blocks, heads (got 'rows')"),
               (dict(tp_newton_schulz="ring"), "tp_newton_schulz must be one of gather, gram (got 'ring')"),
               *[(dict(qk_clip_tau=tau, row_layouts={"w": qkv}),
                  f"qk_clip_tau must be a number > 0 and finite (got {tau!r})")
                 for tau in (0.0, -1.0, math.nan, math.inf, True, "20")],
               (dict(row_layouts={"x": qkv}), "row_layouts names no Muon parameter: x"),
               (dict(row_layouts={"w": large_runs.RowLayout((3, 2, 2), 3, ("q", "k", "v"))}),
                "row_layouts['w'] has 3 x 7 = 21 rows; the matrix has 14"),
               (dict(row_layouts={"v": large_runs.RowLayout((3, 2), 1)}),
                "row_layouts['v'] has 1 x 5 = 5 rows; the matrix of each expert has 6"),
               (dict(row_layouts={"w": (3, 2, 2)}),
                "row_layouts['w'] must be a RowLayout (distmuon.RowLayout), got tuple"),
               (dict(row_layouts={"w": large_runs.RowLayout((3, 2, 2), 2, ("q", "k"))}),
                "row_layouts['w']: 2 names for 3 sizes"),
               (dict(row_layouts={"w": large_runs.RowLayout((7, 0), 2)}),
                "row_layouts['w']: sizes must be positive integers"),
               (dict(ns_blocks="blocks"), "ns_blocks='blocks' needs row_layouts (which rows make which block)"),
               (dict(qk_clip_tau=1.0, row_layouts={"w": large_runs.RowLayout((7,), 2, ("a",))}),
                "qk_clip_tau needs row_layouts with segments named q or k (the rows it scales)"),
               (dict(qk_clip_tau=1.0, row_layouts={"w": qkv, "v": large_runs.RowLayout((3, 3), 1, ("q", "k"))}),
                "row_layouts['v']: QK-clip scales attention heads, not the experts of an expert stack"),
               *[(dict(option, distributed_config=explicit),
                  "row_layouts, qk_clip_tau and tp_newton_schulz='gram' need the automatic distributed_config")
                 for option in (dict(row_layouts={"w": qkv}), dict(tp_newton_schulz="gram"))]]
    for options, message in refused:
        stacks = {"v"} if "distributed_config" not in options else ()
        params = [("w", w), ("v", v)] if stacks else [("w", w)]
        with pytest.raises(ValueError) as raised:
            dtensor.DTensorMuon([dict(params=params)], expert_stacks=stacks, **options)
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value), (options, str(raised.value))
    opt = dtensor.DTensorMuon([dict(params=[("w", w)])], row_layouts={"w": qkv}, ns_blocks="heads")
    with pytest.raises(ValueError,
                       match=r"^rank 0: QK-clip is off: construct the optimizer with qk_clip_tau \(and row_"):
        opt.clip_qk_({})


def measure(seeds):
    """The Gram sweep's figures on `seeds` seeds per mesh (one spawn): difference / bound, bound / update, and
    difference / the shape-only bound gram_tolerance replaced."""
    cases = [Case(mesh, gram=True, sweep=seed, low_rank=low) for seed in range(1, seeds + 1)
             for mesh in [(1, 2, 2), (1, 1, 4)] for low in (False, True)]
    results = muon_tools.spawn_ranks(Spawn(tuple(cases)), run_cases)
    rows = {}
    for i, case in enumerate(cases):
        record = []
        ref = torch_reference(case, record)
        diffs = differences([r[i] for r in results], ref)
        for name, whole in ref.items():
            bound, moved = gram_bound(record, name, tuple(whole.shape))
            rows.setdefault((case.mesh, case.low_rank), []).append(
                (diffs[name] / bound, bound / moved, diffs[name] / moved,
                 diffs[name] / shape_only_tolerance(name, tuple(whole.shape))))
    table = [[f"{'x'.join(map(str, mesh[1:]))}", "rank 2 + noise" if low else "full rank", len(r),
              sum(x[0] == 0 for x in r), f"{max(x[0] for x in r):.3f}",
              f"{sorted(x[0] for x in r)[len(r) // 2]:.3f}", f"{max(x[1] for x in r):.3f}",
              f"2**{math.log2(max(x[2] for x in r)):.2f}", f"{max(x[3] for x in r):.2f}"]
             for (mesh, low), r in rows.items()]
    print(muon_tools.format_table(["mesh", "gradients", "matrices", "torch.equal", "max diff/bound",
                                   "median diff/bound",
                           "max bound/update", "max diff/update", "max diff/shape-only bound"], table,
                          ["<", "<", ">", ">", ">", ">", ">", ">", ">"]))


if __name__ == "__main__":  # python tests/test_dtensor_large_runs.py [seeds]: the Gram sweep's figures
    import sys

    measure(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
