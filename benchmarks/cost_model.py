"""What a distributed Muon step costs on a cluster, predicted from the project's own plans (notes/12-cost-model.md).

Give it a model (layers, d_model, heads and KV heads, FFN width, vocabulary, experts) and a cluster (GPUs per
node, link bandwidths and latencies, bf16 rates). It builds the layout each optimizer itself would build, on
a virtual grid, with no process and no memory:

  * the lesson's strategies, gather (and its Gram form, and with a flat buffer: one bucket per param group),
    owner and comm-free (Muon's, and with --normuon NorMuon's), and the AdamW ZeRO-1 baseline: the optimizer
    class itself, constructed as muon_tools.plan_optimizer constructs it, over parameters on PyTorch's meta
    device; so its virtual buffer is plan_layout's, its owners assign_owners', its routes plan_routes' and its
    chunks CommFreeMuon's own;
  * DTensorMuon over FSDP2 x TP x EP: each parameter's copies placed as fully_shard and parallelize_module
    place them (section 3: the rules, which the test checks against real FSDP2 runs), its owners by its own
    rule (assign_among_holders), its transfers its own: the plan is distmuon/dtensor/plan.py's plan_matrices.

From the plans it counts, for every rank, what the Ledger would count (bytes and calls of every collective
phase), the Newton-Schulz FLOPs and calls, the optimizer state, the elementwise work and the parts it steps,
and it prices them: each collective by an alpha-beta model on the links it crosses (plus a fixed cost per
call where a machine measured one), compute at the cluster's rates (plus per-call costs, likewise); the step
without overlap (the sum) and with perfect overlap (the larger of communication and compute); beside AdamW's
step on the same layout and beside the forward + backward of the same step ((6 x active parameters +
attention) x tokens FLOPs). tests/test_cost_model.py proves the bytes, calls, FLOPs and state equal real
runs' Ledgers on every grid the tests run; --check-here measures this machine's per-call costs and compares
the times with steps measured on 1, 2 and 4 processes.

    python benchmarks/cost_model.py --model llama3-70b --gpus 512 --tp 8       # one table, H100 figures
    python benchmarks/cost_model.py --model deepseek-v3 --gpus 1024 --ep 64 --normuon    # and NorMuon's rows
    python benchmarks/cost_model.py --model marin-moe-d2560 --gpus 8 --ep 1             # one node, a small batch
    python benchmarks/cost_model.py --chapter --json c.json --figure c.png    # notes/12's tables and figures
    python benchmarks/cost_model.py --check-here                              # predicted vs measured, this CPU

Sections: 1. models, 2. clusters, 3. the plans (lesson and DTensor), 4. traffic and its price,
5. one prediction, 6. tables and figures (and one node's MFU against marin's), 7. this machine, measured,
8. the command line.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402


import distributed_muon_cpu as dm  # noqa: E402
import distmuon.dtensor.plan as dplan  # noqa: E402
import distmuon.large_runs as mlr  # noqa: E402
import distmuon.owners as mo  # noqa: E402
import muon_tools as mt  # noqa: E402
from distmuon.adamw import adamw_step_  # noqa: E402
from distmuon.checks import ORTHOGONALIZED  # noqa: E402
from distmuon.dtensor.normuon import v_holders, v_placements  # noqa: E402

BF16, FP32, U8 = torch.bfloat16, torch.float32, torch.uint8

# =============================================================================
# 1. Models
# =============================================================================
# A model is its parameters: name, global shape, how tensor parallelism cuts it, its param group. TP roles
# (Megatron's, and parallelize_module's styles): "col" splits dim 0 (ColwiseParallel: q, k, v, gate, up,
# the fused qkv, their biases), "row" dim 1 (RowwiseParallel: o, down), "replicate" is a parameter of a TP
# module that every TP rank keeps whole (a row-parallel layer's bias), None a module TP leaves alone (norms,
# the router, MLA's low-rank projections), "expert" a 3-D expert stack (E, out, in) whose dim 0 expert
# parallelism cuts. Groups are the lesson's: "muon", "adamw" (embedding, head), "adamw_no_wd" (norms, biases).


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple
    tp: str | None
    group: str

    @property
    def expert(self):
        return self.tp == "expert"


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    d: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tokens: int  # tokens per optimizer step (the global batch), for the forward + backward
    source: str  # where the shapes and the batch come from
    seq: int  # tokens a sequence: attention's FLOPs grow with it
    head_dim: int = 0  # 0: d / heads
    gpt2: bool = False  # GPT-2: fused qkv, GELU MLP, biases, learned positions, head tied to the embedding
    positions: int = 1024
    experts: int = 0  # routed experts per MoE layer (0: dense)
    expert_ffn: int = 0
    top_k: int = 0
    shared_experts: int = 0
    shared_ffn: int = 0  # width of the shared experts' FFN (0: shared_experts x expert_ffn)
    dense_layers: int = 0  # MoE: the first layers keep a dense FFN of width ffn
    mla: tuple = ()  # DeepSeek's latent attention: (q_lora, kv_lora, rope, nope, v_head) dims

    def params(self):
        d, hd = self.d, self.head_dim or self.d // self.heads
        out = [Param("embed.weight", (self.vocab, d), "col", "adamw")]
        if self.gpt2:
            out.append(Param("pos_embed.weight", (self.positions, d), None, "adamw"))
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [Param(p + "attn_norm.weight", (d,), None, "adamw_no_wd")]
            if self.gpt2:
                out += [Param(p + "attn_norm.bias", (d,), None, "adamw_no_wd"),
                        Param(p + "attn.qkv.weight", (3 * d, d), "col", "muon"),
                        Param(p + "attn.qkv.bias", (3 * d,), "col", "adamw_no_wd"),
                        Param(p + "attn.o.weight", (d, d), "row", "muon"),
                        Param(p + "attn.o.bias", (d,), "replicate", "adamw_no_wd")]
            elif self.mla:
                q_lora, kv_lora, rope, nope, v = self.mla
                out += [Param(p + "attn.q_a.weight", (q_lora, d), None, "muon"),
                        Param(p + "attn.q_a_norm.weight", (q_lora,), None, "adamw_no_wd"),
                        Param(p + "attn.q_b.weight", (self.heads * (nope + rope), q_lora), "col", "muon"),
                        Param(p + "attn.kv_a.weight", (kv_lora + rope, d), None, "muon"),
                        Param(p + "attn.kv_a_norm.weight", (kv_lora,), None, "adamw_no_wd"),
                        Param(p + "attn.kv_b.weight", (self.heads * (nope + v), kv_lora), "col", "muon"),
                        Param(p + "attn.o.weight", (d, self.heads * v), "row", "muon")]
            else:
                out += [Param(p + "attn.q.weight", (self.heads * hd, d), "col", "muon"),
                        Param(p + "attn.k.weight", (self.kv_heads * hd, d), "col", "muon"),
                        Param(p + "attn.v.weight", (self.kv_heads * hd, d), "col", "muon"),
                        Param(p + "attn.o.weight", (d, self.heads * hd), "row", "muon")]
            out += [Param(p + "ffn_norm.weight", (d,), None, "adamw_no_wd")]
            if self.gpt2:
                out += [Param(p + "ffn_norm.bias", (d,), None, "adamw_no_wd"),
                        Param(p + "mlp.fc.weight", (self.ffn, d), "col", "muon"),
                        Param(p + "mlp.fc.bias", (self.ffn,), "col", "adamw_no_wd"),
                        Param(p + "mlp.proj.weight", (d, self.ffn), "row", "muon"),
                        Param(p + "mlp.proj.bias", (d,), "replicate", "adamw_no_wd")]
            elif self.experts and i >= self.dense_layers:
                shared = self.shared_ffn or self.shared_experts * self.expert_ffn
                out += [Param(p + "moe.router.weight", (self.experts, d), None, "muon"),
                        Param(p + "moe.w1", (self.experts, self.expert_ffn, d), "expert", "muon"),
                        Param(p + "moe.w3", (self.experts, self.expert_ffn, d), "expert", "muon"),
                        Param(p + "moe.w2", (self.experts, d, self.expert_ffn), "expert", "muon")]
                if shared:
                    out += [Param(p + "moe.shared.gate.weight", (shared, d), "col", "muon"),
                            Param(p + "moe.shared.up.weight", (shared, d), "col", "muon"),
                            Param(p + "moe.shared.down.weight", (d, shared), "row", "muon")]
            else:
                out += [Param(p + "mlp.gate.weight", (self.ffn, d), "col", "muon"),
                        Param(p + "mlp.up.weight", (self.ffn, d), "col", "muon"),
                        Param(p + "mlp.down.weight", (d, self.ffn), "row", "muon")]
        out.append(Param("final_norm.weight", (d,), None, "adamw_no_wd"))
        if self.gpt2:
            out.append(Param("final_norm.bias", (d,), None, "adamw_no_wd"))
        else:
            out.append(Param("lm_head.weight", (self.vocab, d), "col", "adamw"))
        return out

    def total_params(self):
        return sum(math.prod(p.shape) for p in self.params())

    def active_params(self):
        """Parameters one token multiplies by: all but the embedding lookup (GPT-2's tied head multiplies
        by it) and the position table, and top_k of the routed experts."""
        active = 0
        for p in self.params():
            if (p.name == "embed.weight" and not self.gpt2) or p.name == "pos_embed.weight":
                continue
            active += math.prod(p.shape) * (self.top_k / self.experts if p.expert else 1)
        return int(active)

    def attention_flops_per_token(self):
        """Forward + backward FLOPs a token spends in attention's two products with the sequence (Q K^T, then the
        weights times V), which 6 x active parameters leaves out: per layer and head, 2 seq (qk dim + v dim) in the
        forward, three times that with the backward. With qk = v = head_dim this is 12 layers heads head_dim seq, the
        PaLM paper's term (Chowdhery et al., arXiv 2204.02311, Appendix B: model FLOPs per token 6 N + 12 L H Q T),
        counted over the whole sequence, causal mask or not, as PaLM and marin's levanter (lm_flops_per_token, in
        lib/levanter/src/levanter/utils/flop_utils.py) count it. MLA: qk = nope + rope, v = v_head."""
        hd = self.head_dim or self.d // self.heads
        qk, v = (self.mla[3] + self.mla[2], self.mla[4]) if self.mla else (hd, hd)
        return 6 * self.layers * self.heads * self.seq * (qk + v)

    def train_flops(self):
        """Forward + backward FLOPs of one optimizer step: (6 x active parameters + attention) x tokens."""
        return (6 * self.active_params() + self.attention_flops_per_token()) * self.tokens


LLAMA3 = ("Llama 3 (arXiv 2407.21783, Table 3: layers, width, FFN, heads, 8 KV heads, vocabulary 128,256); "
          "batch: 4M tokens in sequences of 4,096, Llama 3 405B's initial batch (its section 3.4.1), assumed here")
DEEPSEEK = ("DeepSeek-V3 (arXiv 2412.19437, section 4.2: 61 layers, d 7,168, MLA with 128 heads, q / kv ranks "
            "1,536 / 512, 1 shared + 256 routed experts of width 2,048, 8 active, first 3 layers dense, vocabulary "
            "129K; batch 15,360 x 4,096 tokens at its largest, sequences of 4K)")
KIMI = ("Kimi K2 (arXiv 2507.20534: DeepSeek-V3's shapes with 384 experts, 64 attention heads, 1 dense layer, "
        "vocabulary 160K); batch assumed DeepSeek-V3's (not checked)")
MARIN = ("marin-community/marin issue 6979 (its MFU table: d2560, 26 layers, 64 experts, top-4, EP1, batch 168 on one "
         "8 x H100 node) on the d2560 shape of issue 6044 (20 heads, 5 KV heads, head_dim 128, expert width 1,280, one "
         "shared expert of width 2,560, vocabulary 128,256); its sequences of 2,048 tokens assumed: the default of "
         "experiments/grug/moe/launch_cw_scale.py, which the issue's launch comment names, and its row 8 moves to 4K")
MODELS = {
    "gpt2-small": Model("GPT-2 small", 12, 768, 12, 12, 3072, 50304, tokens=2**19, gpt2=True, seq=1024,
                        source="GPT-2 (Radford et al., 2019), vocabulary padded to 50,304 as nanoGPT does; batch "
                               "2^19 tokens (512 sequences of 1,024), llm.c's GPT-2 (124M) reproduction (nanoGPT's is "
                               "491,520)"),
    "llama3-8b": Model("Llama-3-8B-like", 32, 4096, 32, 8, 14336, 128256, tokens=2**22, seq=4096, source=LLAMA3),
    "llama3-70b": Model("Llama-3-70B-like", 80, 8192, 64, 8, 28672, 128256, tokens=2**22, seq=4096, source=LLAMA3),
    "deepseek-v3": Model("DeepSeek-V3-like MoE", 61, 7168, 128, 128, 18432, 129280, tokens=15360 * 4096, seq=4096,
                         source=DEEPSEEK, experts=256, expert_ffn=2048, top_k=8, shared_experts=1, dense_layers=3,
                         mla=(1536, 512, 64, 128, 128)),
    "kimi-k2": Model("Kimi-K2-like MoE", 61, 7168, 64, 64, 18432, 163840, tokens=15360 * 4096, seq=4096, source=KIMI,
                     experts=384, expert_ffn=2048, top_k=8, shared_experts=1, dense_layers=1,
                     mla=(1536, 512, 64, 128, 128)),
    "marin-moe-d2560": Model("marin's d2560 MoE", 26, 2560, 20, 5, 0, 128256, tokens=168 * 2048, seq=2048,
                             source=MARIN, head_dim=128, experts=64, expert_ffn=1280, top_k=4, shared_experts=1,
                             shared_ffn=2560),
}


def lesson_specs(params):
    """The model as the lesson's ParamSpecs (2-D matrices only: the lesson has no expert stacks)."""
    if any(p.expert for p in params):
        raise ValueError("the lesson's strategies have no expert parallelism: an MoE is DTensorMuon's (--ep)")
    split = {"col": 0, "row": 1}
    return [dm.ParamSpec(p.name, p.shape, split.get(p.tp, -1), p.group) for p in params]


# =============================================================================
# 2. Clusters
# =============================================================================
# Every figure is per GPU, one direction, as achieved (not the peak), each with its source.

@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    intra_gbs: float  # GB/s a GPU moves to another of its node (NVLink), one direction
    inter_gbs: float  # GB/s a GPU moves to another node (its network card)
    intra_us: float  # latency of one message (a ring step, or one peer of an all-to-all) inside a node
    inter_us: float
    ns_tflops: float  # bf16 matmul rate Newton-Schulz runs at, per GPU
    train_tflops: float  # forward + backward rate (MFU x peak), per GPU
    hbm_gbs: float  # memory bandwidth of elementwise work (momentum, AdamW, the update)
    muon_bytes: int  # bytes an elementwise Muon step moves per element (momentum, cast, decay, update)
    adamw_bytes: int  # the same for AdamW
    sources: tuple = ()
    peak_tflops: float = 0.0  # the bf16 peak MFU is counted against (0: none)
    # Per-call costs, measured where a machine measured them (--check-here, section 7), 0 where none was: the fixed
    # cost of one collective call by the Ledger's op name, on top of alpha per message; the bandwidth of each op
    # where it differs from intra_gbs; one Newton-Schulz call, one part's elementwise Muon step (momentum, cast,
    # decay, update) and AdamW step; and how many cores the ranks share (0: a device each).
    call_us: tuple = ()  # ((op, us), ...)
    op_gbs: tuple = ()  # ((op, GB/s), ...)
    cpu_call_us: tuple = ()  # ((op, us), ...): the CPU a call takes from the cores the ranks share (cores > 0)
    cpu_gbs: tuple = ()  # ((op, GB/s), ...): and per byte
    ns_call_us: float = 0.0
    muon_part_us: float = 0.0
    adamw_part_us: float = 0.0
    apply_us: float = 0.0  # comm-free: applying an update the owner row broadcast to a whole matrix
    param_us: float = 0.0  # the step's own bookkeeping, per parameter it walks (fitted by --check-here)
    ns_shared: float = 1.0  # how many times longer Newton-Schulz takes when every rank runs it at once
    cores: int = 0
    in_flight: int = 1  # collectives a rank's process group runs at once, overlapped (Gloo: its worker threads)

    def call_s(self, op):
        return dict(self.call_us).get(op, 0.0) * 1e-6


H100_PEAK_TFLOPS = 989.4  # dense bf16, H100 SXM (NVIDIA H100 Tensor Core GPU datasheet)
H100 = Cluster(
    "H100 SXM, 8 per node (NVLink 4 inside, 8 x 400 Gb/s InfiniBand NDR between nodes)", 8,
    intra_gbs=0.8 * 450, inter_gbs=0.8 * 50, intra_us=3.0, inter_us=8.0,
    ns_tflops=0.6 * H100_PEAK_TFLOPS, train_tflops=0.4 * H100_PEAK_TFLOPS, hbm_gbs=0.8 * 3350,
    muon_bytes=24, adamw_bytes=28, peak_tflops=H100_PEAK_TFLOPS,
    sources=(
        "NVLink 4: 900 GB/s per GPU both ways, 450 one way (NVIDIA H100 datasheet); 80 % of it assumed achieved",
        "network: one 400 Gb/s ConnectX-7 (50 GB/s) per GPU in a DGX H100 (NVIDIA DGX H100 datasheet); 80 % "
        "assumed achieved",
        "latency per message: 3 us inside a node, 8 us between nodes: assumed (typical of NCCL's small "
        "messages; not measured here)",
        f"bf16: {H100_PEAK_TFLOPS} TFLOP/s dense peak (H100 SXM datasheet); Newton-Schulz assumed at 60 % of it "
        "(large square-ish GEMMs; no H100 measurement of it in this project)",
        "forward + backward: 40 % MFU, Llama 3's 38-43 % BF16 MFU on H100s (arXiv 2407.21783, Table 4)",
        "HBM3: 3.35 TB/s (H100 SXM datasheet), 80 % assumed achieved; elementwise bytes per element assume fused "
        "kernels: Muon 24 (read g, m; write m and the bf16 update; read p and the update, write p), AdamW 28 "
        "(read p, g, m, v; write p, m, v)"),
)


# =============================================================================
# 3. The plans
# =============================================================================
# 3a. The lesson's strategies. The optimizer class itself, on the grid rank 0 plans with (dm.plan_grid),
# over meta tensors: nothing is allocated, everything a rank plans is computed. The lesson's grid takes any
# size (only the runner refuses more than MAX_WORLD ranks, each a process on this machine): a virtual grid
# starts none.

def virtual_grid(dp, tp, rank=0):
    return dm.plan_grid(dp, tp, rank)


def lesson_optimizer(specs, cfg):
    """The optimizer rank 0 of cfg's run builds (muon_tools.build_optimizer), on meta tensors."""
    params = {s.name: torch.empty(mt.tp_local_shape(s, cfg.tp), device="meta") for s in specs}
    return mt.build_optimizer(specs, cfg, virtual_grid(cfg.dp, cfg.tp), params)


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
    """[dplan.Copy] of every parameter, in the order DTensorMuon's ranks swap them (rank 0's, then each further
    rank's new copies: those of the other TP columns). group_index: {group name: its index in the optimizer}."""
    ranks = torch.arange(mesh.world).view(mesh.shape)
    rep = (Replicate(),) if mesh.replicate > 1 else ()
    tp_of = {"col": Shard(0), "row": Shard(1), "replicate": Replicate(), "expert": Shard(0)}
    whole, columns = [], {}
    for p in params:
        if p.tp is None:  # FSDP2 alone, on each TP column's own (replicate x) dp sub-mesh
            columns[p] = [dplan.Copy(p.name, group_index[p.group], p.shape, tuple(ranks[..., t].reshape(-1).tolist()),
                                  mesh.shape[:-1], rep + (Shard(0),), False, mesh.names[:-1]) for t in range(mesh.tp)]
            continue
        on_tp = tp_of[p.tp]
        # an expert stack's dim 1 where dp divides it, unless a TP rank holds no expert (dtensor_demo.parallelize)
        every_ep_rank_has_one = mesh.ep_dim != "tp" or len(torch.arange(p.shape[0]).chunk(mesh.tp)) == mesh.tp
        dim = 1 if p.expert and p.shape[1] % mesh.dp == 0 and every_ep_rank_has_one else 0
        whole.append(dplan.Copy(p.name, group_index[p.group], p.shape, tuple(range(mesh.world)), mesh.shape,
                             rep + (fsdp_placement(on_tp, dim, mesh.tp), on_tp), p.expert, mesh.names))
    by_name = {c.name: c for c in whole}
    first = [by_name[p.name] if p.name in by_name else columns[p][0] for p in params]
    return first + [cs[t] for t in range(1, mesh.tp) for cs in columns.values()]


def param_order(params, groups):
    """The parameters as DTensorMuon indexes them: group by group, in the order of `groups` (names)."""
    return [p for g in groups for p in params if p.group == g]


# DTensorMuon's plan is its own: distmuon/dtensor/plan.py's plan_matrices (owners by assign_among_holders), each
# piece a box of ranges (its Cut), every rank's transfers its routes; so the bytes priced here are the bytes the
# optimizer moves, by construction. The plan as rank 0 makes it: the owners are the same on every rank.

def dtensor_plan(copies, group_ns_steps, world):
    """DTensorMuon's automatic plan (plan_matrices, without the Gram form): [dplan.Matrix], ns_flops, owners."""
    return dplan.plan_matrices(copies, group_ns_steps, 0, world)


def dtensor_transfers(matrices):
    """(gather, scatter): (sources, destinations, elements) tensors of every rank's transfers (dplan.routes)."""
    gather, scatter = zip(*(dplan.routes(m) for m in matrices)) if matrices else ((), ())
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
    cut = dplan.cut_of(shape, mesh_ranks, mesh_shape, placements)
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

def lesson_cost(opt, node_of, label=None):
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
    if strategy.name == "gather":
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
                        work = mlr.newton_schulz_tp_flops(shape, tp, steps)
                    else:
                        if layout.tp_split_dims[name] >= 0 and tp > 1:
                            traffic.all_gather("TP gather", "TP", BF16, [tp_groups[d]], math.prod(layout.shapes[name]))
                        work = dm.newton_schulz_flops(shape, steps)
                    for r in tp_groups[d]:
                        flops[r] += work
                        ns_calls[r] += 1
    else:
        for name, owner in opt.owners.items():
            flops[owner] += strategy.ns_flops[name]
            ns_calls[owner] += 1
        if strategy.name == "owner" and world > 1:
            for unit in strategy.units(opt):  # stage 3, unit by unit (a unit without a matrix moves nothing)
                exchange_at_owners(traffic, [r for r in strategy.routes if r.name in unit.names], "world",
                                   lambda i: i, opt)
        if strategy.name == "comm-free":
            comm_free_cost(opt, traffic, dp, tp)
    for b in layout.buckets if dp > 1 else ():  # stage 4: the parameter all-gather
        traffic.all_gather("param all-gather", "DP", FP32, dp_groups, b.numel // dp)
    state, elements, calls = lesson_state(opt, dp, tp)
    single = sum(strategy.ns_flops.values()) if getattr(strategy, "ns_flops", None) else sum(
        dm.newton_schulz_flops(layout.global_shapes[n], opt.group_of[n]["ns_steps"]) for n in opt.muon_names)
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
        traffic.all_to_all("NorMuon rows", axis, FP32, *columns((g(r.owner), g(p.rank), mo.full_rows(r) + 1)
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
                (row[n] * tp + t, d * tp + t, rows[n]) for n in chunk if n in rows for d in range(dp) for t in range(tp)))
    for d in range(dp) if tp > 1 else ():
        grid = virtual_grid(dp, tp, d * tp)
        routes = mo.plan_routes(opt.muon_names, opt.owners, lambda n, d: opt.strategy.part_of(opt, n, d), opt.layout,
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
                elements[kind][r] += whole if opt.strategy.name == "comm-free" and kind == "muon" else n
                if n:
                    calls[kind][r] += 1
                elif opt.strategy.name == "comm-free" and kind == "muon":  # the owner row's update, applied here
                    calls["apply"][r] += 1
        if group["algorithm"] == "normuon":
            state[opt.owners[name]] += 4 * opt.layout.global_shapes[name][0]
    return state, elements, calls


# 4b. DTensorMuon's step (distmuon/dtensor/, section 5): the grad-presence vote over its group, one
# gather at owner and one scatter from owner (all-to-all over the world), Newton-Schulz on the owners.

def dtensor_cost(copies, param_names, group_algorithms, group_ns_steps, world, node_of, label="DTensorMuon"):
    """copies: in DTensorMuon's planning order (placed_copies); param_names: every name its ranks vote on;
    group_algorithms / group_ns_steps: {group index: "muon" | "adamw"} / {group index: ns_steps}."""
    traffic = Traffic(world, node_of)
    if world > 1:
        traffic.all_reduce("grad presence", "world", U8, [list(range(world))], len(set(param_names)) + 1)
    muon = [c for c in copies if group_algorithms[c.group] in ORTHOGONALIZED]
    matrices, ns_flops, owners = dtensor_plan(muon, group_ns_steps, world)
    if world > 1:
        gather, scatter = dtensor_transfers(matrices)
        traffic.all_to_all("gather at owner", "world", BF16, *gather)
        traffic.all_to_all("scatter from owner", "world", BF16, *scatter)
        normuon = [m for m in matrices if group_algorithms[m.copy.group] == "normuon"]
        if normuon:
            traffic.all_to_all("NorMuon rows", "world", FP32, *columns(normuon_rows(normuon)))
    flops, ns_calls = [0] * world, [0] * world
    for name, owner in owners.items():
        flops[owner] += ns_flops[name]
        ns_calls[owner] += 1
    flops = add_local_matrices(flops, muon, group_ns_steps, ns_calls)
    state, elements = state_and_elements(copies, lambda c: group_algorithms[c.group], world)
    return Cost(label, traffic, flops, state, elements, world, sum(ns_flops.values()), dict(ns=ns_calls))


def normuon_rows(matrices):
    """(owner, receiver, rows + 1) of NorMuon's rows exchange (distmuon/dtensor/normuon.py, NorMuonRows): v and g of
    each distributed matrix, from its owner to every rank of its copy's mesh that holds its v (v_holders)."""
    for m in matrices:
        yield from ((m.owner, r, m.copy.matrix_shape[0] + 1) for r in v_holders(m.copy, max(m.expert, 0)).tolist())


def add_local_matrices(flops, muon_copies, group_ns_steps, ns_calls):
    """Plain and all-Replicate copies: orthogonalized where they are, on every holder (no exchange)."""
    for c in muon_copies:
        if c.local:
            work = c.n_matrices * dm.newton_schulz_flops(c.matrix_shape, group_ns_steps[c.group])
            for r in c.mesh_ranks or range(len(flops)):
                flops[r] += work
                ns_calls[r] += c.n_matrices
    return flops


def adamw_fsdp2_cost(copies, world, node_of):
    """torch's AdamW on FSDP2's shards: elementwise on each local shard, no collective in its step."""
    state, elements = state_and_elements(copies, lambda c: "adamw", world)
    return Cost("AdamW, FSDP2", Traffic(world, node_of), [0] * world, state, elements, world)


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
    if s.gpus % s.tp:
        raise ValueError(f"TP {s.tp} does not divide {s.gpus} GPUs")
    params, node_of, costs = s.model.params(), node_map(cluster), {}
    moe = s.model.experts > 0
    if not moe:
        specs = lesson_specs(params)
        mt.check_tp_divides(specs, s.tp)
        base = mt.RunConfig(dp=s.dp, tp=s.tp, bucket_size=s.bucket_size)
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
    copies = moe_copies(params, s) if moe else placed_copies(param_order(params, GROUPS), Mesh(s.dp, s.tp),
                                                              {g: i for i, g in enumerate(GROUPS)})
    steps = {i: dm.NS_STEPS for i in range(len(GROUPS))}
    for label in ("DTensorMuon",) + (("DTensorMuon" + NORMUON,) if s.normuon else ()) + ("AdamW, FSDP2",):
        if strategies is None or label in strategies:
            matrices = "normuon" if label.endswith(NORMUON) else "muon"
            algorithms = {i: matrices if g == "muon" else "adamw" for i, g in enumerate(GROUPS)}
            costs[label] = (adamw_fsdp2_cost(copies, s.gpus, node_of) if label == "AdamW, FSDP2" else
                            dtensor_cost(copies, [p.name for p in params], algorithms, steps, s.gpus, node_of, label))
    return costs


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


# =============================================================================
# 6. Tables and figures
# =============================================================================

def ms(seconds):
    return f"{seconds * 1e3:,.1f}"


HEADER = ["optimizer", "sent/rank max", "received/rank max", "inter-node", "NS GFLOP max", "max/mean",
          "state/rank max", "comm ms", "compute ms", "step ms", "overlapped ms", "vs AdamW", "share of step"]


def format_rows(rows, fwd_bwd):
    """The table of one scenario. "vs AdamW": the step over the AdamW step of the same layout (ZeRO-1's for the
    lesson's strategies: both include its reduce-scatter and all-gather) and how many ms more; DTensorMuon's
    against AdamW on the same FSDP2 shards (whose step moves nothing: FSDP2's own traffic is in the forward and
    backward of both), in ms only. "share of step": step / (forward + backward + step), no overlap."""
    by = {r.label: r for r in rows}
    out = []
    for row in rows:
        adamw = by.get(baseline_of(row.label))
        fsdp2 = adamw is not None and adamw.label == "AdamW, FSDP2"
        versus = "-" if adamw is None or adamw is row else (
            f"+{ms(row.step_s - adamw.step_s)} ms" if fsdp2 else
            f"{row.step_s / adamw.step_s:.2f}x, {(row.step_s - adamw.step_s) * 1e3:+,.1f} ms")
        out.append([row.label, mt.human_bytes(row.sent_max), mt.human_bytes(row.received_max), f"{row.inter_share:.0%}",
                    f"{row.ns_max / 1e9:,.0f}" if row.ns_max else "-",
                    f"{row.ns_max / row.ns_mean:.2f}" if row.ns_mean else "-", mt.human_bytes(row.state_max),
                    ms(row.comm_s), ms(row.compute_s), ms(row.step_s), ms(row.overlap_s), versus,
                    f"{row.step_s / (fwd_bwd + row.step_s):.1%}"])
    return mt.format_table(HEADER, out, ["<"] + [">"] * (len(HEADER) - 1))


def predict(s, cluster, strategies=None):
    """(rows, fwd_bwd seconds, costs) of one scenario."""
    costs = predict_costs(s, cluster, strategies)
    return [summarize(c, cluster) for c in costs.values()], forward_backward_seconds(s, cluster), costs


def scenario_title(s, cluster):
    m = s.model
    layout = f"EP {s.ep}, FSDP2 over the rest" if s.ep else f"DP {s.dp} x TP {s.tp}"
    return (f"{m.name}: {m.total_params() / 1e9:,.2f} B parameters ({m.active_params() / 1e9:,.2f} B active), "
            f"{s.gpus} GPUs ({s.gpus // cluster.gpus_per_node} node{'s' * (s.gpus > cluster.gpus_per_node)}), "
            f"{layout}, {m.tokens / 1e6:,.1f}M tokens a step")


CHAPTER = [Scenario(MODELS["gpt2-small"], 8)] + \
    [Scenario(MODELS[m], g, tp=8, normuon=m == "llama3-70b") for m in ("llama3-8b", "llama3-70b") for g in (64, 512)] + \
    [Scenario(MODELS["deepseek-v3"], g, ep=64, normuon=g == 1024) for g in (256, 512, 1024, 2048)] + \
    [Scenario(MODELS["kimi-k2"], 2048, ep=64)]
# Newton-Schulz scaling (figure 2): the same models over more GPUs.
SCALING = {"llama3-70b": [64, 128, 256, 512, 1024], "deepseek-v3": [256, 512, 1024, 2048]}


def chapter(json_path=None, figure_path=None, cluster=H100, print_fn=print):
    """Every table of notes/12-cost-model.md, printed; their figures in a JSON and a PNG (figure())."""
    results = []
    print_fn(f"Cluster: {cluster.name}")
    for line in cluster.sources:
        print_fn(f"  * {line}")
    for s in CHAPTER:
        t0 = time.perf_counter()
        rows, fwd_bwd, _ = predict(s, cluster)
        print_fn(f"\n{scenario_title(s, cluster)}; forward + backward {ms(fwd_bwd)} ms "
                 f"(planned in {time.perf_counter() - t0:.0f} s)")
        print_fn(format_rows(rows, fwd_bwd))
        results.append(dict(model=s.model.name, gpus=s.gpus, tp=s.tp, ep=s.ep, fwd_bwd_s=fwd_bwd,
                            rows=[vars(r) for r in rows]))
    scaling = ns_scaling(cluster, print_fn)
    one_node = small_batch(cluster, print_fn)
    mt.write_json(json_path, dict(cluster=vars(cluster), scenarios=results, ns_scaling=scaling, one_node=one_node))
    if figure_path:
        figure(results, scaling, figure_path)
    return results


def ns_scaling(cluster, print_fn):
    """Newton-Schulz per rank over more GPUs: the busiest rank (max) against the mean, for the owner-based
    optimizers; the floor is the largest matrix one rank must do alone."""
    out = {}
    print_fn("\nNewton-Schulz per GPU as GPUs grow (one owner per matrix): busiest rank vs mean, GFLOP")
    rows = []
    for name, gpus in SCALING.items():
        model = MODELS[name]
        for g in gpus:
            s = Scenario(model, g, ep=64) if model.experts else Scenario(model, g, tp=8)
            labels = ("DTensorMuon",) if model.experts else ("owner", "DTensorMuon")
            for label, cost in predict_costs(s, cluster, labels).items():
                largest = max(dm.newton_schulz_flops(p.shape[-2:]) for p in model.params() if p.group == "muon")
                row = dict(model=model.name, gpus=g, optimizer=label, max=max(cost.ns_flops),
                           mean=sum(cost.ns_flops) / g, largest=largest)
                out.setdefault(f"{model.name}, {label}", []).append(row)
                rows.append([model.name, g, label, f"{row['max'] / 1e9:,.0f}", f"{row['mean'] / 1e9:,.0f}",
                             f"{row['max'] / row['mean']:.2f}", f"{largest / 1e9:,.0f}",
                             ms(row["max"] / (cluster.ns_tflops * 1e12))])
    print_fn(mt.format_table(["model", "GPUs", "optimizer", "max", "mean", "max/mean", "largest matrix",
                              "max ms"], rows, ["<", ">", "<", ">", ">", ">", ">", ">"]))
    return out


# One node, a small batch: marin's MoE on 8 H100s (marin-community/marin issue 6979, its MFU table, rows 6 and 7: the
# same run with Muon's momentum only, then with Newton-Schulz). Their MFU counts attention as Model.train_flops does.
MARIN_MFU = (0.344, 0.307)  # without, with Newton-Schulz
MARIN_SEQS = (2048, 4096)  # the sequence length assumed (MARIN), and the May recipe's (issue 6044), batch 168 alike


def mfu_with(mfu_without, fwd_bwd, extra):
    """The MFU of a step that takes `extra` seconds more than a forward + backward of fwd_bwd seconds run at
    mfu_without: the same FLOPs over a longer time."""
    return mfu_without * fwd_bwd / (fwd_bwd + extra)


def small_batch(cluster, print_fn):
    """marin's one-node, small-batch MoE (MARIN): their MFU without Newton-Schulz gives the forward + backward's time,
    DTensorMuon's plan on their layout (EP1: FSDP over the 8 GPUs, experts too) the time Newton-Schulz adds (its
    exchange and the busiest rank's Newton-Schulz; the momentum is in both runs), and the MFU that leaves, beside
    theirs; and, for scale, the same if every GPU orthogonalized every matrix (no owner)."""
    without, measured = MARIN_MFU
    rate = replace(cluster, train_tflops=without * cluster.peak_tflops)
    print_fn("\nOne node, a small batch: marin's d2560 MoE on 8 H100s, its MFU with Muon's momentum only and with "
             "Newton-Schulz (marin-community/marin issue 6979, rows 6 and 7 of its MFU table)")
    print_fn(f"  * shapes and batch: {MODELS['marin-moe-d2560'].source}")
    print_fn(f"  * the forward + backward at their {without:.1%} MFU without Newton-Schulz, its FLOPs (6 x active "
             f"parameters + attention) x tokens as their MFU counts them; Newton-Schulz adds DTensorMuon's exchange and "
             f"the busiest rank's Newton-Schulz at {rate.ns_tflops:,.0f} TFLOP/s, no overlap; they measured "
             f"{measured:.1%} with it; \"replicated\": every GPU orthogonalizing every matrix, no owner, for scale")
    table, out = [], []
    for seq in MARIN_SEQS:
        model = replace(MODELS["marin-moe-d2560"], seq=seq, tokens=168 * seq)
        s = Scenario(model, 8, ep=1)
        fwd_bwd = forward_backward_seconds(s, rate)
        cost = predict_costs(s, rate, ("DTensorMuon",))["DTensorMuon"]
        row = summarize(cost, rate)
        ns = row.ns_max / (rate.ns_tflops * 1e12)
        every = cost.single_device_flops / (rate.ns_tflops * 1e12)
        predicted, replicated = mfu_with(without, fwd_bwd, row.comm_s + ns), mfu_with(without, fwd_bwd, every)
        out.append(dict(seq=seq, tokens=model.tokens, train_flops=model.train_flops(), fwd_bwd_s=fwd_bwd,
                        comm_s=row.comm_s, ns_s=ns, every_rank_ns_s=every, mfu_predicted=predicted,
                        mfu_every_rank=replicated, mfu_measured=measured, mfu_without=without))
        table.append([f"{seq:,}" + (" (assumed)" if seq == MODELS["marin-moe-d2560"].seq else ""), f"{model.tokens:,}",
                      f"{model.train_flops() / 1e15:,.2f}", ms(fwd_bwd), mt.human_bytes(row.sent_max), ms(row.comm_s),
                      ms(ns), f"{predicted:.1%}", ms(every), f"{replicated:.1%}", f"{measured:.1%}"])
    print_fn(mt.format_table(["sequence", "tokens", "fwd+bwd PFLOP", "fwd+bwd ms", "sent/rank", "comm ms", "NS ms",
                              "MFU predicted", "replicated NS ms", "MFU replicated", "MFU measured"], table,
                             ["<"] + [">"] * 10))
    return out


def figure(results, scaling, path):
    """Three panels: the predicted step of every optimizer for Llama-3-70B-like and the MoE at each size, and
    Newton-Schulz per rank (busiest and mean) as GPUs grow, the largest matrix dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(19, 6.2))
    for ax, name in zip(axes, ("Llama-3-70B-like", "DeepSeek-V3-like MoE")):
        runs = [r for r in results if r["model"] == name]
        # NorMuon's rows are Muon's within a few percent, AdamW's flat buffer its bucketed one's: left to the tables
        labels = [r["label"] for r in runs[0]["rows"] if not r["label"].endswith(NORMUON)
                  and r["label"] != "AdamW ZeRO-1" + FLAT]
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            steps = [next(x for x in r["rows"] if x["label"] == label)["step_s"] * 1e3 for r in runs]
            ax.bar([j + i * width for j in range(len(runs))], steps, width, label=label, color=plt.cm.tab10(i))
        ax.plot([j + 0.4 - width / 2 for j in range(len(runs))], [r["fwd_bwd_s"] * 1e3 for r in runs], "k_",
                markersize=30, label="forward + backward")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(runs))], [f"{r['gpus']} GPUs" for r in runs])
        ax.set_yscale("log")
        ax.set_ylabel("predicted ms per step (no overlap)")
        ax.set_title(name)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4)
    ax = axes[2]
    for key, rows in scaling.items():
        gpus = [r["gpus"] for r in rows]
        line, = ax.plot(gpus, [r["max"] / 1e9 for r in rows], marker="o", label=f"{key}: busiest rank")
        ax.plot(gpus, [r["mean"] / 1e9 for r in rows], linestyle="--", color=line.get_color(), label=f"{key}: mean")
        ax.axhline(rows[0]["largest"] / 1e9, color=line.get_color(), linestyle=":", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("Newton-Schulz GFLOP per rank per step")
    ax.set_title("Where Newton-Schulz stops scaling (dotted: the largest matrix)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    mt.save_figure(fig, path, dpi=90)
    plt.close(fig)


# =============================================================================
# 7. This machine, measured: the model fed what --check-here measures here (the library's own collectives, Newton-
#    Schulz and elementwise steps, each at a tiny size and at the step's), against steps measured on 1, 2 and 4
#    processes (benchmarks/scaling.py's model and timing)
# =============================================================================
# What a step costs beyond its bytes and FLOPs is mostly per call: a collective's fixed cost (Gloo's rendezvous, the
# library's wrapper), a Newton-Schulz call's (a dozen small ops), a parameter part's elementwise step, and the step's
# own Python around every parameter (its bookkeeping: the vote, the buffers, the loops). Each is measured here, the
# least disturbed of many tries (the minimum, as the steps are compared by their minimum), and priced per call as the
# plan counts the calls; the bookkeeping per parameter alone is fitted, from each optimizer's step at d = TINY_D, where
# every size-dependent term is a few percent of it. Ranks that outnumber the cores share them ("shared cores").

CHECK_RANKS = (1, 2, 4)
CHECK_ROUNDS = 15  # steps of every variant, interleaved; the minimum of 15 is steadier than of 5 on a shared machine
TINY_D = 8  # the width at which a step is its per-call costs
PROBE_NUMELS = (1, 1 << 15, 1 << 17)  # float32 elements a rank sends a peer: a tiny call, a 64K-element bucket's
# shard (the step's), and 4 times that (for the bandwidth's fit)
PROBE_REPEATS = 25
UNIT_REPEATS = 200
NS_ROUNDS = 20  # rounds of Newton-Schulz on the model's shapes, alone and all at once: about 0.1 s alone at d = 128
NS_REPEATS = 3
BAND = 0.25  # the issue's: predicted within 25 % of the least disturbed step


def probe_rank(rank, world, port, out_dir, shapes):
    """One of `world` ranks: {op: [(bytes the Ledger counts for the call, typical seconds, typical CPU seconds of the
    process, Gloo's threads included)] at each of PROBE_NUMELS} of the library's own collectives (the lesson's
    all_gather, reduce_scatter and all_reduce, section 7's exchange); and the seconds of NS_ROUNDS rounds of
    Newton-Schulz on `shapes`, rank 0 alone, then every rank at once (sharing the cores, and their matrix units)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    axis, ledger, out = dm.make_grid(world, 1, rank).dp, dm.Ledger(), {}
    for n in PROBE_NUMELS:
        shard, bucket = torch.ones(n), torch.ones(n * world)
        sends, receive = [[torch.ones(n)] if i != rank else [] for i in range(world)], [n * (i != rank) for i in range(world)]
        calls = {"all_gather": lambda: dm.all_gather(shard, axis, ledger, "probe"),
                 "reduce_scatter": lambda: dm.reduce_scatter(bucket, axis, ledger, "probe"),
                 "all_reduce": lambda: dm.all_reduce(shard.clone(), axis, ledger, "probe"),
                 "all_to_all": lambda: mo.exchange(sends, receive, axis, ledger, "probe", FP32, "cpu")()}
        for op, call in calls.items():
            samples, cpu = [], []
            for _ in range(PROBE_REPEATS):
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            last = ledger.comm[-1]
            out.setdefault(op, []).append((max(last["sent"], last["received"]), statistics.median(samples),
                                           statistics.median(cpu)))
    matrices = [torch.randn(s) for s in shapes]

    def rounds():
        t0 = time.perf_counter()
        for _ in range(NS_ROUNDS):
            for m in matrices:
                dm.newton_schulz(m)
        return time.perf_counter() - t0

    rounds()  # warm up (the first calls of a shape allocate)
    alone, together = [], []
    for _ in range(NS_REPEATS):  # the least disturbed of each
        dist.barrier()
        alone.append(rounds() if rank == 0 else 0.0)
        dist.barrier()
        together.append(rounds())
    out["newton-schulz"] = (min(alone), min(together))
    mt.write_atomically(os.path.join(out_dir, f"{rank}.pt"), lambda f: torch.save(out, f))
    dist.destroy_process_group()


def fit_line(points):
    """(intercept us, GB/s) of seconds against bytes, least squares through (bytes, seconds) points; a slope the
    noise made negative is none (infinite GB/s)."""
    n = len(points)
    mean_b, mean_t = sum(b for b, _ in points) / n, sum(t for _, t in points) / n
    slope = (sum((b - mean_b) * (t - mean_t) for b, t in points)
             / max(sum((b - mean_b) ** 2 for b, _ in points), 1e-30))
    if slope <= 0:
        return mean_t * 1e6, math.inf
    return max(mean_t - slope * mean_b, 0.0) * 1e6, 1 / slope / 1e9


def collective_costs(world, shapes):
    """({op: ((us a call, GB/s), (CPU us a call, CPU GB/s))}, Newton-Schulz's slowdown) on `world` ranks here, the
    slowest rank's: a collective's fixed cost and its bandwidth, fitted to its typical times at PROBE_NUMELS,
    in time and in the CPU a rank's process spends (its own and Gloo's threads: what the ranks take from each other's
    compute where they share cores); how many times longer Newton-Schulz takes when every rank runs it at once than
    on one rank alone (probe_rank)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mt.run_processes(probe_rank, (world, mt.free_port(), out_dir, shapes), world, folders=(out_dir,))
        ranks = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]
    ops = [op for op in ranks[0] if op != "newton-schulz"]
    costs = {op: tuple(fit_line([(b, max(r[op][i][k] for r in ranks)) for i, (b, *_) in enumerate(ranks[0][op])])
                       for k in (1, 2)) for op in ops}
    return costs, max(r["newton-schulz"][1] for r in ranks) / ranks[0]["newton-schulz"][0]


def typical_seconds(call, repeats=UNIT_REPEATS):
    """The median seconds of `repeats` calls: a step makes many such calls, and its least disturbed run is a sum of
    typical ones, not of the fastest."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def unit_costs(specs):
    """This process's (one thread) per-call costs and rates, each the median of many calls, with the library's own
    functions: Newton-Schulz on a 2 x 2 matrix (its fixed cost) and on every matrix shape of `specs` (its rate, that
    fixed cost aside), one part's Muon step (muon_update, then apply_muon_update_) and AdamW step (adamw_step_) on one
    element, applying an update alone, and an fp32 lerp_ (12 bytes an element) for the elementwise bandwidth."""
    torch.set_num_threads(1)
    group = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=None)
    adamw = dict(lr=0.02, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    tiny = torch.randn(2, 2)
    ns_call = typical_seconds(lambda: dm.newton_schulz(tiny))
    shapes = ns_shapes(specs)
    flops = sum(dm.newton_schulz_flops(s) for s in shapes)
    ns = sum(typical_seconds(lambda m=torch.randn(s): dm.newton_schulz(m), 20) for s in shapes) - len(shapes) * ns_call
    one, buf, p = torch.randn(1), torch.zeros(1), torch.zeros(1)
    state = dict(step=torch.tensor(0.0), exp_avg=torch.zeros(1), exp_avg_sq=torch.zeros(1))
    n = 1 << 22
    a, b = torch.randn(n), torch.randn(n)
    return dict(ns_tflops=flops / max(ns, 1e-9) / 1e12, ns_call_us=ns_call * 1e6,
                muon_part_us=typical_seconds(lambda: dm.apply_muon_update_(p, dm.muon_update(buf, one, group), group,
                                                                           (1, 1))) * 1e6,
                adamw_part_us=typical_seconds(lambda: adamw_step_(p, one, state, adamw)) * 1e6,
                apply_us=typical_seconds(lambda: dm.apply_muon_update_(p, one, group, (1, 1))) * 1e6,
                hbm_gbs=12 * n / typical_seconds(lambda: a.lerp_(b, 0.05), 7) / 1e9)


def ns_shapes(specs):
    """The distinct shapes of the matrices Newton-Schulz takes."""
    return sorted({s.global_shape for s in specs if s.group == "muon"})


def gloo_threads():
    """The worker threads on which Gloo runs a process group's collectives: torch's default, from ProcessGroupGloo's
    options (a private field: 2, its value in torch 2.14, if it moved)."""
    try:
        return dist.ProcessGroupGloo._Options()._threads
    except AttributeError:
        return 2


def this_machine(units, collectives, ns_shared, world):
    """A Cluster of this machine's measured figures for a run of `world` ranks, all on one "node" (Gloo over
    loopback): each collective's fixed cost and bandwidth (collective_costs), the latency of its messages inside the
    former; the unit costs of this process (unit_costs); Newton-Schulz's slowdown when every rank runs it at once."""
    call_us = tuple((op, us) for op, ((us, _), _) in sorted(collectives.items()))
    op_gbs = tuple((op, gbs) for op, ((_, gbs), _) in sorted(collectives.items()))
    cpu_call_us = tuple((op, us) for op, (_, (us, _)) in sorted(collectives.items()))
    cpu_gbs = tuple((op, gbs) for op, (_, (_, gbs)) in sorted(collectives.items()))
    gbs = dict(op_gbs).get("all_to_all", 1.0)
    # the lesson's unfused ops: Muon 48 bytes an element (lerp_ 12, lerp 12, bf16 cast 6, decay 8, add_ 10),
    # torch's single-tensor AdamW 80 (mul_ 8, lerp_ 12, mul_ 8, addcmul_ 12, sqrt / div / add_ 24, addcdiv_ 16)
    return Cluster(f"this machine: {world} Gloo rank{'s' * (world > 1)} on {os.cpu_count()} cores", gpus_per_node=64,
                   intra_gbs=gbs, inter_gbs=gbs, intra_us=0.0, inter_us=0.0, train_tflops=1.0, muon_bytes=48,
                   adamw_bytes=80, call_us=call_us, op_gbs=op_gbs, cpu_call_us=cpu_call_us, cpu_gbs=cpu_gbs,
                   ns_shared=ns_shared, cores=os.cpu_count() or 1, in_flight=gloo_threads(), **units)


def scaling_specs(d, layers):
    """benchmarks/scaling.py's model as the lesson's ParamSpecs (TP = 1: nothing is split)."""
    import scaling

    matrices, vectors = scaling.shapes(d, layers)
    return [dm.ParamSpec(n, s, -1, "muon") for n, s in matrices.items()] + \
        [dm.ParamSpec(n, s, -1, "adamw") for n, s in vectors.items()]


def check_costs(specs, ranks):
    """{variant: Cost} of scaling.py's variants on `ranks` ranks (DP = ranks), and torch's step on one."""
    import scaling

    node_of = lambda r: 0  # noqa: E731  -- one machine
    costs = {}
    if ranks == 1:
        costs[scaling.TORCH] = lesson_cost(lesson_optimizer(specs, mt.RunConfig(dp=1, tp=1)), node_of, scaling.TORCH)
    for variant, (strategy, options) in scaling.VARIANTS.items():
        # (RunConfig's bucket_size is DistributedMuon's default, which scaling.py's optimizers take)
        cfg = mt.RunConfig(dp=ranks, tp=1, strategy=strategy, overlap=options.get("overlap", 0))
        costs[variant] = lesson_cost(lesson_optimizer(specs, cfg), node_of, variant)
    for cost in costs.values():  # every rank's step walks every parameter (its bookkeeping: Cluster.param_us)
        cost.calls["params"] = [len(specs)] * cost.world
    return costs


def predicted(row, ranks, variant):
    """The model's step: communication + compute; with --overlap on more than one rank, Row.overlap_s (the largest of
    communication over the collectives in flight at once, compute, and the shared cores' floor)."""
    import scaling

    return row.overlap_s if scaling.VARIANTS.get(variant, (None, {}))[1].get("overlap") and ranks > 1 else row.step_s


TERMS = ("bandwidth", "calls", "NS FLOPs", "NS calls", "elementwise", "parts", "bookkeeping", "shared cores")


def check_here(d, layers, rounds, print_fn=print):
    """Predicted against measured: torch's step in one process and every strategy of scaling.py on 1, 2 and 4 ranks,
    each term of the prediction shown."""
    import scaling

    load = os.getloadavg()[0]
    specs, tiny_specs = scaling_specs(d, layers), scaling_specs(TINY_D, layers)
    units = unit_costs(specs)
    measured = {1: scaling.on_one_process(d, layers, rounds)}
    tiny = scaling.on_one_process(TINY_D, layers, rounds)
    machines = {1: this_machine(units, {}, 1.0, 1)}
    for ranks in CHECK_RANKS[1:]:
        machines[ranks] = this_machine(units, *collective_costs(ranks, ns_shapes(specs)), ranks)
        measured[ranks] = scaling.on_ranks(ranks, d, layers, rounds=rounds)
    # the bookkeeping per parameter, fitted: what each variant's least disturbed step at d = TINY_D leaves unexplained
    param_us = {}
    for variant, cost in check_costs(tiny_specs, 1).items():
        modeled = summarize(cost, machines[1]).step_s
        param_us[variant] = max(min(tiny[variant]) / 1e3 - modeled, 0.0) / len(tiny_specs) * 1e6
    print_fn(f"This machine: {os.cpu_count()} cores; torch {torch.__version__}; {layers} layers at d = {d} "
             f"(benchmarks/scaling.py's model, {len(specs)} parameters), {rounds} interleaved steps of each, the slowest "
             f"rank's; load average {load:.1f} at the start (other jobs share the cores: the minimum is the least "
             f"disturbed step, the median feels them)")
    print_fn(f"  * Newton-Schulz: {units['ns_tflops'] * 1e3:.1f} GFLOP/s on the model's shapes (bf16, one thread), "
             f"{units['ns_call_us']:.0f} us a call (a 2 x 2 matrix)")
    print_fn(f"  * a part's elementwise step: Muon {units['muon_part_us']:.0f} us, AdamW {units['adamw_part_us']:.0f} us, "
             f"an update applied {units['apply_us']:.0f} us; fp32 lerp_ {units['hbm_gbs']:.1f} GB/s")
    for ranks in CHECK_RANKS[1:]:
        m = machines[ranks]
        ops = ", ".join(f"{op} {us:.0f} us + {gbs:.2f} GB/s (CPU {cpu:.0f} us + {cpu_gbs:.2f} GB/s)"
                        for (op, us), (_, gbs), (_, cpu), (_, cpu_gbs) in zip(m.call_us, m.op_gbs, m.cpu_call_us, m.cpu_gbs))
        print_fn(f"  * {ranks} ranks: the library's collectives, a call + its bytes: {ops}; Newton-Schulz "
                 f"{m.ns_shared:.2f} x as long when every rank runs it at once")
    print_fn(f"  * bookkeeping, fitted at d = {TINY_D} (per parameter, every rank): "
             + ", ".join(f"{v} {us:.0f} us" for v, us in param_us.items()))
    table, errors, outside = [], [], []
    for ranks in CHECK_RANKS:
        for variant, cost in check_costs(specs, ranks).items():
            row = summarize(cost, replace(machines[ranks], param_us=param_us[variant]))
            guess, times = predicted(row, ranks, variant), measured[ranks][variant]
            least, median = min(times) / 1e3, statistics.median(times) / 1e3
            errors.append((guess / least - 1, guess / median - 1))
            if abs(guess / least - 1) > BAND:  # (the calls of the busiest rank: every rank makes as many here)
                outside.append((ranks, variant, least - guess, least,
                                max(map(sum, zip(*cost.traffic.calls_table().values())), default=0)))
            table.append([ranks, variant] + [ms(row.terms[t]) for t in TERMS]
                         + [ms(guess), ms(least), ms(median), f"{guess / least - 1:+.0%}", f"{guess / median - 1:+.0%}"])
    print_fn(mt.format_table(["ranks", "step"] + [f"{t} ms" for t in TERMS]
                             + ["predicted ms", "min ms", "median ms", "vs min", "vs median"], table,
                             [">", "<"] + [">"] * (len(TERMS) + 5)))
    print_fn(f"(predicted: the sum of the terms; with --overlap on 2 or more ranks, the largest of communication "
             f"(bandwidth + calls) over Gloo's {gloo_threads()} worker threads, compute (NS to bookkeeping), and the "
             f"shared cores' floor)")
    for i, what in enumerate(("minimum", "median")):
        print_fn(f"|error| against the {what}: median {statistics.median(abs(e[i]) for e in errors):.0%}, largest "
                 f"{max(abs(e[i]) for e in errors):.0%}")
    for ranks, variant, missing, least, calls in outside:
        per_call = (f"; as the one term left, a collective's cost inside a step beyond the probe's: "
                    f"{missing / calls * 1e6:+,.0f} us on each of its {calls} calls" if calls else "")
        print_fn(f"outside +-{BAND:.0%}: {ranks} rank{'s' * (ranks > 1)}, {variant}: {missing * 1e3:+,.1f} ms unexplained "
                 f"({missing / least:+.0%} of its least disturbed step){per_call}")
    return table


# =============================================================================
# 8. The command line
# =============================================================================

# The model plans every rank: here 16,384 GPUs took 41 s and 1.8 GB, 65,536 took 191 s and 4 GB. 16,384 H100s
# is the largest training run the chapter cites (Llama 3 405B's, "The Llama 3 Herd of Models", section 3.3).
MAX_GPUS = 16384
PREDICTION_OPTIONS = ("model", "gpus", "tp", "ep", "normuon")  # one scenario's; --chapter and --check-here take none
CHECK_OPTIONS = ("d", "layers", "rounds")  # --check-here's


def main(argv=None):
    p = mt.OneLineParser(description="Predict a distributed Muon step on a cluster from the project's own plans.")
    p.add_argument("--model", choices=sorted(MODELS), help="the model (default llama3-8b)")
    p.add_argument("--gpus", type=int, help="GPUs (default 64)")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default 8; 1 for an MoE)")
    p.add_argument("--ep", type=int, default=None, help="expert parallel size of an MoE (default 64)")
    p.add_argument("--normuon", action="store_true",
                   help="add NorMuon's rows: owner, comm-free and DTensorMuon with their matrices on NorMuon")
    p.add_argument("--chapter", action="store_true", help="every table and figure of notes/12-cost-model.md")
    p.add_argument("--json", metavar="PATH", help="--chapter: write its figures as JSON")
    p.add_argument("--figure", metavar="PATH", help="--chapter: write its three plots as a PNG")
    p.add_argument("--check-here", action="store_true", help="this machine's measured steps against the model")
    p.add_argument("--d", type=int, help="--check-here: model width (default 128)")
    p.add_argument("--layers", type=int, help="--check-here: layers (default 4)")
    p.add_argument("--rounds", type=int, help=f"--check-here: timed steps of each (default {CHECK_ROUNDS})")
    args = p.parse_args(argv)
    given = lambda names: [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]  # noqa: E731
    if args.chapter and args.check_here:
        p.error("--chapter and --check-here are two runs: give one")
    if (args.chapter or args.check_here) and given(PREDICTION_OPTIONS):
        p.error(f"{' '.join(given(PREDICTION_OPTIONS))}: one scenario's options, not --chapter's or --check-here's")
    if given(CHECK_OPTIONS) and not args.check_here:
        p.error(f"{' '.join(given(CHECK_OPTIONS))}: only with --check-here (they size its model)")
    if (args.json or args.figure) and not args.chapter:
        p.error("--json and --figure go with --chapter")
    for path, option in ((args.json, "--json"), (args.figure, "--figure")):
        if path:
            try:
                mt.check_writable(path, option)
            except ValueError as e:
                p.error(str(e))
    if args.chapter:
        chapter(args.json, args.figure)
        return 0
    if args.check_here:
        d, layers, rounds = (v if v is not None else default for v, default in
                             zip((args.d, args.layers, args.rounds), (128, 4, CHECK_ROUNDS)))
        if d < 1 or layers < 1 or rounds < 1:
            p.error("--d, --layers and --rounds must be >= 1")
        import scaling

        why = scaling.memory_error(d, layers, max(CHECK_RANKS))
        if why:
            p.error(why)
        check_here(d, layers, rounds)
        return 0
    model = MODELS[args.model or "llama3-8b"]
    gpus = args.gpus if args.gpus is not None else 64
    tp = args.tp if args.tp is not None else (1 if model.experts else 8)
    ep = (args.ep if args.ep is not None else 64) if model.experts else 0
    if gpus < 1 or tp < 1 or (model.experts and (ep < 1 or tp != 1)):
        p.error("--gpus and --tp must be >= 1; an MoE takes --ep >= 1 and no TP")
    if gpus > MAX_GPUS:
        p.error(f"--gpus {gpus}: at most {MAX_GPUS} (the model plans every rank: Llama 3 405B's 16,384 GPUs take 41 s)")
    if args.ep is not None and not model.experts:
        p.error(f"--ep applies to an MoE; {model.name} is dense")
    s = Scenario(model, gpus, tp=tp, ep=ep, normuon=args.normuon)
    try:
        rows, fwd_bwd, _ = predict(s, H100)
    except ValueError as e:
        p.error(str(e))
    print(f"{scenario_title(s, H100)}; forward + backward {ms(fwd_bwd)} ms\nCluster: {H100.name}")
    print(format_rows(rows, fwd_bwd))
    return 0


if __name__ == "__main__":
    sys.exit(mt.exit_code(main))
