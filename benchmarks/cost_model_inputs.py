"""The cost model's inputs (benchmarks/cost_model.py): the models, as their parameters (global shape, TP role, param
group), and the clusters, as per-GPU link and compute figures, each with its source."""

from __future__ import annotations

import math
from dataclasses import dataclass

import distributed_muon_cpu


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
    return [distributed_muon_cpu.ParamSpec(p.name, p.shape, split.get(p.tp, -1), p.group) for p in params]


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
