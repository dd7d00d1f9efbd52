"""What a distributed Muon step costs on a cluster, predicted from the project's own plans (notes/12-cost-model.md).

Give it a model (layers, d_model, heads and KV heads, FFN width, vocabulary, experts) and a cluster (GPUs per
node, link bandwidths and latencies, bf16 rates). It builds the layout each optimizer itself would build, on
a virtual grid, with no process and no memory:

  * the lesson's strategies, gather (and its Gram form), owner and comm-free, and the AdamW ZeRO-1 baseline:
    the optimizer class itself, constructed as muon_tools.plan_optimizer constructs it, over parameters on
    PyTorch's meta device; so its virtual buffer is plan_layout's, its owners assign_owners', its routes
    plan_routes' and its chunks CommFreeMuon's own;
  * DTensorMuon over FSDP2 x TP x EP: each parameter's copies placed as fully_shard and parallelize_module
    place them (section 3: the rules, which the test checks against real FSDP2 runs), its owners by its own
    rule (assign_among_holders), each piece's size along each tensor dim by its own local_indices.

From the plans it counts, for every rank, what the Ledger would count (bytes of every collective phase),
the Newton-Schulz FLOPs, the optimizer state and the elementwise work, and it prices them: each collective
by an alpha-beta model on the links it crosses, compute at the cluster's rates; the step without overlap
(the sum) and with perfect overlap (the larger of communication and compute); beside AdamW's step on the
same layout and beside the forward + backward of the same step (6 x active parameters x tokens FLOPs).
tests/test_cost_model.py proves the bytes, FLOPs and state equal real runs' Ledgers on every grid the tests
run; --check-here compares the times with steps measured on this machine.

    python benchmarks/cost_model.py --model llama3-70b --gpus 512 --tp 8       # one table, H100 figures
    python benchmarks/cost_model.py --model deepseek-v3 --gpus 1024 --ep 64
    python benchmarks/cost_model.py --chapter --json c.json --figure c.png    # notes/12's tables and figures
    python benchmarks/cost_model.py --check-here                              # predicted vs measured, this CPU

Sections: 1. models, 2. clusters, 3. the plans (lesson and DTensor), 4. traffic and its price,
5. one prediction, 6. tables and figures, 7. this machine, measured, 8. the command line.
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
import distmuon.dtensor as dd  # noqa: E402
import distmuon.dtensor.placements as dplace  # noqa: E402
import distmuon.dtensor.plan as dplan  # noqa: E402
import distmuon.large_runs as mlr  # noqa: E402
import distmuon.owners as mo  # noqa: E402
import muon_tools as mt  # noqa: E402

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
    head_dim: int = 0  # 0: d / heads
    gpt2: bool = False  # GPT-2: fused qkv, GELU MLP, biases, learned positions, head tied to the embedding
    positions: int = 1024
    experts: int = 0  # routed experts per MoE layer (0: dense)
    expert_ffn: int = 0
    top_k: int = 0
    shared_experts: int = 0
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
                shared = self.shared_experts * self.expert_ffn
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


LLAMA3 = ("Llama 3 (arXiv 2407.21783, Table 3: layers, width, FFN, heads, 8 KV heads, vocabulary 128,256); "
          "batch: 4M tokens, Llama 3 405B's initial batch (its section 3.4.1), assumed here")
DEEPSEEK = ("DeepSeek-V3 (arXiv 2412.19437, section 4.2: 61 layers, d 7,168, MLA with 128 heads, q / kv ranks "
            "1,536 / 512, 1 shared + 256 routed experts of width 2,048, 8 active, first 3 layers dense, vocabulary "
            "129K; batch 15,360 x 4,096 tokens at its largest)")
KIMI = ("Kimi K2 (arXiv 2507.20534: DeepSeek-V3's shapes with 384 experts, 64 attention heads, 1 dense layer, "
        "vocabulary 160K); batch assumed DeepSeek-V3's (not checked)")
MODELS = {
    "gpt2-small": Model("GPT-2 small", 12, 768, 12, 12, 3072, 50304, tokens=2**19, gpt2=True,
                        source="GPT-2 (Radford et al., 2019), vocabulary padded to 50,304 as nanoGPT does; batch "
                               "2^19 tokens, llm.c's GPT-2 (124M) reproduction (nanoGPT's is 491,520)"),
    "llama3-8b": Model("Llama-3-8B-like", 32, 4096, 32, 8, 14336, 128256, tokens=2**22, source=LLAMA3),
    "llama3-70b": Model("Llama-3-70B-like", 80, 8192, 64, 8, 28672, 128256, tokens=2**22, source=LLAMA3),
    "deepseek-v3": Model("DeepSeek-V3-like MoE", 61, 7168, 128, 128, 18432, 129280, tokens=15360 * 4096,
                         source=DEEPSEEK, experts=256, expert_ffn=2048, top_k=8, shared_experts=1, dense_layers=3,
                         mla=(1536, 512, 64, 128, 128)),
    "kimi-k2": Model("Kimi-K2-like MoE", 61, 7168, 64, 64, 18432, 163840, tokens=15360 * 4096, source=KIMI,
                     experts=384, expert_ffn=2048, top_k=8, shared_experts=1, dense_layers=1,
                     mla=(1536, 512, 64, 128, 128)),
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


H100_PEAK_TFLOPS = 989.4  # dense bf16, H100 SXM (NVIDIA H100 Tensor Core GPU datasheet)
H100 = Cluster(
    "H100 SXM, 8 per node (NVLink 4 inside, 8 x 400 Gb/s InfiniBand NDR between nodes)", 8,
    intra_gbs=0.8 * 450, inter_gbs=0.8 * 50, intra_us=3.0, inter_us=8.0,
    ns_tflops=0.6 * H100_PEAK_TFLOPS, train_tflops=0.4 * H100_PEAK_TFLOPS, hbm_gbs=0.8 * 3350,
    muon_bytes=24, adamw_bytes=28,
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


# The pieces of a Copy, along each tensor dim apart: a Shard or _StridedShard cuts one dim, so a rank's local
# tensor is the product of one index set per dim, each found by DTensorMuon's own local_indices on that dim
# alone (what plan_matrices finds on the whole index tensor, one int64 per element: at Llama-70B's size it
# would not fit; tests/test_cost_model.py checks the two agree).

def on_dim(placements, dim):
    """The placements as they act on tensor dim `dim` of a 1-D tensor: those that cut it, the others Replicate."""
    return tuple((_StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0))
                 if isinstance(p, dplace.SHARD_PLACEMENTS) and p.dim == dim else Replicate() for p in placements)


@functools.lru_cache(maxsize=None)
def coordinates(mesh_shape):
    """Every coordinate of a mesh, row-major: the order of its ranks (and of copy_pieces)."""
    return [tuple(c) for c in torch.cartesian_prod(*[torch.arange(s) for s in mesh_shape]).view(-1, len(mesh_shape))
            .tolist()]


@functools.lru_cache(maxsize=None)
def dim_indices(size, mesh_shape, placements):
    """{where the mesh dims that cut it sit: [indices held there]} along one tensor dim of `size` (placements:
    on_dim's), for every coordinate at once: torch.chunk, one mesh dim after another in DTensorMuon's
    split_order, as its local_indices applies it for one coordinate (the test checks they agree)."""
    level = {(): torch.arange(size)}
    for i in dplace.split_order(placements):  # keys: ((mesh dim, coordinate), ...) in cut order, sorted below
        level = {at + ((i, c),): chunk for at, index in level.items()
                 for c, chunk in enumerate(dplace.chunks_with_empty(index, mesh_shape[i]))}
    return {tuple(c for _, c in sorted(at)): index.tolist() for at, index in level.items()}


@functools.lru_cache(maxsize=None)
def sized_pieces(shape, mesh_ranks, mesh_shape, placements):
    """[(key, [holder ranks], [indices along each tensor dim])] of a copy, one per distinct piece, in copy_pieces'
    order; found once for all the copies of the same shape on the same mesh with the same placements."""
    cut = dplace.sharded_dims(placements)
    per_dim = []
    for d, size in enumerate(shape):
        placed = on_dim(placements, d)
        per_dim.append(([i for i, p in enumerate(placed) if not isinstance(p, Replicate)],
                        dim_indices(size, mesh_shape, placed)))
    pieces = {}
    for rank, coordinate in zip(mesh_ranks, coordinates(mesh_shape)):
        key = tuple(coordinate[i] for i in cut)
        if key not in pieces:
            pieces[key] = (key, [], [table[tuple(coordinate[i] for i in dims)] for dims, table in per_dim])
        pieces[key][1].append(rank)
    return list(pieces.values())


def pieces_of(copy):
    return sized_pieces(copy.shape, copy.mesh_ranks, copy.mesh_shape, copy.placements)


@dataclass(frozen=True)
class MatrixPieces:
    """One matrix of a copy (an expert, or the whole 2-D parameter), as its pieces hold it."""
    holders: tuple
    pieces: tuple  # (key, ranks, elements of the matrix in the piece)
    ranks: torch.Tensor  # the one holder of each piece (None if a piece has replicas), and
    numels: torch.Tensor  # its elements


@functools.lru_cache(maxsize=None)
def matrix_pieces(shape, mesh_ranks, mesh_shape, placements, expert_stack):
    """{expert (-1: the whole 2-D matrix): MatrixPieces} of a copy's matrices that some rank holds part of."""
    per = {}
    for key, ranks, dims in sized_pieces(shape, mesh_ranks, mesh_shape, placements):
        rest = math.prod(len(i) for i in dims[1:]) if expert_stack else math.prod(len(i) for i in dims)
        for e in (dims[0] if expert_stack else [-1]) if rest else []:
            per.setdefault(e, []).append((key, tuple(ranks), rest))
    out = {}
    for e, pieces in per.items():
        single = all(len(ranks) == 1 for _, ranks, _ in pieces)
        out[e] = MatrixPieces(tuple(sorted({r for _, ranks, _ in pieces for r in ranks})), tuple(pieces),
                              torch.tensor([ranks[0] for _, ranks, _ in pieces]) if single else None,
                              torch.tensor([n for _, _, n in pieces]))
    return out


@dataclass
class SizedMatrix:
    name: str
    copy: object
    at: MatrixPieces
    owner: int = -1


def dtensor_plan(copies, group_ns_steps, world):
    """DTensorMuon's automatic plan (plan_matrices, without the Gram form) by sizes: [SizedMatrix], ns_flops,
    owners; its owners by its own rule (assign_among_holders), over the same matrices in the same order."""
    count = {}
    for c in copies:
        count[c.name] = count.get(c.name, 0) + 1
    matrices, none = [], MatrixPieces((), (), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    for c in copies:
        if c.local:
            continue
        per = matrix_pieces(c.shape, c.mesh_ranks, c.mesh_shape, c.placements, c.expert_stack)
        for e in range(c.n_matrices) if c.expert_stack else [-1]:
            matrices.append(SizedMatrix(dplan.matrix_name(c, e, count[c.name]), c, per.get(e, none)))
    ns_flops = {m.name: dm.newton_schulz_flops(m.copy.matrix_shape, group_ns_steps[m.copy.group]) for m in matrices}
    owners = dplan.assign_among_holders(ns_flops, {m.name: m.at.holders for m in matrices}, world,
                                     shapes={m.name: tuple(m.copy.matrix_shape) for m in matrices})
    for m in matrices:
        m.owner = owners[m.name]
    return matrices, ns_flops, owners


def dtensor_transfers(matrices):
    """(gather, scatter): (sources, destinations, elements) tensors of every matrix's transfers, as plan_matrices
    routes them: a piece goes to the owner from its holder that sits where the owner sits along the Replicate
    dims (rank_at; a piece with one holder: that one), and comes back to every holder."""
    gather, scatter = ([], [], []), ([], [], [])

    def add(into, sources, destinations, numels):
        for column, values in zip(into, (sources, destinations, numels)):
            column.append(torch.as_tensor(values, dtype=torch.int64))

    for m in matrices:
        at, owner = m.at, m.owner
        if at.ranks is not None:  # no replicas: each holder sends its piece, and gets it back
            add(gather, at.ranks, torch.full_like(at.ranks, owner), at.numels)
            add(scatter, torch.full_like(at.ranks, owner), at.ranks, at.numels)
            continue
        for key, ranks, numel in at.pieces:
            source = owner if owner in ranks else dplan.rank_at(m.copy, owner, key)
            add(gather, [source], [owner], [numel])
            add(scatter, [owner] * len(ranks), list(ranks), [numel] * len(ranks))
    cat = lambda columns: tuple(torch.cat(c) if c else torch.zeros(0, dtype=torch.int64) for c in columns)  # noqa: E731
    return cat(gather), cat(scatter)


@functools.lru_cache(maxsize=None)
def local_numels(shape, mesh_ranks, mesh_shape, placements, world):
    """Elements of the copy each rank holds: an int64 tensor over the world (0 off the copy's mesh; a plain
    tensor, mesh_ranks (), is whole everywhere)."""
    out = torch.zeros(world, dtype=torch.int64)
    if not mesh_ranks:
        return out + math.prod(shape)
    for _, ranks, dims in sized_pieces(shape, mesh_ranks, mesh_shape, placements):
        out[list(ranks)] = math.prod(len(i) for i in dims)
    return out


def held(copy, world):
    return local_numels(copy.shape, copy.mesh_ranks, copy.mesh_shape, copy.placements, world)


def state_and_elements(copies, algorithm_of, world):
    """(state bytes per rank, {"muon", "adamw": elements per rank}) of the copies each rank holds (its own column's):
    DTensorMuon's state is like the parameter, Muon's momentum fp32, AdamW's two moments and a 4-byte step."""
    state, elements = torch.zeros(world, dtype=torch.int64), {"muon": torch.zeros(world, dtype=torch.int64),
                                                              "adamw": torch.zeros(world, dtype=torch.int64)}
    for c in copies:
        n, algorithm = held(c, world), algorithm_of(c)
        on = torch.zeros(world, dtype=torch.int64)
        on[list(c.mesh_ranks or range(world))] = 1
        state += 4 * n if algorithm == "muon" else (8 * n + 4) * on
        elements[algorithm] += n
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

    def seconds(self, rank, cluster):
        out = 0.0
        for kind, (gbs, us) in {"intra": (cluster.intra_gbs, cluster.intra_us),
                                "inter": (cluster.inter_gbs, cluster.inter_us)}.items():
            sent, received, messages = (x[rank] for x in self.link[kind])
            out = max(out, messages * us * 1e-6 + max(sent, received) / (gbs * 1e9))
        return out


class Traffic:
    def __init__(self, world, node_of):
        self.world, self.node_of, self.phases = world, node_of, {}

    def _phase(self, phase, axis, dtype):
        if phase not in self.phases:
            zeros = lambda: [0] * self.world  # noqa: E731
            self.phases[phase] = PhaseTraffic(set(), set(), zeros(), zeros(),
                                              {k: [zeros(), zeros(), zeros()] for k in ("intra", "inter")})
        t = self.phases[phase]
        t.axes.add(axis)
        t.dtypes.add(str(dtype).replace("torch.", ""))
        return t

    def ring(self, phase, axis, dtype, groups, piece_numel, hops, messages=None):
        """Each group in `groups` (lists of ranks, size n > 1) runs a ring of `hops` steps of piece_numel, paying
        the latency of `messages` steps (default: hops)."""
        for group in groups:
            t = self._phase(phase, axis, dtype)
            sent, received, count = t.link["inter" if len({self.node_of(r) for r in group}) > 1 else "intra"]
            nbytes = hops * piece_numel * dtype.itemsize
            for r in group:
                for column in (t.sent, t.received, sent, received):
                    column[r] += nbytes
                count[r] += hops if messages is None else messages

    def all_gather(self, phase, axis, dtype, groups, shard_numel):
        """A ring all-gather of shard_numel from each rank of each group: (n - 1) shards out and in."""
        self.ring(phase, axis, dtype, groups, shard_numel, len(groups[0]) - 1)

    reduce_scatter = all_gather  # a ring reduce-scatter of n shards moves what the all-gather of one does

    def all_reduce(self, phase, axis, dtype, groups, numel):
        """The Ledger's ring count of bytes; the latency of the ring's 2 (n - 1) steps or of a tree's 2 log2 n,
        whichever is fewer (NCCL picks a tree for small messages on many ranks: the grad-presence vote)."""
        n = len(groups[0])
        self.ring(phase, axis, dtype, groups, -(-numel // n), 2 * (n - 1), min(2 * (n - 1), 2 * math.ceil(math.log2(n))))

    def all_to_all(self, phase, axis, dtype, sources, destinations, numels):
        """One all-to-all: elements numels[i] from sources[i] to destinations[i] (lists of equal length); a rank's
        parts to itself move nothing. Every rank takes part (the Ledger records its zeros too)."""
        t = self._phase(phase, axis, dtype)
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

    def comm_seconds(self, cluster):
        """{phase: seconds of its slowest rank}."""
        return {p: max(t.seconds(r, cluster) for r in range(self.world)) for p, t in self.traffic.phases.items()}

    def compute_seconds(self, cluster):
        """Per rank: Newton-Schulz at the bf16 rate + elementwise work at the memory bandwidth."""
        return [f / (cluster.ns_tflops * 1e12) + (self.elements["muon"][r] * cluster.muon_bytes
                                                  + self.elements["adamw"][r] * cluster.adamw_bytes)
                / (cluster.hbm_gbs * 1e9) for r, f in enumerate(self.ns_flops)]


# 4a. The lesson's step, phase by phase, from the optimizer's own plan (sections 5 and 6 of the lesson).

def lesson_cost(opt, node_of, label=None):
    grid, layout = opt.grid, opt.layout
    dp, tp = grid.dp.size, grid.tp.size
    world = dp * tp
    traffic = Traffic(world, node_of)
    dp_groups = [[d * tp + t for d in range(dp)] for t in range(tp)]
    tp_groups = [[d * tp + t for t in range(tp)] for d in range(dp)]
    flops = [0] * world
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
    else:
        for name, owner in opt.owners.items():
            flops[owner] += strategy.ns_flops[name]
        if strategy.name == "owner" and world > 1:
            exchange_at_owners(traffic, strategy.routes, "world", lambda i: i)
        if strategy.name == "comm-free":
            comm_free_cost(opt, traffic, dp, tp)
    for b in layout.buckets if dp > 1 else ():  # stage 4: the parameter all-gather
        traffic.all_gather("param all-gather", "DP", FP32, dp_groups, b.numel // dp)
    state, elements = lesson_state(opt, dp, tp)
    single = sum(strategy.ns_flops.values()) if getattr(strategy, "ns_flops", None) else sum(
        dm.newton_schulz_flops(layout.global_shapes[n], opt.group_of[n]["ns_steps"]) for n in opt.muon_names)
    return Cost(label or strategy.name, traffic, flops, state, elements, world, single)


def exchange_at_owners(traffic, routes, axis, global_rank):
    """gather at owner and scatter from owner, one all-to-all each (distmuon/owners.py: gather_at_owner, scatter_from_owner):
    every route's senders to its owner, the owner back to every holder. global_rank: axis index -> rank."""
    g = global_rank
    traffic.all_to_all("gather at owner", axis, BF16, *columns((g(p.rank), g(r.owner), p.stop - p.start)
                                                              for r in routes for p in r.senders))
    traffic.all_to_all("scatter from owner", axis, BF16, *columns((g(r.owner), g(p.rank), p.stop - p.start)
                                                                 for r in routes for p in r.holders))


def columns(transfers):
    """(sources, destinations, elements) of an iterable of (source, destination, elements)."""
    rows = list(transfers)
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def comm_free_cost(opt, traffic, dp, tp):
    """comm-free's extra phases: per chunk, the gradient reduced at the owner row and the update broadcast from
    it over DP (distmuon/owners.py: reduce_at_owner, broadcast_from_owner); the TP exchange inside each owner row."""
    numel = {n: math.prod(opt.layout.shapes[n]) for n in opt.muon_names}
    row = {n: o // tp for n, o in opt.owners.items()}
    for chunk in opt.strategy.chunks if dp > 1 else ():
        traffic.all_to_all("grad reduce at owner", "DP", FP32, *columns(
            (d * tp + t, row[n] * tp + t, numel[n]) for n in chunk for d in range(dp) for t in range(tp)))
        traffic.all_to_all("update broadcast from owner", "DP", BF16, *columns(
            (row[n] * tp + t, d * tp + t, numel[n]) for n in chunk for d in range(dp) for t in range(tp)))
    for d in range(dp) if tp > 1 else ():
        grid = virtual_grid(dp, tp, d * tp)
        routes = mo.plan_routes(opt.muon_names, opt.owners, lambda n, d: opt.strategy.part_of(opt, n, d), opt.layout,
                                grid, grid.tp)
        exchange_at_owners(traffic, routes, "TP", lambda i, d=d: d * tp + i)


def lesson_state(opt, dp, tp):
    """(state bytes per rank, elementwise elements per rank): each rank's part of every parameter (part_of):
    Muon's momentum (fp32); AdamW's two moments and its step (a 4-byte tensor) where the part is not empty.
    comm-free's ranks also apply the other rows' updates to their whole copies of the matrices."""
    state, elements = [0] * (dp * tp), {"muon": [0] * (dp * tp), "adamw": [0] * (dp * tp)}
    for name, group in opt.group_of.items():
        algorithm = group["algorithm"]
        whole = math.prod(opt.layout.shapes[name])
        for d in range(dp):
            part = opt.strategy.part_of(opt, name, d)
            n = part.stop - part.start
            for r in range(d * tp, (d + 1) * tp):
                state[r] += 4 * n if algorithm == "muon" else (8 * n + 4 if n else 0)
                elements[algorithm][r] += whole if opt.strategy.name == "comm-free" and algorithm == "muon" else n
    return state, elements


# 4b. DTensorMuon's step (distmuon/dtensor/, section 5): the grad-presence vote over its group, one
# gather at owner and one scatter from owner (all-to-all over the world), Newton-Schulz on the owners.

def dtensor_cost(copies, param_names, group_algorithms, group_ns_steps, world, node_of, label="DTensorMuon"):
    """copies: in DTensorMuon's planning order (placed_copies); param_names: every name its ranks vote on;
    group_algorithms / group_ns_steps: {group index: "muon" | "adamw"} / {group index: ns_steps}."""
    traffic = Traffic(world, node_of)
    if world > 1:
        traffic.all_reduce("grad presence", "world", U8, [list(range(world))], len(set(param_names)) + 1)
    muon = [c for c in copies if group_algorithms[c.group] == "muon"]
    matrices, ns_flops, owners = dtensor_plan(muon, group_ns_steps, world)
    if world > 1:
        gather, scatter = dtensor_transfers(matrices)
        traffic.all_to_all("gather at owner", "world", BF16, *gather)
        traffic.all_to_all("scatter from owner", "world", BF16, *scatter)
    flops = [0] * world
    for name, owner in owners.items():
        flops[owner] += ns_flops[name]
    flops = add_local_matrices(flops, muon, group_ns_steps)
    state, elements = state_and_elements(copies, lambda c: group_algorithms[c.group], world)
    return Cost(label, traffic, flops, state, elements, world, sum(ns_flops.values()))


def add_local_matrices(flops, muon_copies, group_ns_steps):
    """Plain and all-Replicate copies: orthogonalized where they are, on every holder (no exchange)."""
    for c in muon_copies:
        if c.local:
            work = c.n_matrices * dm.newton_schulz_flops(c.matrix_shape, group_ns_steps[c.group])
            for r in c.mesh_ranks or range(len(flops)):
                flops[r] += work
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

    @property
    def dp(self):
        return self.gpus // self.tp

    @property
    def bucket_size(self):
        """Megatron-LM's default bucket: max(40M, 1M x DP) elements (DistributedDataParallelConfig.bucket_size),
        larger for more DP ranks so that its collectives stay bandwidth-bound."""
        return max(40_000_000, 1_000_000 * self.dp)


GROUPS = ("muon", "adamw", "adamw_no_wd")


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
        lesson = {"gather": base, "owner": replace(base, strategy="owner"),
                  "comm-free": replace(base, strategy="comm-free"),
                  "gather, Gram form": replace(base, tp_newton_schulz="gram"),
                  "AdamW ZeRO-1": replace(base, baseline=True)}
        if s.tp == 1:
            del lesson["gather, Gram form"]  # nothing to sum over
        for label, cfg in lesson.items():
            if strategies is None or label in strategies:
                costs[label] = lesson_cost(lesson_optimizer(specs, cfg), node_of, label)
    copies = moe_copies(params, s) if moe else placed_copies(param_order(params, GROUPS), Mesh(s.dp, s.tp),
                                                              {g: i for i, g in enumerate(GROUPS)})
    algorithms = {i: "muon" if g == "muon" else "adamw" for i, g in enumerate(GROUPS)}
    steps = {i: dm.NS_STEPS for i in range(len(GROUPS))}
    for label in ("DTensorMuon", "AdamW, FSDP2"):
        if strategies is None or label in strategies:
            costs[label] = (dtensor_cost(copies, [p.name for p in params], algorithms, steps, s.gpus, node_of)
                            if label == "DTensorMuon" else adamw_fsdp2_cost(copies, s.gpus, node_of))
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


def summarize(cost, cluster):
    phases = cost.comm_seconds(cluster)
    sent = [sum(t.sent[r] for t in cost.traffic.phases.values()) for r in range(cost.world)]
    received = [sum(t.received[r] for t in cost.traffic.phases.values()) for r in range(cost.world)]
    inter = sum(sum(t.link["inter"][0]) for t in cost.traffic.phases.values())
    comm = sum(phases.values())
    compute = max(cost.compute_seconds(cluster))
    return Row(cost.label, max(sent), max(received), inter / sum(sent) if sum(sent) else 0.0, max(cost.ns_flops),
               sum(cost.ns_flops) / cost.world, max(cost.state_bytes), comm, compute, comm + compute,
               max(comm, compute))


def forward_backward_seconds(s, cluster):
    """6 x active parameters x tokens over the GPUs at the cluster's forward + backward rate."""
    return 6 * s.model.active_params() * s.model.tokens / (s.gpus * cluster.train_tflops * 1e12)


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
        fsdp2 = row.label in ("DTensorMuon", "AdamW, FSDP2")
        adamw = by.get("AdamW, FSDP2" if fsdp2 else "AdamW ZeRO-1")
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
    [Scenario(MODELS[m], g, tp=8) for m in ("llama3-8b", "llama3-70b") for g in (64, 512)] + \
    [Scenario(MODELS["deepseek-v3"], g, ep=64) for g in (256, 512, 1024, 2048)] + \
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
    mt.write_json(json_path, dict(cluster=vars(cluster), scenarios=results, ns_scaling=scaling))
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


def figure(results, scaling, path):
    """Three panels: the predicted step of every optimizer for Llama-3-70B-like and the MoE at each size, and
    Newton-Schulz per rank (busiest and mean) as GPUs grow, the largest matrix dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(19, 6.2))
    for ax, name in zip(axes, ("Llama-3-70B-like", "DeepSeek-V3-like MoE")):
        runs = [r for r in results if r["model"] == name]
        labels = [r["label"] for r in runs[0]["rows"]]
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            steps = [next(x for x in r["rows"] if x["label"] == label)["step_s"] * 1e3 for r in runs]
            ax.bar([j + i * width for j in range(len(runs))], steps, width, label=label)
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
    fig.savefig(path, dpi=90)
    plt.close(fig)


# =============================================================================
# 7. This machine, measured: the model fed its matmul rate, Gloo's bandwidth and its elementwise speed,
#    against steps measured on 1 and 2 processes (benchmarks/scaling.py's model and timing)
# =============================================================================

GLOO_SIZES = (1 << 16, 1 << 21)  # float32 elements per rank: 256 KiB and 8 MiB


def gloo_rank(rank, port, out_dir, repeats=7):
    """One of two ranks: the median seconds of an all-to-all of each of GLOO_SIZES."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    times = []
    for n in GLOO_SIZES:
        full, out = torch.ones(n), torch.empty(n)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(out, full)
            samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples))
    torch.save(times, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def gloo_alpha_beta():
    """(latency s, bandwidth bytes/s) of one message between two ranks here, fitted to the all-to-alls of
    GLOO_SIZES (each rank sends half of its buffer to the other), the slower rank's."""
    with tempfile.TemporaryDirectory() as out_dir:
        mt.run_processes(gloo_rank, (mt.free_port(), out_dir), 2, folders=(out_dir,))
        t = [max(a, b) for a, b in zip(*(torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(2)))]
    moved = [n // 2 * 4 for n in GLOO_SIZES]
    beta = (moved[1] - moved[0]) / max(t[1] - t[0], 1e-9)
    return max(t[0] - moved[0] / beta, 0.0), beta


def elementwise_gbs(n=1 << 22, repeats=7):
    """GB/s of an fp32 lerp_ on this core (12 bytes an element: read two, write one)."""
    a, b = torch.randn(n), torch.randn(n)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.lerp_(b, 0.05)
        samples.append(time.perf_counter() - t0)
    return 12 * n / statistics.median(samples) / 1e9


def this_machine(d):
    """A Cluster of this machine's measured figures: its ranks all on one "node" (Gloo over loopback)."""
    import scaling

    torch.set_num_threads(1)
    alpha, beta = gloo_alpha_beta()
    rate = scaling.matmul_gflops(d, torch.bfloat16)
    gbs = elementwise_gbs()
    # the lesson's unfused ops: Muon 48 bytes an element (lerp_ 12, lerp 12, bf16 cast 6, decay 8, add_ 10),
    # torch's single-tensor AdamW 80 (mul_ 8, lerp_ 12, mul_ 8, addcmul_ 12, sqrt / div / add_ 24, addcdiv_ 16)
    return Cluster(f"this machine: 2 Gloo ranks on {os.cpu_count()} cores", gpus_per_node=64,
                   intra_gbs=beta / 1e9, inter_gbs=beta / 1e9, intra_us=alpha * 1e6, inter_us=alpha * 1e6,
                   ns_tflops=rate / 1e3, train_tflops=1.0, hbm_gbs=gbs, muon_bytes=48, adamw_bytes=80,
                   sources=(f"Gloo, 2 ranks, all-to-all fitted: {alpha * 1e6:.0f} us + {beta / 1e9:.2f} GB/s",
                            f"bf16 matmul {d} x {d}, one thread: {rate:.1f} GFLOP/s (benchmarks/scaling.py's)",
                            f"fp32 lerp_, one thread: {gbs:.1f} GB/s"))


def scaling_specs(d, layers):
    """benchmarks/scaling.py's model as the lesson's ParamSpecs (TP = 1: nothing is split)."""
    import scaling

    matrices, vectors = scaling.shapes(d, layers)
    return [dm.ParamSpec(n, s, -1, "muon") for n, s in matrices.items()] + \
        [dm.ParamSpec(n, s, -1, "adamw") for n, s in vectors.items()]


def check_here(d, layers, rounds, print_fn=print):
    """Predicted against measured: torch's step in one process and every strategy of scaling.py on 1 and 2 ranks."""
    import scaling

    load = os.getloadavg()[0]
    cluster = this_machine(d)
    specs = scaling_specs(d, layers)
    one = scaling.on_one_process(d, layers, rounds)
    two = scaling.on_ranks(2, d, layers, rounds=rounds)
    print_fn(f"{cluster.name}; torch {torch.__version__}; {layers} layers at d = {d} (benchmarks/scaling.py's "
             f"model), {rounds} interleaved steps, slowest rank; load average {load:.1f} at the start (other jobs "
             f"share the cores: the median feels them, the minimum is the least disturbed step)")
    for line in cluster.sources:
        print_fn(f"  * {line}")
    node_of = lambda r: 0  # noqa: E731  -- one machine
    rows, errors = [], []
    torch_cost = lesson_cost(lesson_optimizer(specs, mt.RunConfig(dp=1, tp=1)), node_of, "torch")
    for ranks, measured in ((1, one), (2, two)):
        for variant, (strategy, options) in scaling.VARIANTS.items():
            cfg = mt.RunConfig(dp=ranks, tp=1, strategy=strategy)
            row = summarize(lesson_cost(lesson_optimizer(specs, cfg), node_of, variant), cluster)
            predicted = row.overlap_s if options.get("overlap") and ranks > 1 else row.step_s
            rows.append((ranks, variant, row, predicted, measured[variant]))
    torch_row = summarize(torch_cost, cluster)
    rows.insert(0, (1, scaling.TORCH, torch_row, torch_row.step_s, one[scaling.TORCH]))
    table = []
    for ranks, variant, row, predicted, times in rows:
        median, least = statistics.median(times) / 1e3, min(times) / 1e3
        errors.append((abs(predicted / median - 1), abs(predicted / least - 1)))
        table.append([ranks, variant, ms(row.comm_s), ms(row.compute_s), ms(predicted), ms(median), ms(least),
                      f"{predicted / median - 1:+.0%}", f"{predicted / least - 1:+.0%}"])
    print_fn(mt.format_table(["ranks", "step", "comm ms", "compute ms", "predicted ms", "median ms", "min ms",
                              "error vs median", "vs min"], table, [">", "<"] + [">"] * 7))
    for i, what in enumerate(("median", "minimum")):
        print_fn(f"|error| against the {what}: median {statistics.median(e[i] for e in errors):.0%}, largest "
                 f"{max(e[i] for e in errors):.0%}")
    print_fn("(predicted: communication + compute; with --overlap on 2 ranks, the larger of the two)")
    return rows


# =============================================================================
# 8. The command line
# =============================================================================

def main(argv=None):
    p = mt.OneLineParser(description="Predict a distributed Muon step on a cluster from the project's own plans.")
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b", help="the model (default %(default)s)")
    p.add_argument("--gpus", type=int, default=64, help="GPUs (default %(default)s)")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default 8; 1 for an MoE)")
    p.add_argument("--ep", type=int, default=None, help="expert parallel size of an MoE (default 64)")
    p.add_argument("--chapter", action="store_true", help="every table and figure of notes/12-cost-model.md")
    p.add_argument("--json", metavar="PATH", help="--chapter: write its figures as JSON")
    p.add_argument("--figure", metavar="PATH", help="--chapter: write its three plots as a PNG")
    p.add_argument("--check-here", action="store_true", help="this machine's measured steps against the model")
    p.add_argument("--d", type=int, default=128, help="--check-here: model width (default %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="--check-here: layers (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="--check-here: timed steps (default %(default)s)")
    args = p.parse_args(argv)
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
        if args.d < 1 or args.layers < 1 or args.rounds < 1:
            p.error("--d, --layers and --rounds must be >= 1")
        check_here(args.d, args.layers, args.rounds)
        return 0
    model = MODELS[args.model]
    tp = args.tp if args.tp is not None else (1 if model.experts else 8)
    ep = (args.ep if args.ep is not None else 64) if model.experts else 0
    if args.gpus < 1 or tp < 1 or (model.experts and (ep < 1 or tp != 1)):
        p.error("--gpus and --tp must be >= 1; an MoE takes --ep >= 1 and no TP")
    if args.ep is not None and not model.experts:
        p.error(f"--ep applies to an MoE; {args.model} is dense")
    s = Scenario(model, args.gpus, tp=tp, ep=ep)
    try:
        rows, fwd_bwd, _ = predict(s, H100)
    except ValueError as e:
        p.error(str(e))
    print(f"{scenario_title(s, H100)}; forward + backward {ms(fwd_bwd)} ms\nCluster: {H100.name}")
    print(format_rows(rows, fwd_bwd))
    return 0


if __name__ == "__main__":
    sys.exit(mt.exit_code(main))
