"""The cost model's DTensorMuon step by groups, pipelined (benchmarks/cost_model.py --overlap): its exchange_bytes
groups as the library forms them, each group's exchanges priced on the cluster's links, each rank's Newton-Schulz
at the cluster's rate, and overlap=K's schedule as a pipeline recurrence (notes/12-cost-model.md, "DTensorMuon's
step by groups, overlapped")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from distmuon import owners
from distmuon.dtensor import plan
import muon_tools
from distmuon.checks import ORTHOGONALIZED
from cost_model_inputs import H100, MODELS
from cost_model_plans import dtensor_plan
from cost_model_predict import (DTENSOR_STEPS, Scenario, dtensor_algorithms, dtensor_copies, node_map)
from cost_model_tables import ms, scenario_title
from cost_model_traffic import Cost, Traffic, add_local_matrices, dtensor_cost, exchange_group, grouped


# =============================================================================
# 9. DTensorMuon's step by groups, overlapped
# =============================================================================
# The step (distmuon/dtensor/optimizer.py, _grouped_muon_steps) runs the Muon matrices in groups (exchange_bytes);
# with overlap=K the loop's iteration j starts group j's gather, then runs group j-K's Newton-Schulz and starts its
# way back (NorMuon's rows, then the scatter). So the collectives go out in the order g0 .. gK, b0, gK+1, b1, gK+2,
# b2, ..., and every rank's Newton-Schulz runs the groups in order. The model: one collective at a time, in that
# order (a rank's process group runs them in turn), each as long as its slowest rank; a group's Newton-Schulz on a
# rank starts once its gather has arrived and that rank's previous group is done; a group's way back starts once
# every rank's Newton-Schulz of it is done and the collective before it is over.

def link_order(groups, k):
    """[("gather" | "back", group)]: the order the step issues its collectives in with overlap=k."""
    order = [("gather", j) for j in range(min(k + 1, groups))]
    for i in range(groups):
        order.append(("back", i))
        if i + k + 1 < groups:
            order.append(("gather", i + k + 1))
    return order


@dataclass
class Schedule:
    """When each group's gather, Newton-Schulz (its last rank's) and way back end, in seconds from the first gather;
    total: the last collective's end."""
    gather_end: list
    ns_end: list
    back_end: list
    total: float


def pipeline(gather, compute, back, k):
    """The schedule of groups whose gather takes gather[i] seconds, whose Newton-Schulz takes compute[i][r] on rank
    r, and whose way back takes back[i], with k groups' gathers in flight (link_order):
        a collective starts when the one before it is over and, for a way back, when every rank's Newton-Schulz of
        its group is over;  rank r's Newton-Schulz of group i: NS[r, i] = max(G[i], NS[r, i - 1]) + compute[i][r]."""
    n = len(gather)
    if not n:
        return Schedule([], [], [], 0.0)
    free = [0.0] * len(compute[0])  # when each rank's Newton-Schulz of the groups so far is done
    link, out = 0.0, Schedule([0.0] * n, [0.0] * n, [0.0] * n, 0.0)
    for kind, i in link_order(n, k):
        if kind == "gather":
            link = out.gather_end[i] = link + gather[i]
            continue
        free = [max(out.gather_end[i], f) + c for f, c in zip(free, compute[i])]
        out.ns_end[i] = max(free)
        link = out.back_end[i] = max(link, out.ns_end[i]) + back[i]
    out.total = link
    return out


@dataclass
class Group:
    """One exchange group of DTensorMuon's step: its parameters, the collectives of its exchange (an empty Traffic
    for a group orthogonalized where it is), and each rank's Newton-Schulz FLOPs and calls."""
    names: tuple
    nbytes: int  # its matrices in bf16: what exchange_bytes bounds (one parameter may exceed it alone)
    owned: list  # per rank: the bf16 bytes of the group's matrices it puts together (owns, or holds whole)
    traffic: Traffic
    ns_flops: list
    ns_calls: list


def dtensor_groups(copies, group_algorithms, group_ns_steps, world, node_of, exchange_bytes):
    """[Group] of DTensorMuon's step in the order it runs them (exchange.OwnerExchange.exchange_groups): the planned
    matrices in the library's groups (plan.exchange_groups, by the cost model's grouped), then the matrices whole on
    their holders (plain and all-Replicate copies) chunked as the library chunks them (owners.chunk_names), exchanging
    nothing. One group of everything without exchange_bytes (one exchange each way)."""
    muon = [c for c in copies if group_algorithms[c.group] in ORTHOGONALIZED]
    matrices, ns_flops, _ = dtensor_plan(muon, group_ns_steps, world)
    local = {c.name: 2 * c.n_matrices * c.matrix_shape[0] * c.matrix_shape[1] for c in muon if c.local}
    limit = plan.exchange_limit(exchange_bytes, [c.matrix_shape for c in muon if c.local], world)  # as the library's
    local_chunks = owners.chunk_names(list(local), local, limit) if exchange_bytes and local else []
    out = []
    for group in grouped(matrices, exchange_bytes):
        traffic, flops, calls, owned = Traffic(world, node_of), [0] * world, [0] * world, [0] * world
        if world > 1:
            exchange_group(traffic, group, group_algorithms)
        for m in group:
            flops[m.owner] += ns_flops[m.name]
            calls[m.owner] += 1
            owned[m.owner] += 2 * math.prod(m.shape)
        names, nbytes = tuple(dict.fromkeys(m.copy.name for m in group)), sum(2 * math.prod(m.shape) for m in group)
        whole = [c for c in muon if c.local] if exchange_bytes is None else []  # one exchange: in the same finish
        out.append(Group(names + tuple(local) * bool(whole), nbytes + sum(local.values()) * bool(whole),
                         add_whole(owned, whole, world), traffic, add_local_matrices(flops, whole, group_ns_steps, calls),
                         calls))
    for chunk in local_chunks:
        flops, calls = [0] * world, [0] * world
        whole = [c for c in muon if c.local and c.name in chunk]
        out.append(Group(chunk, sum(local[n] for n in chunk), add_whole([0] * world, whole, world),
                         Traffic(world, node_of), add_local_matrices(flops, whole, group_ns_steps, calls), calls))
    return out


def add_whole(owned, copies, world):
    """owned (per rank) plus the bf16 bytes of the copies whole on their holders (plain: every rank)."""
    for c in copies:
        for r in c.mesh_ranks or range(world):
            owned[r] += 2 * math.prod(c.shape)
    return owned


def slowest(phases, world, cluster):
    """Seconds of these collectives one after another, each at its slowest rank (PhaseTraffic.seconds)."""
    return sum(max(t.seconds(r, cluster) for r in range(world)) for t in phases)


def group_seconds(group, cluster):
    """(gather, [Newton-Schulz seconds of each rank], way back) of one group: its collectives priced as every phase
    of the model is, its Newton-Schulz as Cost.compute_terms prices it (FLOPs at the rate, and each call's cost)."""
    world, phases = len(group.ns_flops), group.traffic.phases
    cost = Cost("group", group.traffic, group.ns_flops, [0] * world, {"muon": [0] * world, "adamw": [0] * world},
                world, calls=dict(ns=group.ns_calls))
    compute = [sum(v for term, v in cost.compute_terms(r,
                                                       cluster).items() if term.startswith("NS")) for r in range(world)]
    back = [phases[p] for p in ("NorMuon rows", "scatter from owner") if p in phases]  # the order finish() starts them
    return (slowest([phases["gather at owner"]] if "gather at owner" in phases else [], world, cluster), compute,
            slowest(back, world, cluster))


@dataclass
class Prediction:
    """DTensorMuon's step with exchange_bytes and overlap=k: its groups, the pipeline's schedule, and the terms around
    it (the grad-presence vote before, the busiest rank's elementwise work after: momentum, AdamW, the update)."""
    exchange_bytes: int | None
    k: int
    groups: list
    schedule: Schedule
    vote_s: float
    elementwise_s: float
    link_s: float  # every group's collectives, one after another
    ns_s: float  # the busiest rank's Newton-Schulz, all groups

    @property
    def step_s(self):
        return self.vote_s + self.schedule.total + self.elementwise_s


def predict_overlap(copies, param_names, group_algorithms, group_ns_steps, world, node_of, cluster, exchange_bytes,
                    ks):
    """[Prediction] for each k of ks, of DTensorMuon's step with exchange_bytes (None: one exchange each way, k 0)."""
    whole = dtensor_cost(copies, param_names, group_algorithms, group_ns_steps, world, node_of)
    vote = slowest([whole.traffic.phases["grad presence"]] if "grad presence" in whole.traffic.phases else [], world,
                   cluster)
    rest = max(sum(v for term, v in whole.compute_terms(r, cluster).items() if not term.startswith("NS"))
               for r in range(world))
    groups = dtensor_groups(copies, group_algorithms, group_ns_steps, world, node_of, exchange_bytes)
    priced = [group_seconds(g, cluster) for g in groups]
    gather, compute, back = ([p[i] for p in priced] for i in range(3))
    link = sum(gather) + sum(back)
    ns = max(map(sum, zip(*compute))) if compute else 0.0
    return [Prediction(exchange_bytes, k, groups, pipeline(gather, compute, back, k), vote, rest, link, ns)
            for k in ks]


def scenario_overlap(s, cluster, exchange_bytes, ks):
    """predict_overlap on a scenario's DTensorMuon (Muon's matrices; NorMuon's where s.normuon)."""
    label = "DTensorMuon" + (", NorMuon" if s.normuon else "")
    return predict_overlap(dtensor_copies(s), [p.name for p in s.model.params()], dtensor_algorithms(label),
                           DTENSOR_STEPS, s.gpus, node_map(cluster), cluster, exchange_bytes, ks)


OVERLAP_HEADER = ["exchange_bytes", "overlap K", "groups", "largest group", "at one owner", "comm ms",
                  "NS ms (busiest)", "pipeline ms", "step ms", "vs one exchange"]


def exchange_label(exchange_bytes):
    return ("one exchange" if exchange_bytes is None else exchange_bytes if isinstance(exchange_bytes, str)
            else muon_tools.human_bytes(exchange_bytes))


def overlap_rows(s, cluster, sizes, ks):
    """The table's rows of one scenario: one exchange each way, then each exchange_bytes of sizes at each k."""
    one = scenario_overlap(s, cluster, None, [0])[0]
    rows = []
    for p in [one] + [p for size in sizes for p in scenario_overlap(s, cluster, size, ks)]:
        rows.append([exchange_label(p.exchange_bytes), "-" if p.exchange_bytes is None else str(p.k),
                     f"{len(p.groups):,}", muon_tools.human_bytes(max(g.nbytes for g in p.groups)),
                     muon_tools.human_bytes(max(max(g.owned) for g in p.groups)), ms(p.link_s), ms(p.ns_s), ms(p.schedule.total),
                     ms(p.step_s), f"{p.step_s / one.step_s:.2f}x"])
    return rows


def format_overlap(s, cluster, sizes, ks):
    return muon_tools.format_table(OVERLAP_HEADER, overlap_rows(s, cluster, sizes, ks), ["<"] + [">"] * 9)


# The chapter's table: Llama 3 8B and 70B on 64 and 512 GPUs (TP 8), K = 0, 1, 2, two group sizes.
OVERLAP_SCENARIOS = [Scenario(MODELS[m], g, tp=8) for m in ("llama3-8b", "llama3-70b") for g in (64, 512)]
OVERLAP_SIZES = (256 << 20, 1 << 30, 4 << 30)
OVERLAP_KS = (0, 1, 2, 8)


def overlap_chapter(cluster=H100, print_fn=print):
    """Every scenario of OVERLAP_SCENARIOS' table, printed."""
    print_fn(f"Cluster: {cluster.name}")
    print_fn("DTensorMuon's step by groups: \"largest group\" its matrices in bf16 (what exchange_bytes bounds), "
             "\"at one owner\" the most of one group one rank puts together (K + 1 groups' may be in flight); "
             "\"comm ms\" every group's collectives one after another; \"pipeline ms\" the schedule's; \"step ms\" with "
             "the grad-presence vote and the busiest rank's elementwise work")
    for s in OVERLAP_SCENARIOS:
        print_fn(f"\n{scenario_title(s, cluster)}")
        print_fn(format_overlap(s, cluster, OVERLAP_SIZES, OVERLAP_KS))
