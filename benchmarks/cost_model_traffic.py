"""The cost model's traffic and its price (benchmarks/cost_model.py): per phase and per rank, what the Ledger would
record for a plan, and its alpha-beta price on a cluster's links, beside the compute at the cluster's rates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import distributed_muon_cpu
from distmuon import large_runs
from distmuon.dtensor import plan
from distmuon import owners
from distmuon.checks import ORTHOGONALIZED
from distmuon.dtensor.normuon import v_holders
from cost_model_plans import dtensor_plan, dtensor_transfers, state_and_elements, virtual_grid

BF16, FP32, U8 = torch.bfloat16, torch.float32, torch.uint8


# =============================================================================
# 4. Traffic, and its price
# =============================================================================
# Traffic keeps, per phase and per rank, what the Ledger would record (bytes sent and received: a ring's
# count for all-gather and reduce-scatter, 2 (n - 1) ceil(k / n) for an all-reduce, exact counts for an
# all-to-all), and for its price the bytes and messages on each kind of link. Rings: every step pays the
# slowest link of the ring (inter-node if the group spans nodes). All-to-all: each peer a message, each
# byte on the link to its peer's node. A rank's time in a phase is the larger of its intra- and inter-node
# times (the links work at once), alpha x messages + the larger of bytes sent and received / beta; the
# phase lasts as long as its slowest rank (a collective waits for everyone).

@dataclass
class PhaseTraffic:
    axes: set
    dtypes: set
    sent: list
    received: list
    link: dict  # "intra" / "inter": [sent, received, messages] per rank
    op: str = ""  # the collective, as the Ledger names it: all_gather, reduce_scatter, all_reduce, all_to_all
    calls: list = None  # collective calls per rank

    def terms(self, rank, cluster):
        """(latency, bandwidth, calls) seconds of one rank in this phase: on each kind of link, alpha x messages +
        the larger of bytes sent and received / beta (the op's own beta where the cluster measured one), the links
        working at once (the slower counts); and the fixed cost of each collective call (Cluster.call_us)."""
        gbs_of = dict(cluster.op_gbs)
        best = (0.0, 0.0)
        for kind, (gbs, us) in {"intra": (cluster.intra_gbs, cluster.intra_us),
                                "inter": (cluster.inter_gbs, cluster.inter_us)}.items():
            sent, received, messages = (x[rank] for x in self.link[kind])
            here = (messages * us * 1e-6, max(sent, received) / (gbs_of.get(self.op, gbs) * 1e9))
            best = max(best, here, key=sum)
        return best + (self.calls[rank] * cluster.call_s(self.op),)

    def seconds(self, rank, cluster):
        return sum(self.terms(rank, cluster))

    def cpu_seconds(self, rank, cluster):
        """The CPU one rank's calls of this phase take (Cluster.cpu_call_us and cpu_gbs; 0 where none measured)."""
        gbs = dict(cluster.cpu_gbs).get(self.op)
        return (self.calls[rank] * dict(cluster.cpu_call_us).get(self.op, 0.0) * 1e-6
                + (max(self.sent[rank], self.received[rank]) / (gbs * 1e9) if gbs else 0.0))


class Traffic:
    def __init__(self, world, node_of):
        self.world, self.node_of, self.phases = world, node_of, {}

    def _phase(self, phase, axis, dtype, op):
        if phase not in self.phases:
            zeros = lambda: [0] * self.world  # noqa: E731
            self.phases[phase] = PhaseTraffic(set(), set(), zeros(), zeros(),
                                              {k: [zeros(), zeros(), zeros()] for k in ("intra", "inter")}, op, zeros())
        t = self.phases[phase]
        assert t.op == op, (phase, t.op, op)  # a phase is one collective
        t.axes.add(axis)
        t.dtypes.add(str(dtype).replace("torch.", ""))
        return t

    def ring(self, phase, axis, dtype, groups, piece_numel, hops, messages=None, op="all_gather"):
        """Each group in `groups` (lists of ranks, size n > 1) runs a ring of `hops` steps of piece_numel, paying
        the latency of `messages` steps (default: hops): one call of `op` on each of its ranks."""
        for group in groups:
            t = self._phase(phase, axis, dtype, op)
            sent, received, count = t.link["inter" if len({self.node_of(r) for r in group}) > 1 else "intra"]
            nbytes = hops * piece_numel * dtype.itemsize
            for r in group:
                for column in (t.sent, t.received, sent, received):
                    column[r] += nbytes
                count[r] += hops if messages is None else messages
                t.calls[r] += 1

    def all_gather(self, phase, axis, dtype, groups, shard_numel):
        """A ring all-gather of shard_numel from each rank of each group: (n - 1) shards out and in."""
        self.ring(phase, axis, dtype, groups, shard_numel, len(groups[0]) - 1)

    def reduce_scatter(self, phase, axis, dtype, groups, shard_numel):
        """A ring reduce-scatter of n shards moves what the all-gather of one does."""
        self.ring(phase, axis, dtype, groups, shard_numel, len(groups[0]) - 1, op="reduce_scatter")

    def all_reduce(self, phase, axis, dtype, groups, numel):
        """The Ledger's ring count of bytes; the latency of the ring's 2 (n - 1) steps or of a tree's 2 log2 n,
        whichever is fewer (NCCL picks a tree for small messages on many ranks: the grad-presence vote)."""
        n = len(groups[0])
        self.ring(phase, axis, dtype, groups, -(-numel // n), 2 * (n - 1), min(2 * (n - 1), 2 * math.ceil(math.log2(n))),
                  op="all_reduce")

    def all_to_all(self, phase, axis, dtype, sources, destinations, numels, members=None):
        """One all-to-all: elements numels[i] from sources[i] to destinations[i] (lists of equal length); a rank's
        parts to itself move nothing. Every rank of `members` (default: all) takes part, one call each (the Ledger
        records its zeros too)."""
        t = self._phase(phase, axis, dtype, "all_to_all")
        for r in range(self.world) if members is None else members:
            t.calls[r] += 1
        src, dst, num = (torch.as_tensor(x, dtype=torch.int64) for x in (sources, destinations, numels))
        keep = (src != dst) & (num > 0)
        src, dst, nbytes = src[keep], dst[keep], num[keep] * dtype.itemsize
        node = torch.tensor([self.node_of(r) for r in range(self.world)])
        inter = node[src] != node[dst]
        per_rank = lambda index, values: torch.zeros(self.world, dtype=torch.int64).index_add_(0, index, values)  # noqa: E731
        for name, mask in (("intra", ~inter), ("inter", inter)):
            sent, received = per_rank(src[mask], nbytes[mask]), per_rank(dst[mask], nbytes[mask])
            pairs = torch.unique(src[mask] * self.world + dst[mask])  # one message per pair of ranks
            ones = torch.ones_like(pairs)
            messages = torch.maximum(per_rank(pairs // self.world, ones), per_rank(pairs % self.world, ones))
            for r, (s, rc, m) in enumerate(zip(sent.tolist(), received.tolist(), messages.tolist())):
                t.sent[r] += s
                t.received[r] += rc
                t.link[name][0][r] += s
                t.link[name][1][r] += rc
                t.link[name][2][r] += m

    def calls_table(self, phases=None):
        """{phase: collective calls per rank} (phases: that order)."""
        return {p: list(self.phases[p].calls) if p in self.phases else [0] * self.world
                for p in phases or self.phases}

    def table(self, phases=None):
        """{phase: {"axis", "dtype", "sent", "received"}}: muon_tools.bytes_per_step's form (phases: that order)."""
        out = {}
        for phase in phases or self.phases:
            t = self.phases.get(phase)
            out[phase] = (dict(axis="/".join(sorted(t.axes)), dtype="/".join(sorted(t.dtypes)), sent=list(t.sent),
                               received=list(t.received)) if t else
                          dict(axis="-", dtype="-", sent=[0] * self.world, received=[0] * self.world))
        return out


@dataclass
class Cost:
    """What one step of one optimizer does, per rank (lists indexed by global rank)."""
    label: str
    traffic: Traffic
    ns_flops: list
    state_bytes: list
    elements: dict  # "muon" / "adamw": elementwise elements per rank
    world: int
    single_device_flops: int = 0
    calls: dict = field(default_factory=dict)  # per rank: "ns" (Newton-Schulz calls), "muon" / "adamw" (parts
    # stepped), "apply" (comm-free: updates applied to whole matrices another row orthogonalized), "params"
    # (parameters the step walks; set where it is priced: --check-here)

    def comm_terms(self, cluster):
        """{"latency", "bandwidth", "calls": seconds} of the communication: every phase at its slowest rank, the
        phases one after another."""
        out = dict.fromkeys(("latency", "bandwidth", "calls"), 0.0)
        for t in self.traffic.phases.values():
            slowest = max(range(self.world), key=lambda r: t.seconds(r, cluster))
            for key, value in zip(out, t.terms(slowest, cluster)):
                out[key] += value
        return out

    def compute_terms(self, rank, cluster):
        """{term: seconds} of one rank's compute: Newton-Schulz's FLOPs at the bf16 rate and its calls, the
        elementwise bytes at the memory bandwidth, the fixed cost of each part stepped and the step's bookkeeping
        per parameter (Cluster's per-call costs; 0 on a cluster that measured none). Newton-Schulz runs as it does
        when every rank runs it at once (Cluster.ns_shared): in the lesson's stage 3 they do."""
        calls = {k: v[rank] for k, v in self.calls.items()}
        return {"NS FLOPs": self.ns_flops[rank] / (cluster.ns_tflops * 1e12) * cluster.ns_shared,
                "NS calls": calls.get("ns", 0) * cluster.ns_call_us * 1e-6 * cluster.ns_shared,
                "elementwise": (self.elements["muon"][rank] * cluster.muon_bytes
                                + self.elements["adamw"][rank] * cluster.adamw_bytes) / (cluster.hbm_gbs * 1e9),
                "parts": (calls.get("muon", 0) * cluster.muon_part_us + calls.get("adamw", 0) * cluster.adamw_part_us
                          + calls.get("apply", 0) * cluster.apply_us) * 1e-6,
                "bookkeeping": calls.get("params", 0) * cluster.param_us * 1e-6}

    def compute_seconds(self, cluster):
        """Per rank: the sum of its compute_terms."""
        return [sum(self.compute_terms(r, cluster).values()) for r in range(self.world)]


# 4a. The lesson's step, phase by phase, from the optimizer's own plan (sections 5 and 6 of the lesson).

# The calls that move or orthogonalize a strategy's data: the model prices them as the lesson's classes run them.
DATA_PATH = ("bucketed", "part_of", "units", "stages", "orthogonalize", "newton_schulz", "scatter", "normalized",
             "reduce_chunk", "broadcast_chunk")


def unpriced(strategy):
    """Why the model cannot price this strategy's step (one line), or None: it prices the gather flow (the lesson's
    middle, or large runs'), the owner's exchanges and comm-free's, each as the lesson's class runs it; a strategy
    that runs its data another way (a call of DATA_PATH, or the gather flow's middle, of its own) would be priced
    as its base, wrongly."""
    inner = getattr(strategy, "strategy", strategy)  # large runs wrap it (large_runs.WithLargeRuns)
    base = next(c for c in (owners.CommFree, owners.Owner, distributed_muon_cpu.Gather, object) if isinstance(inner, c))
    own = [n for n in DATA_PATH if hasattr(base, n) and getattr(type(inner), n) is not getattr(base, n)]
    middle = getattr(inner, "middle", None)
    if middle is not None and middle is not distributed_muon_cpu.orthogonalize_tp_local and \
            getattr(middle, "__func__", None) is not large_runs.LargeRuns.middle:
        own.append("middle")
    if base is object or own:
        why = f"its own {', '.join(own)}" if own else "no base the model knows"
        return (f"the cost model prices the gather flow, the owner's exchanges and comm-free's; strategy "
                f"{inner.name!r} has {why}: price it by its own branch here")
    return None


def lesson_cost(opt, node_of, label=None):
    why = unpriced(opt.strategy)
    if why:
        raise ValueError(why)
    grid, layout = opt.grid, opt.layout
    dp, tp = grid.dp.size, grid.tp.size
    world = dp * tp
    traffic = Traffic(world, node_of)
    dp_groups = [[d * tp + t for d in range(dp)] for t in range(tp)]
    tp_groups = [[d * tp + t for t in range(tp)] for d in range(dp)]
    flops, ns_calls = [0] * world, [0] * world
    if world > 1:
        # one byte a parameter, and one for the vote that refuses the step (section 5)
        traffic.all_reduce("grad presence", "world", U8, [list(range(world))], len(opt.param_by_name) + 1)
    for b in layout.buckets if dp > 1 else ():  # stage 1: ZeRO-1's reduce-scatter, bucket by bucket
        traffic.reduce_scatter("grad reduce-scatter", "DP", FP32, dp_groups, b.numel // dp)
    strategy = opt.strategy
    comm_free = isinstance(strategy, owners.CommFree)  # priced by what each strategy is, not by its name
    if not strategy.orthogonalizes_once:  # the gather flow: every rank that touches a matrix orthogonalizes it
        gram = opt.large_runs.gram if opt.large_runs is not None else set()
        for b in layout.buckets:
            group = opt.param_groups[b.buffer_idx]
            if group["algorithm"] != "muon":
                continue
            if dp > 1:
                traffic.all_gather("DP gather", "DP", BF16, dp_groups, b.numel // dp)
            for d in range(dp):  # each TP row orthogonalizes every matrix its DP shard touches
                for name in (n for n in b.names if layout.metas[d][n].local_numel):
                    shape, steps = layout.global_shapes[name], group["ns_steps"]
                    if name in gram:
                        traffic.all_reduce("TP Gram norm", "TP", FP32, [tp_groups[d]], 1)
                        for _ in range(steps):
                            traffic.all_reduce("TP Gram", "TP", FP32, [tp_groups[d]], min(shape) ** 2)
                        work = large_runs.newton_schulz_tp_flops(shape, tp, steps)
                    else:
                        if layout.tp_split_dims[name] >= 0 and tp > 1:
                            traffic.all_gather("TP gather", "TP", BF16, [tp_groups[d]], math.prod(layout.shapes[name]))
                        work = distributed_muon_cpu.newton_schulz_flops(shape, steps)
                    for r in tp_groups[d]:
                        flops[r] += work
                        ns_calls[r] += 1
    else:
        for name, owner in opt.owners.items():
            flops[owner] += strategy.ns_flops[name]
            ns_calls[owner] += 1
        if not comm_free and world > 1:
            for unit in strategy.units(opt):  # stage 3, unit by unit (a unit without a matrix moves nothing)
                exchange_at_owners(traffic, [r for r in strategy.routes if r.name in unit.names], "world",
                                   lambda i: i, opt)
        if comm_free:
            comm_free_cost(opt, traffic, dp, tp)
    for b in layout.buckets if dp > 1 else ():  # stage 4: the parameter all-gather
        traffic.all_gather("param all-gather", "DP", FP32, dp_groups, b.numel // dp)
    state, elements, calls = lesson_state(opt, dp, tp)
    single = sum(strategy.ns_flops.values()) if getattr(strategy, "ns_flops", None) else sum(
        distributed_muon_cpu.newton_schulz_flops(layout.global_shapes[n],
                                                 opt.group_of[n]["ns_steps"]) for n in opt.muon_names)
    return Cost(label or strategy.name, traffic, flops, state, elements, world, single, dict(calls, ns=ns_calls))


def exchange_at_owners(traffic, routes, axis, global_rank, opt, members=None):
    """gather at owner and scatter from owner, one all-to-all each (distmuon/owners.py: gather_at_owner, scatter_from_owner):
    every route's senders to its owner, the owner back to every holder; and NorMuon's rows beside the scatter
    (section 7.4b: v and g, full rows + 1 float32, from the owner to every other holder of a part), where some
    route is NorMuon's. global_rank: axis index -> rank; members: the ranks of the axis (default: all)."""
    if not routes:
        return
    g = global_rank
    traffic.all_to_all("gather at owner", axis, BF16, *columns((g(p.rank), g(r.owner), p.stop - p.start)
                                                              for r in routes for p in r.senders), members)
    traffic.all_to_all("scatter from owner", axis, BF16, *columns((g(r.owner), g(p.rank), p.stop - p.start)
                                                                 for r in routes for p in r.holders), members)
    normuon = [r for r in routes if opt.group_of[r.name]["algorithm"] == "normuon"]
    if normuon:
        traffic.all_to_all("NorMuon rows", axis, FP32, *columns((g(r.owner), g(p.rank), owners.full_rows(r) + 1)
                                                               for r in normuon for p in r.holders), members)


def columns(transfers):
    """(sources, destinations, elements) of an iterable of (source, destination, elements)."""
    rows = list(transfers)
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def comm_free_cost(opt, traffic, dp, tp):
    """comm-free's extra phases: per chunk, the gradient reduced at the owner row and the update broadcast from
    it over DP (distmuon/owners.py: reduce_at_owner, broadcast_from_owner); the TP exchange inside each owner row."""
    numel = {n: math.prod(opt.layout.shapes[n]) for n in opt.muon_names}
    row = {n: o // tp for n, o in opt.owners.items()}
    rows = {n: opt.layout.global_shapes[n][0] + 1 for n in opt.muon_names if opt.group_of[n]["algorithm"] == "normuon"}
    for chunk in opt.strategy.chunks if dp > 1 else ():
        traffic.all_to_all("grad reduce at owner", "DP", FP32, *columns(
            (d * tp + t, row[n] * tp + t, numel[n]) for n in chunk for d in range(dp) for t in range(tp)))
        traffic.all_to_all("update broadcast from owner", "DP", BF16, *columns(
            (row[n] * tp + t, d * tp + t, numel[n]) for n in chunk for d in range(dp) for t in range(tp)))
        if any(n in rows for n in chunk):  # NorMuon's v and g, to the other DP rows beside the update (7.5)
            traffic.all_to_all("NorMuon rows broadcast", "DP", FP32, *columns(
                (row[n] * tp + t, d * tp + t,
                 rows[n]) for n in chunk if n in rows for d in range(dp) for t in range(tp)))
    for d in range(dp) if tp > 1 else ():
        grid = virtual_grid(dp, tp, d * tp)
        routes = owners.plan_routes(opt.muon_names, opt.owners, lambda n, d: opt.strategy.part_of(opt, n, d),
                                    opt.layout,
                                grid, grid.tp)
        for unit in opt.strategy.units(opt):  # inside row d's TP group, unit by unit
            exchange_at_owners(traffic, [r for r in routes if r.name in unit.names], "TP", lambda i, d=d: d * tp + i,
                               opt, [d * tp + t for t in range(tp)])


def lesson_state(opt, dp, tp):
    """(state bytes, elementwise elements, parts stepped: per rank): each rank's part of every parameter (part_of):
    Muon's momentum (fp32); AdamW's two moments and its step (a 4-byte tensor) where the part is not empty;
    NorMuon's v at the owner (one float32 per row of the full matrix, section 7.4b). comm-free's ranks also apply
    the other rows' updates to their whole copies of the matrices."""
    world = dp * tp
    state, elements = [0] * world, {"muon": [0] * world, "adamw": [0] * world}
    calls = {k: [0] * world for k in ("muon", "adamw", "apply")}
    for name, group in opt.group_of.items():
        kind = "muon" if group["algorithm"] in ORTHOGONALIZED else "adamw"
        whole = math.prod(opt.layout.shapes[name])
        for d in range(dp):
            part = opt.strategy.part_of(opt, name, d)
            n = part.stop - part.start
            for r in range(d * tp, (d + 1) * tp):
                state[r] += 4 * n if kind == "muon" else (8 * n + 4 if n else 0)
                elements[kind][r] += whole if isinstance(opt.strategy, owners.CommFree) and kind == "muon" else n
                if n:
                    calls[kind][r] += 1
                elif isinstance(opt.strategy,
                                owners.CommFree) and kind == "muon":  # the owner row's update, applied here
                    calls["apply"][r] += 1
        if group["algorithm"] == "normuon":
            state[opt.owners[name]] += 4 * opt.layout.global_shapes[name][0]
    return state, elements, calls


# 4b. DTensorMuon's step (distmuon/dtensor/, section 5): the grad-presence vote over its group, one
# gather at owner and one scatter from owner (all-to-all over the world), Newton-Schulz on the owners.

def dtensor_cost(copies, param_names, group_algorithms, group_ns_steps, world, node_of, label="DTensorMuon",
                 exchange_bytes=None):
    """copies: in DTensorMuon's planning order (placed_copies); param_names: every name its ranks vote on;
    group_algorithms / group_ns_steps: {group index: "muon" | "adamw"} / {group index: ns_steps}; exchange_bytes:
    DTensorMuon's, the exchanges per group of parameters (plan.exchange_groups) instead of one each way."""
    traffic = Traffic(world, node_of)
    if world > 1:
        traffic.all_reduce("grad presence", "world", U8, [list(range(world))], len(set(param_names)) + 1)
    muon = [c for c in copies if group_algorithms[c.group] in ORTHOGONALIZED]
    matrices, ns_flops, owner_of = dtensor_plan(muon, group_ns_steps, world)
    if world > 1:
        for group in grouped(matrices, exchange_bytes):
            exchange_group(traffic, group, group_algorithms)
    flops, ns_calls = [0] * world, [0] * world
    for name, owner in owner_of.items():
        flops[owner] += ns_flops[name]
        ns_calls[owner] += 1
    flops = add_local_matrices(flops, muon, group_ns_steps, ns_calls)
    state, elements = state_and_elements(copies, lambda c: group_algorithms[c.group], world)
    return Cost(label, traffic, flops, state, elements, world, sum(ns_flops.values()), dict(ns=ns_calls))


def exchange_group(traffic, group, group_algorithms):
    """One group's exchanges (distmuon/dtensor/exchange.py): its gather at owner and scatter from owner, one
    all-to-all each over the world, and NorMuon's rows where the group has NorMuon's matrices."""
    gather, scatter = dtensor_transfers(group)
    traffic.all_to_all("gather at owner", "world", BF16, *gather)
    traffic.all_to_all("scatter from owner", "world", BF16, *scatter)
    normuon = [m for m in group if group_algorithms[m.copy.group] == "normuon"]
    if normuon:
        traffic.all_to_all("NorMuon rows", "world", FP32, *columns(normuon_rows(normuon)))


def grouped(matrices, exchange_bytes):
    """The plan's matrices in DTensorMuon's groups (plan.exchange_groups); one group of all of them without
    exchange_bytes."""
    if exchange_bytes is None:
        return [matrices]
    return [[m for m in matrices if m.copy.name in names] for names in plan.exchange_groups(matrices, exchange_bytes)]


def normuon_rows(matrices):
    """(owner, receiver, rows + 1) of NorMuon's rows exchange (distmuon/dtensor/normuon.py, NorMuonRows): v and g of
    each distributed matrix, from its owner to every rank of its copy's mesh that holds its v (v_holders)."""
    for m in matrices:
        yield from ((m.owner, r, m.copy.matrix_shape[0] + 1) for r in v_holders(m.copy, max(m.expert, 0)).tolist())


def add_local_matrices(flops, muon_copies, group_ns_steps, ns_calls):
    """Plain and all-Replicate copies: orthogonalized where they are, on every holder (no exchange)."""
    for c in muon_copies:
        if c.local:
            work = c.n_matrices * distributed_muon_cpu.newton_schulz_flops(c.matrix_shape, group_ns_steps[c.group])
            for r in c.mesh_ranks or range(len(flops)):
                flops[r] += work
                ns_calls[r] += c.n_matrices
    return flops


def adamw_fsdp2_cost(copies, world, node_of):
    """torch's AdamW on FSDP2's shards: elementwise on each local shard, no collective in its step."""
    state, elements = state_and_elements(copies, lambda c: "adamw", world)
    return Cost("AdamW, FSDP2", Traffic(world, node_of), [0] * world, state, elements, world)
