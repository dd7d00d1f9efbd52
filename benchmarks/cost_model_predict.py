"""One prediction of the cost model (benchmarks/cost_model.py): a model on a cluster, every strategy that applies,
each planned, counted and priced, and summarized as one row."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import distributed_muon_cpu
import muon_tools
from cost_model_inputs import Model, lesson_specs
from cost_model_plans import Mesh, lesson_optimizer, param_order, placed_copies
from cost_model_traffic import adamw_fsdp2_cost, dtensor_cost, lesson_cost


# =============================================================================
# 5. One prediction: a model on a cluster, every strategy that applies
# =============================================================================

@dataclass(frozen=True)
class Scenario:
    model: Model
    gpus: int
    tp: int = 1
    ep: int = 0  # > 0: expert stacks cut over an "ep" mesh dim of this size (MoE, DTensorMuon only)
    normuon: bool = False  # add NorMuon's rows (owner, comm-free, DTensorMuon with "algorithm": "normuon")

    @property
    def dp(self):
        return self.gpus // self.tp

    @property
    def bucket_size(self):
        """Megatron-LM's default bucket: max(40M, 1M x DP) elements (DistributedDataParallelConfig.bucket_size),
        larger for more DP ranks so that its collectives stay bandwidth-bound."""
        return max(40_000_000, 1_000_000 * self.dp)

    @property
    def flat_bucket_size(self):
        """One bucket per buffer (a param group's TP-local parameters): ZeRO-1's flat buffer left whole, the layout
        issue 43 calls Moonlight's (every rank whose shard touches a matrix orthogonalizes it, as with buckets, but
        a matrix then lies in one or two DP shards). Every parameter of the model fits in it."""
        return self.model.total_params()


GROUPS = ("muon", "adamw", "adamw_no_wd")
FLAT = ", flat buffer"  # the label of a row planned with Scenario.flat_bucket_size
NORMUON = ", NorMuon"  # the label of a row whose matrices take NorMuon


def baseline_of(label):
    """The AdamW row a row is set against: torch's AdamW on the same FSDP2 shards for DTensorMuon's rows, AdamW
    ZeRO-1 on the same buffer layout for the lesson's."""
    if label.startswith("DTensorMuon") or label == "AdamW, FSDP2":
        return "AdamW, FSDP2"
    return "AdamW ZeRO-1" + (FLAT if label.endswith(FLAT) else "")


def node_map(cluster):
    return lambda rank: rank // cluster.gpus_per_node


def predict_costs(s, cluster, strategies=None):
    """{label: Cost} for the scenario: the lesson's strategies and AdamW ZeRO-1 on dense models, DTensorMuon
    and AdamW under FSDP2 on every model."""
    check_layout(s)
    params, node_of, costs = s.model.params(), node_map(cluster), {}
    moe = s.model.experts > 0
    if not moe:
        specs = lesson_specs(params)
        muon_tools.check_tp_divides(specs, s.tp)
        base = muon_tools.RunConfig(dp=s.dp, tp=s.tp, bucket_size=s.bucket_size)
        lesson = {"gather": base, "gather" + FLAT: replace(base, bucket_size=s.flat_bucket_size),
                  "owner": replace(base, strategy="owner"), "comm-free": replace(base, strategy="comm-free")}
        if s.normuon:
            lesson.update({f"{k}{NORMUON}": replace(lesson[k], normuon=True) for k in ("owner", "comm-free")})
        if s.tp > 1:  # (TP = 1: nothing to sum over)
            lesson["gather, Gram form"] = replace(base, tp_newton_schulz="gram")
        lesson.update({"AdamW ZeRO-1": replace(base, baseline=True),
                       "AdamW ZeRO-1" + FLAT: replace(base, baseline=True, bucket_size=s.flat_bucket_size)})
        for label, cfg in lesson.items():
            if strategies is None or label in strategies:
                costs[label] = lesson_cost(lesson_optimizer(specs, cfg), node_of, label)
    copies = dtensor_copies(s)
    for label in ("DTensorMuon",) + (("DTensorMuon" + NORMUON,) if s.normuon else ()) + ("AdamW, FSDP2",):
        if strategies is None or label in strategies:
            costs[label] = (adamw_fsdp2_cost(copies, s.gpus, node_of) if label == "AdamW, FSDP2" else
                            dtensor_cost(copies, [p.name for p in params], dtensor_algorithms(label), DTENSOR_STEPS,
                                         s.gpus, node_of, label))
    return costs


DTENSOR_STEPS = {i: distributed_muon_cpu.NS_STEPS for i in range(len(GROUPS))}  # DTensorMuon's ns_steps of each param group


def dtensor_algorithms(label):
    """{group index: algorithm} of a DTensorMuon row: its matrices on NorMuon where the label says so."""
    matrices = "normuon" if label.endswith(NORMUON) else "muon"
    return {i: matrices if g == "muon" else "adamw" for i, g in enumerate(GROUPS)}


def check_layout(s):
    if s.gpus % s.tp:
        raise ValueError(f"TP {s.tp} does not divide {s.gpus} GPUs")


def dtensor_copies(s):
    """The scenario's parameters placed for DTensorMuon, in its planning order: FSDP2 x TP on a dense model, EP and
    FSDP2 on an MoE (moe_copies)."""
    check_layout(s)
    params = s.model.params()
    if s.model.experts:
        return moe_copies(params, s)
    return placed_copies(param_order(params, GROUPS), Mesh(s.dp, s.tp), {g: i for i, g in enumerate(GROUPS)})


def moe_copies(params, s):
    """An MoE without TP: dense parameters FSDP2-sharded over all GPUs (a (gpus, 1) mesh), expert stacks on a
    (gpus / ep, ep) mesh: whole experts over "ep" (Shard(0)), FSDP2 over the rest (dim 1, as the demo)."""
    if s.gpus % s.ep or s.model.experts % s.ep:
        raise ValueError(f"EP {s.ep} must divide the {s.gpus} GPUs and the {s.model.experts} experts")
    index = {g: i for i, g in enumerate(GROUPS)}
    ordered = param_order(params, GROUPS)
    dense = placed_copies([p for p in ordered if not p.expert], Mesh(s.gpus, 1), index)
    experts = {c.name: c for c in placed_copies([p for p in ordered if p.expert], Mesh(s.gpus // s.ep, s.ep,
                                                                                       ep_dim="ep"), index)}
    by_name = {c.name: c for c in dense}
    return [experts.get(p.name) or by_name[p.name] for p in ordered]


@dataclass
class Row:
    label: str
    sent_max: int
    received_max: int
    inter_share: float
    ns_max: float
    ns_mean: float
    state_max: int
    comm_s: float
    compute_s: float
    step_s: float
    overlap_s: float
    terms: dict = field(default_factory=dict)  # {term: seconds}: comm's and the busiest rank's compute's


def summarize(cost, cluster):
    """A Row: communication (every phase at its slowest rank, one after another) and compute (the busiest rank's).
    Where the ranks share cores, the step takes at least all ranks' CPU work over them (cores_floor): what that adds
    is "shared cores", counted with compute. Overlapped: the largest of communication (cluster.in_flight collectives
    at once), compute and that floor."""
    sent = [sum(t.sent[r] for t in cost.traffic.phases.values()) for r in range(cost.world)]
    received = [sum(t.received[r] for t in cost.traffic.phases.values()) for r in range(cost.world)]
    inter = sum(sum(t.link["inter"][0]) for t in cost.traffic.phases.values())
    terms = cost.comm_terms(cluster)
    comm = sum(terms.values())
    per_rank = cost.compute_seconds(cluster)
    busiest = max(range(cost.world), key=per_rank.__getitem__)
    terms.update(cost.compute_terms(busiest, cluster))
    # ranks sharing fewer cores: the step takes at least every rank's CPU over the cores, their compute and what their
    # collectives take (Cluster.cpu_call_us, cpu_gbs)
    floor = cores_floor(cost, cluster)
    terms["shared cores"] = max(0.0, floor - comm - per_rank[busiest])
    compute = per_rank[busiest] + terms["shared cores"]
    return Row(cost.label, max(sent), max(received), inter / sum(sent) if sum(sent) else 0.0, max(cost.ns_flops),
               sum(cost.ns_flops) / cost.world, max(cost.state_bytes), comm, compute, comm + compute,
               max(comm / cluster.in_flight, per_rank[busiest], floor), terms)


def cores_floor(cost, cluster):
    """The least time every rank's CPU work takes where the ranks share cluster.cores cores (0: none shared): their
    Newton-Schulz at the machine's rate when all run it at once (world x its own rate / ns_shared), then the rest of
    their compute and the CPU their collectives take, over the cores."""
    if not cluster.cores:
        return 0.0
    alone = replace(cluster, ns_shared=1.0)
    ns = sum(cost.compute_terms(r, alone)["NS FLOPs"] + cost.compute_terms(r, alone)["NS calls"]
             for r in range(cost.world))
    rest = sum(cost.compute_seconds(alone)) - ns + sum(t.cpu_seconds(r, cluster) for t in cost.traffic.phases.values()
                                                         for r in range(cost.world))
    return ns * cluster.ns_shared / cost.world + rest / cluster.cores


def forward_backward_seconds(s, cluster):
    """The step's forward + backward FLOPs (Model.train_flops) over the GPUs at the cluster's forward + backward rate."""
    return s.model.train_flops() / (s.gpus * cluster.train_tflops * 1e12)
