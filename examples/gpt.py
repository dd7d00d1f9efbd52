"""A small GPT, tensor-parallel the Megatron way, for the optimizer to train for real.

Token and position embeddings, pre-norm blocks of causal self-attention and an MLP,
a final norm and a head tied to the token embedding. Tensor parallelism (TP) follows
Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", section 3): each block has two
column-parallel layers and two row-parallel ones, and two conjugate functions, f
and g, carry the only TP communication:

         x (the same on every TP rank)
         |
         f        forward: identity          backward: all-reduce over TP
         |
   column-parallel   QKV (3d x d), MLP-in (4d x d): split along dim 0 (output rows);
         |           each rank computes its own heads / its own hidden units
   local work        attention on this rank's heads / GELU on this rank's units
         |
   row-parallel      attention-out (d x d), MLP-out (d x 4d): split along dim 1
         |           (input columns); each rank's product is a partial sum
         g        forward: all-reduce over TP    backward: identity
         |
       + bias (replicated), + residual

So the optimizer sees four matrices per block, each split along the dim given by
tp_split_dims(), and hands them to Newton-Schulz whole: orthogonalizing the TP
pieces one by one would be a different (and wrong) update, because the nearest
semi-orthogonal matrix of a whole is not the stack of its pieces' ones.

Embeddings, norms and biases are not hidden matrices: they go to the AdamW group,
as users of Muon do (Keller Jordan's Muon README; Moonlight, arXiv:2502.16982).
With TP = 1 (tp=None) f and g are identities and this is a plain GPT: the
single-process reference is this class, built without a grid.

Built without a grid and with as_tp=TP, the one process computes as TP's ranks do:
each rank's piece apart, with the rank's shapes, added where f and g add:

   column-parallel   x A_0^T + b_0, x A_1^T + b_1, ... side by side (A_t: rank t's
                     rows of A); x's gradient: the pieces' input gradients added
                     left to right in rank order (fan_out: what f's backward adds)
   local work        attention per head, GELU per unit: each on rank t's numbers
   row-parallel      ((y_0 B_0^T + y_1 B_1^T) + y_2 B_2^T) + ... (B_t, y_t: rank t's
                     columns), then + bias

A float32 sum of more than two terms depends on its order, so the ranks' all-reduces
must add in that order too: on Gloo, tp_all_reduce adds every element's terms in rank
order, t_0 + t_1 + t_2 + ..., on every rank, and this model has the ranks' bits for
any TP. NCCL's all-reduce adds in its own order: there only TP = 2 has them (two
terms: a + b == b + a whatever the order).
"""

import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as nnf
from torch.profiler import record_function


from distmuon import collectives  # noqa: E402
import distributed_muon_cpu  # noqa: E402
from distmuon import large_runs  # noqa: E402


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # byte-level tokens
    context: int = 128
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    seed: int = 0  # of the initial weights


def check_gpt(config, tp):
    """Raise ValueError (one line) when the model cannot be built or split over `tp` ranks."""
    for name in ("vocab", "context", "d_model", "n_layers", "n_heads"):
        if getattr(config, name) < 1:
            raise ValueError(f"GPTConfig.{name} must be >= 1 (got {getattr(config, name)})")
    if config.d_model % config.n_heads:
        raise ValueError(f"--heads {config.n_heads} does not divide --d-model {config.d_model}")
    if config.n_heads % tp:
        raise ValueError(f"TP {tp} does not divide --heads {config.n_heads}: each TP rank keeps whole heads")


def initial_weights(config):
    """{name: full tensor}: the starting point of every run, TP pieces or not (GPT-2's initialization:
    normal(0, 0.02), residual projections scaled by 1/sqrt(2 * layers), norms at one, biases at zero)."""
    g = torch.Generator().manual_seed(config.seed)
    d, std = config.d_model, 0.02
    residual_std = std / math.sqrt(2 * config.n_layers)

    def normal(*shape, s=std):
        return torch.randn(*shape, generator=g) * s

    w = {"wte": normal(config.vocab, d), "wpe": normal(config.context, d)}
    for i in range(config.n_layers):
        p = f"blocks.{i}."
        w.update({p + "ln1.weight": torch.ones(d), p + "ln1.bias": torch.zeros(d),
                  p + "attn.qkv.weight": normal(3 * d, d), p + "attn.qkv.bias": torch.zeros(3 * d),
                  p + "attn.proj.weight": normal(d, d, s=residual_std), p + "attn.proj.bias": torch.zeros(d),
                  p + "ln2.weight": torch.ones(d), p + "ln2.bias": torch.zeros(d),
                  p + "mlp.fc.weight": normal(4 * d, d), p + "mlp.fc.bias": torch.zeros(4 * d),
                  p + "mlp.proj.weight": normal(d, 4 * d, s=residual_std), p + "mlp.proj.bias": torch.zeros(d)})
    w.update({"ln_f.weight": torch.ones(d), "ln_f.bias": torch.zeros(d)})
    return w


# -- f and g: the only TP communication ---------------------------------------
# Both record what they move in a distributed_muon_cpu.Ledger, as the optimizer's collectives do
# (Gloo's profiler records no sizes): an all-reduce of n elements over a group of
# size s counts as a ring's 2 (s - 1) n / s sent and received per rank.
#
# On Gloo the all-reduce is the lesson's reduce-scatter followed by an all-gather:
#
#   rank t's x, in TP chunks    all-to-all: chunk i      rank i adds its chunk's     all-gather:
#   [x_t0 | x_t1 | .. ]   -->   to rank i          -->   terms in rank order   -->   every rank gets
#                                                        x_0i + x_1i + x_2i + ..     every summed chunk
#
# the bytes of a ring all-reduce (2 (s - 1) / s of x each way), and every element is
# added left to right in rank order on every rank: the association a one-process
# reference can perform (GPT(as_tp=TP)). Gloo's own all_reduce adds each chunk in
# another rotation of the ranks, which no one process follows once TP > 2.

def tp_all_reduce(x, tp, ledger, phase):
    """Sum x over the ranks of `tp` (a distributed_muon_cpu.Axis) in place; ReduceOp.SUM, as the optimizer reduces.
    Gloo: in rank order (above); NCCL: its own all-reduce, in its own order."""
    with record_function(phase):
        if dist.get_backend(tp.group) == "gloo":
            flat = x.view(-1)  # TP divides its size: the last dim is d_model, whole heads per rank (check_gpt)
            work, summed = collectives.reduce_scatter_sum(flat, tp)
            work.wait()
            collectives.all_gather_single(flat, summed(), group=tp.group)
        else:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp.group)
    if ledger is not None:
        ring = 2 * (tp.size - 1) * x.numel() // tp.size
        ledger.record_comm(phase, "all_reduce", tp, ring, ring, x.dtype)
    return x


class f(torch.autograd.Function):  # noqa: N801 -- the paper's name
    """Megatron's f: identity forward; backward, all-reduce the input gradient over TP.

    Each TP rank's column-parallel layer sees the whole input but produces only its
    rows of the output, so the input's gradient is a sum of every rank's share."""

    @staticmethod
    def forward(ctx, x, tp, ledger):
        ctx.tp, ctx.ledger = tp, ledger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return tp_all_reduce(grad.contiguous().clone(), ctx.tp, ctx.ledger, "TP all-reduce (backward)"), None, None


class g(torch.autograd.Function):  # noqa: N801 -- the paper's name
    """Megatron's g, f's conjugate: forward, all-reduce the partial outputs over TP; backward, identity."""

    @staticmethod
    def forward(ctx, x, tp, ledger):
        return tp_all_reduce(x.contiguous().clone(), tp, ledger, "TP all-reduce (forward)")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class FanOut(torch.autograd.Function):
    """f's one-process twin: hands x to each of TP's pieces; backward, adds their input gradients in
    rank order with the lesson's sum_in_order, the very sum f's all-reduce does on Gloo's ranks
    (autograd would add them in its own order)."""

    @staticmethod
    def forward(ctx, x, pieces):
        return tuple(x.view_as(x) for _ in range(pieces))

    @staticmethod
    def backward(ctx, *grads):
        return collectives.sum_in_order(grads), None


class TPContext:
    """What every parallel layer shares: this rank's TP axis (None: one process), the ledger, and how
    many TP pieces this process computes apart (pieces: 1 on a rank, which holds one; TP in the
    one-process reference of TP, to add them as the ranks do)."""

    def __init__(self, tp=None, ledger=None, pieces=1):
        if tp is not None and pieces != 1:
            raise ValueError("a TP rank computes its own piece: as_tp is for one process")
        self.tp, self.ledger, self.pieces = tp, ledger, pieces
        self.size, self.rank = (tp.size, tp.rank) if tp is not None else (1, 0)

    def pieces_of(self, t, dim):
        """t's TP pieces along dim, each laid out as its TP rank holds it (contiguous: the same matmul
        call); [t] itself where this process computes one piece."""
        return [t] if self.pieces == 1 else [piece.contiguous() for piece in t.chunk(self.pieces, dim)]

    def fan_out(self, x):
        """x for each piece this process computes (FanOut where there are several)."""
        return [x] if self.pieces == 1 else FanOut.apply(x, self.pieces)

    def f(self, x):
        return f.apply(x, self.tp, self.ledger) if self.size > 1 else x

    def g(self, x):
        return g.apply(x, self.tp, self.ledger) if self.size > 1 else x


# -- the parallel layers ------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A (out, in) split along dim 0: this rank computes its out / TP features.
    One process computing TP's pieces apart computes each rank's features and sets them side by side
    (a concatenation: no arithmetic), so attention and GELU see each rank's numbers; x's gradient is
    the pieces' added in rank order (fan_out)."""

    split_dims = {"weight": 0, "bias": 0}

    def __init__(self, tpc, d_in, d_out):
        super().__init__()
        self.tpc = tpc
        self.weight = nn.Parameter(torch.empty(d_out // tpc.size, d_in))
        self.bias = nn.Parameter(torch.empty(d_out // tpc.size))

    def forward(self, x):
        xs = self.tpc.fan_out(self.tpc.f(x))
        pieces = zip(xs, self.tpc.pieces_of(self.weight, 0), self.tpc.pieces_of(self.bias, 0))
        y = [nnf.linear(x, w, b) for x, w, b in pieces]
        return y[0] if len(y) == 1 else torch.cat(y, dim=-1)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A (out, in) split along dim 1: this rank's product is a partial sum over its
    in / TP columns; g adds them up. The bias is replicated and added once, after the sum.
    One process computing TP's pieces apart computes each rank's partial product and adds them there."""

    split_dims = {"weight": 1}

    def __init__(self, tpc, d_in, d_out):
        super().__init__()
        self.tpc = tpc
        self.weight = nn.Parameter(torch.empty(d_out, d_in // tpc.size))
        self.bias = nn.Parameter(torch.empty(d_out))

    def forward(self, x_local):
        pieces = zip(self.tpc.pieces_of(x_local, -1), self.tpc.pieces_of(self.weight, 1))
        zs = [nnf.linear(x, w) for x, w in pieces]
        z = zs[0] if len(zs) == 1 else collectives.sum_in_order(zs)  # one process: the sum g does on Gloo's ranks
        return self.tpc.g(z) + self.bias


@torch.no_grad()
def max_logits_per_head(q, k):
    """Each head's largest pre-softmax logit q_i . k_j / sqrt(head_dim) over the batch, the positions i
    and the keys j <= i the causal mask lets it see: (heads,) float32. q, k: (batch, heads, time, head_dim).
    This is S_max of QK-clip (Kimi K2, arXiv 2507.20534, section 2.1), measured in the forward."""
    logits = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.size(-1))  # (batch, heads, time, time)
    future = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).triu(1)
    return logits.masked_fill(future, -math.inf).amax(dim=(0, 2, 3))


class Attention(nn.Module):
    """Causal self-attention on this rank's heads. The QKV rows are laid out head by head
    (head 0's q, k, v, then head 1's, ...), so a contiguous split along dim 0 gives each
    TP rank whole heads, and the attention-out columns are split to match.

    With record_max_logits on, each forward also keeps max_logits: this rank's heads' largest
    logits (max_logits_per_head, no gradient), what QK-clip needs after the step."""

    def __init__(self, tpc, config):
        super().__init__()
        self.heads, self.head_dim = config.n_heads // tpc.size, config.d_model // config.n_heads
        self.qkv = ColumnParallelLinear(tpc, config.d_model, 3 * config.d_model)
        self.proj = RowParallelLinear(tpc, config.d_model, config.d_model)
        self.record_max_logits, self.max_logits = False, None

    def forward(self, x):
        batch, time = x.shape[:2]
        qkv = self.qkv(x).view(batch, time, self.heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # (batch, heads, time, head_dim)
        if self.record_max_logits:
            self.max_logits = max_logits_per_head(q, k)
        y = nnf.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, tpc, config):
        super().__init__()
        self.fc = ColumnParallelLinear(tpc, config.d_model, 4 * config.d_model)
        self.proj = RowParallelLinear(tpc, 4 * config.d_model, config.d_model)

    def forward(self, x):
        return self.proj(nnf.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, tpc, config):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(config.d_model), nn.LayerNorm(config.d_model)
        self.attn, self.mlp = Attention(tpc, config), MLP(tpc, config)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The model as one TP rank holds it: grid_tp is that rank's distributed_muon_cpu.Axis along TP (None: one process).

    Every parameter starts as this rank's TP piece of initial_weights(config). One process holds the
    whole parameters; with as_tp=TP it computes as TP's ranks do (the module's docstring)."""

    def __init__(self, config, grid_tp=None, ledger=None, as_tp=1):
        super().__init__()
        check_gpt(config, grid_tp.size if grid_tp is not None else as_tp)
        self.config, self.tpc = config, TPContext(grid_tp, ledger, as_tp)
        self.wte = nn.Parameter(torch.empty(config.vocab, config.d_model))
        self.wpe = nn.Parameter(torch.empty(config.context, config.d_model))
        self.blocks = nn.ModuleList(Block(self.tpc, config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        full = initial_weights(config)
        split = self.tp_split_dims()
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(distributed_muon_cpu.tp_shard(full[name], split.get(name, -1), self.tpc.rank, self.tpc.size))

    @property
    def ledger(self):
        return self.tpc.ledger

    def tp_split_dims(self):
        """{name: the dim TP splits it along}, for every split parameter (the rest are replicated)."""
        return {f"{module_name}.{p}": dim for module_name, m in self.named_modules()
                for p, dim in getattr(m, "split_dims", {}).items()}

    def forward(self, idx, targets):
        """Mean cross-entropy of predicting targets (batch, time) from idx (batch, time)."""
        x = self.wte[idx] + self.wpe[:idx.size(1)]
        for block in self.blocks:
            x = block(x)
        logits = nnf.linear(self.ln_f(x), self.wte)  # the head is the token embedding, tied
        return nnf.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def record_max_logits(self, on=True):
        """Have every attention layer keep its heads' largest logits of each forward (for QK-clip)."""
        for block in self.blocks:
            block.attn.record_max_logits, block.attn.max_logits = on, None

    def max_logits(self):
        """{qkv weight name: (n_heads,) float32} of the last forward (record_max_logits on), over ALL the
        model's heads: this TP rank's heads hold their maxima, the others -inf (computed elsewhere), as
        the optimizer's clip_qk_ takes them. TP rank t holds heads [t H / TP, (t + 1) H / TP)."""
        out = {}
        for i, block in enumerate(self.blocks):
            local = block.attn.max_logits
            if local is None:
                raise RuntimeError("max_logits: no forward since record_max_logits() was turned on")
            full = torch.full((self.config.n_heads,), -math.inf, dtype=torch.float32, device=local.device)
            full[self.tpc.rank * local.numel():(self.tpc.rank + 1) * local.numel()] = local
            out[f"blocks.{i}.attn.qkv.weight"] = full
        return out

    @contextmanager
    def uncounted(self):
        """Communicate without recording bytes (evaluation is not part of a training step)."""
        saved, self.tpc.ledger = self.tpc.ledger, None
        try:
            yield
        finally:
            self.tpc.ledger = saved


def qkv_row_layouts(config):
    """{qkv weight name: large_runs.RowLayout} of the FULL (TP-gathered) fused QKV matrices: head by head, each
    head's q, k and v rows (head_dim each), as Attention lays them out; for ns_blocks and QK-clip."""
    hd = config.d_model // config.n_heads
    layout = large_runs.RowLayout((hd, hd, hd), config.n_heads, ("q", "k", "v"))
    return {f"blocks.{i}.attn.qkv.weight": layout for i in range(config.n_layers)}


def hidden_matrix_shapes(config):
    """The full shapes (out, in) of the hidden matrices muon_params names, as the blocks build them: QKV, the
    attention's projection, the MLP's two (without building a model: the command line checks them)."""
    d = config.d_model
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]


def muon_params(model):
    """The names of the hidden matrices, for Muon: every 2-D weight inside a block."""
    return [n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]


def param_groups(model, muon, adamw, adamw_no_wd):
    """Named param groups for distributed_muon_cpu.DistributedMuon (and, without names, for torch's optimizers):
    hidden matrices with `muon`'s hyperparameters, embeddings with `adamw`'s, norms and
    biases with `adamw_no_wd`'s (no weight decay on them, as is usual)."""
    matrices = set(muon_params(model))
    named = list(model.named_parameters())
    return [dict(muon, params=[(n, p) for n, p in named if n in matrices]),
            dict(adamw, params=[(n, p) for n, p in named if n in ("wte", "wpe")]),
            dict(adamw_no_wd, params=[(n, p) for n, p in named if p.ndim == 1])]
