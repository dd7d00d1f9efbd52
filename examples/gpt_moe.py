"""A mixture-of-experts GPT: examples/gpt.py's model with each block's MLP replaced by routed experts.

The attention, the norms, the embeddings and the tied head are gpt.py's, unchanged (so is its TP
split, done by examples/train_gpt_moe.py with PyTorch's parallelize_module). Only the MLP changes:

    h = ln2(x), N tokens of d
    router    logits = h W_r^T (E per token), probs = softmax(logits); each token's top-k experts
              (k = 2), its gates = their probs divided by their sum (Mixtral's top-2 softmax)
    dispatch  the N k (token, expert) pairs sorted by expert (stable); under expert parallelism (EP)
              each EP rank holds the experts torch.chunk gives it (DTensor's Shard(0), uneven when EP
              does not divide E), and ONE all_to_all_single with uneven splits sends every pair to
              the rank of its expert (Gloo's all_gather refuses unequal sizes; its all-to-all does not)
    experts   expert e on the rows it got: gelu(x W1[e]^T) W2[e]^T, one 2-D matmul after another;
              W1 (E, H, d) and W2 (E, d, H) are 3-D stacks, and each expert is its own matrix for Muon
    combine   the reverse all_to_all_single; each token's k outputs times its gates, added
    shared    optional: the dense MLP of gpt.py that every token goes through, added
    aux loss  Switch Transformer's load balance (Fedus et al. 2021, arXiv 2101.03961, eq. 4):
              E sum_e f_e P_e, f_e the share of the pairs routed to e, P_e the mean of its probs over
              the micro-batch's tokens; aux_loss_weight times it (their alpha, 0.01) joins the loss

         rank (EP 0) tokens                              rank (EP 1) tokens
     router -> top-2 -> sort by expert               router -> top-2 -> sort by expert
        | pairs for e0 e1 | for e2 |                     | for e0 e1 | for e2 |
        +--------+--------+---- all_to_all_single ----+--------+-----------+
        v                 (uneven splits)              v
     experts 0, 1 (EP 0 holds 2)                     expert 2 (EP 1 holds 1)
        +------------- all_to_all_single back --------+
     each token: gate_1 y_1 + gate_2 y_2 (+ shared MLP)

Dropless: no capacity cut, so an expert processes every pair routed to it and the buffers an EP
rank allocates follow the routing, up to every pair of its EP group (train_gpt_moe.py prints what
the run used and what the worst case would be).

One process (ep None) holds every expert and routes without communication: the reference that
train_gpt_moe.py's --verify compares the ranks with. There the loss's aux term is computed per
micro-batch (micro_batches), as each rank computes it on its own tokens.
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
from torch.distributed.tensor import DTensor
from torch.profiler import record_function


from examples.gpt import GPT  # noqa: E402


@dataclass(frozen=True)
class MoEConfig:
    experts: int = 4
    top_k: int = 2
    expert_hidden: int = 128  # H: each expert is d -> H -> d
    shared_expert: bool = False  # gpt.py's dense MLP (4 d) beside the experts, for every token
    aux_loss_weight: float = 0.01  # Switch Transformer's alpha


def experts_per_rank(experts, ep):
    """How many experts each of the ep EP ranks holds: torch.chunk's split, which DTensor's Shard(0) makes
    (ceil(E / ep) each, the last ones fewer, possibly none)."""
    sizes = [len(c) for c in torch.arange(experts).chunk(ep)]
    return sizes + [0] * (ep - len(sizes))


def check_moe(moe, ep=1):
    """Raise ValueError (one line) when the MoE cannot be built or its experts split over `ep` EP ranks."""
    for name in ("top_k", "expert_hidden"):
        if getattr(moe, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(moe, name)})")
    if moe.experts < 2:
        raise ValueError(f"--experts must be >= 2 (got {moe.experts}): one expert routes nothing (its router's "
                         f"softmax is 1 whatever it weighs); the dense GPT is examples/train_gpt_dtensor.py")
    if moe.top_k > moe.experts:
        raise ValueError(f"--top-k {moe.top_k} exceeds --experts {moe.experts}: a token cannot take more experts "
                         f"than there are")
    if not (moe.aux_loss_weight >= 0 and math.isfinite(moe.aux_loss_weight)):
        raise ValueError(f"--aux-loss-weight must be >= 0 and finite (got {moe.aux_loss_weight})")
    split = experts_per_rank(moe.experts, ep)
    if 0 in split:
        raise ValueError(f"--experts {moe.experts} over EP {ep}: torch.chunk (Shard(0)) gives "
                         f"{', '.join(map(str, split))}, so EP rank {split.index(0)} would hold none")


def moe_initial_weights(config, moe):
    """{name: full tensor} of every block's router and expert stacks (GPT-2's init, as gpt.initial_weights:
    normal(0, 0.02), the projection back to the residual stream, W2, by 1/sqrt(2 layers)), from a stream of
    their own so that the rest of the model starts as gpt.py's does at the same seed."""
    g = torch.Generator().manual_seed(1_000_003 * config.seed + 999_983)
    d, std = config.d_model, 0.02
    residual_std = std / math.sqrt(2 * config.n_layers)
    w = {}
    for i in range(config.n_layers):
        p = f"blocks.{i}.mlp."
        w[p + "router.weight"] = torch.randn(moe.experts, d, generator=g) * std
        w[p + "experts.w1"] = torch.randn(moe.experts, moe.expert_hidden, d, generator=g) * std
        w[p + "experts.w2"] = torch.randn(moe.experts, d, moe.expert_hidden, generator=g) * residual_std
    return w


def local(t):
    """What this rank holds of a parameter: a DTensor's local tensor (EP: its experts), or the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


# -- the exchange of rows over EP ---------------------------------------------
# Every row sent is counted in the ledger (Gloo's profiler records no sizes), as
# gpt.py's f and g count the TP all-reduces: what a rank sends to the others and
# receives from them, exactly (its rows to itself stay where they are).

def exchange_rows(x, send, receive, ep, ledger, phase):
    """x's rows in runs of send[i] for EP rank i, sent there; returns the runs received, receive[i] rows from
    rank i, in rank order: one all_to_all_single with uneven splits over ep's group."""
    out = x.new_empty((sum(receive),) + tuple(x.shape[1:]))
    with record_function(phase):
        dist.all_to_all_single(out, x.contiguous(), list(receive), list(send), group=ep.group)
    if ledger is not None:
        row = math.prod(x.shape[1:])
        others = [i for i in range(ep.size) if i != ep.rank]
        ledger.record_comm(phase, "all_to_all", ep, row * sum(send[i] for i in others),
                           row * sum(receive[i] for i in others), x.dtype)
    return out


class AllToAll(torch.autograd.Function):
    """exchange_rows, differentiable: backward sends each row's gradient back where the row came from."""

    @staticmethod
    def forward(ctx, x, send, receive, ep, ledger, phase):
        ctx.send, ctx.receive, ctx.ep, ctx.ledger, ctx.phase = send, receive, ep, ledger, phase
        return exchange_rows(x, send, receive, ep, ledger, phase + " (forward)")

    @staticmethod
    def backward(ctx, grad):
        back = exchange_rows(grad, ctx.receive, ctx.send, ctx.ep, ctx.ledger, ctx.phase + " (backward)")
        return back, None, None, None, None, None


class Experts(nn.Module):
    """The expert stacks W1 (E, H, d) and W2 (E, d, H) as this rank holds them: all E in one process, this EP
    rank's under EP (a DTensor, Shard(0) over "ep": to_local() is its experts). forward(x, counts): x's rows
    in runs of counts[e] for this rank's expert e, each run through its expert with 2-D matmuls."""

    def __init__(self, experts, d, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, d))
        self.w2 = nn.Parameter(torch.empty(experts, d, hidden))

    def forward(self, x, counts):
        w1, w2 = local(self.w1), local(self.w2)
        runs = x.split(counts.tolist())
        return torch.cat([nnf.linear(nnf.gelu(nnf.linear(rows, w1[e])), w2[e]) for e, rows in enumerate(runs)])


class MoE(nn.Module):
    """The routed MLP of one block (the module's docstring). ep: this rank's EP axis (a distributed_muon_cpu.Axis; None: one
    process, every expert here); set by whoever places the experts, with the ledger its exchanges count in."""

    def __init__(self, d, moe, shared=None, micro_batches=1):
        super().__init__()
        self.k, self.n_experts, self.micro_batches = moe.top_k, moe.experts, micro_batches
        self.router = nn.Linear(d, moe.experts, bias=False)
        self.experts = Experts(moe.experts, d, moe.expert_hidden)
        self.shared = shared
        self.ep, self.ledger = None, None
        self.forced = None  # (N, k) expert indices to take instead of the router's top-k (verification)
        self.recording, self.record = False, None
        self.aux_loss = None

    def forward(self, h):
        x = h.reshape(-1, h.size(-1))
        logits = self.router(x)
        probs = logits.softmax(-1)
        chosen = probs.topk(self.k, dim=-1).indices if self.forced is None else self.forced
        gates = probs.gather(-1, chosen)
        gates = gates / gates.sum(-1, keepdim=True)
        self.aux_loss = self.load_balance_loss(probs, chosen)
        y, received = self.route(x, chosen)
        out = (gates.unsqueeze(-1) * y).sum(1)
        if self.recording:
            self.record = dict(chosen=chosen.detach().cpu(), probs=probs.detach().cpu(), received=received)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(h.shape)

    def load_balance_loss(self, probs, chosen):
        """E sum_e f_e P_e on each micro-batch's tokens, averaged over the micro-batches (one on a rank)."""
        per_batch = probs.view(self.micro_batches, -1, self.n_experts)
        share = nnf.one_hot(chosen, self.n_experts).sum(1).to(probs.dtype).view_as(per_batch).mean(1) / self.k
        return self.n_experts * (share * per_batch.mean(1)).sum(-1).mean()

    def route(self, x, chosen):
        """(N, k, d): every token's k expert outputs, in its chosen order; and the rows each of this rank's
        experts processed (one process: every expert's)."""
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # the pairs by expert; a token's pairs keep their order
        counts = torch.bincount(flat, minlength=self.n_experts)
        rows = x[order // self.k]
        if self.ep is None or self.ep.size == 1:
            out, received = self.experts(rows, counts), counts
        else:
            out, received = self.exchange_and_apply(rows, counts)
        return out[order.argsort()].view(-1, self.k, x.size(-1)), received.tolist()

    def exchange_and_apply(self, rows, counts):
        """rows, sorted by expert, to the EP ranks of their experts; through the experts; back."""
        ep, ledger = self.ep, self.ledger
        split = experts_per_rank(self.n_experts, ep.size)
        mine = split[ep.rank]
        # every rank tells every other how many of its rows go to each of that rank's experts
        theirs = exchange_rows(counts, split, [mine] * ep.size, ep, ledger, "expert counts").view(ep.size, mine)
        send = [int(c.sum()) for c in counts.split(split)]
        receive = theirs.sum(1).tolist()
        got = AllToAll.apply(rows, send, receive, ep, ledger, "expert dispatch")  # by source rank, then expert
        start = (theirs.view(-1).cumsum(0) - theirs.view(-1)).view(ep.size, mine)
        by_expert = torch.cat([torch.arange(start[s, e], start[s, e] + theirs[s, e])
                               for e in range(mine) for s in range(ep.size)])
        done = self.experts(got[by_expert], theirs.sum(0))[by_expert.argsort()]
        return AllToAll.apply(done, receive, send, ep, ledger, "expert combine"), theirs.sum(0)


class MoEGPT(GPT):
    """gpt.GPT in one process's form (its Megatron layers unsplit) with every block's MLP an MoE; the loss is the
    cross-entropy plus aux_loss_weight x the blocks' load-balance losses while training (in eval mode, the
    cross-entropy alone: what validation compares with the dense GPT). ce and aux keep the last forward's."""

    def __init__(self, config, moe, micro_batches=1):
        super().__init__(config)
        self.moe_config = moe
        full = moe_initial_weights(config, moe)
        for block in self.blocks:
            block.mlp = MoE(config.d_model, moe, block.mlp if moe.shared_expert else None, micro_batches)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name in full:
                    p.copy_(full[name])
        self.ce = self.aux = None

    def moe_layers(self):
        return [block.mlp for block in self.blocks]

    def forward(self, idx, targets):
        ce = super().forward(idx, targets)
        aux = sum(m.aux_loss for m in self.moe_layers())
        self.ce, self.aux = ce.detach(), aux.detach()
        return ce + self.moe_config.aux_loss_weight * aux if self.training else ce

    @contextmanager
    def uncounted(self):
        """Communicate without recording bytes, the experts' exchanges too (validation is no part of a step)."""
        saved = [m.ledger for m in self.moe_layers()]
        for m in self.moe_layers():
            m.ledger = None
        try:
            with super().uncounted():
                yield
        finally:
            for m, ledger in zip(self.moe_layers(), saved):
                m.ledger = ledger

    def force_routing(self, chosen=None):
        """Route every layer's tokens to these experts ([(N, k)] per layer) instead of the router's top-k; None:
        the router's again. Gates and the aux loss still come from the router's probs."""
        for i, m in enumerate(self.moe_layers()):
            m.forced = None if chosen is None else chosen[i].to(m.router.weight.device)

    def record_routing(self, on=True):
        """Keep each layer's decisions, router probabilities and rows received of every forward (in m.record)."""
        for m in self.moe_layers():
            m.recording, m.record = on, None

    def routing(self):
        return [m.record for m in self.moe_layers()]


def param_groups(model, muon, adamw, adamw_no_wd, experts=None):
    """Named param groups for DTensorMuon: the blocks' matrices with `muon`'s hyperparameters (or another algorithm's:
    the name says what the matrices take by default), the embeddings and the routers with `adamw`'s, norms and
    biases with `adamw_no_wd`'s. The expert stacks join the matrices' group (each expert its own Muon matrix), or,
    given `experts` (e.g. AdamW's), a group of their own with those hyperparameters."""
    named = list(model.named_parameters())
    is_matrix = lambda n, p: n.startswith("blocks.") and p.ndim >= 2 and not n.endswith("router.weight")
    apart = lambda p: experts is not None and p.ndim == 3  # an expert stack in a group of its own
    groups = [dict(muon, params=[(n, p) for n, p in named if is_matrix(n, p) and not apart(p)])]
    if experts is not None:
        groups.append(dict(experts, params=[(n, p) for n, p in named if apart(p)]))
    return groups + [dict(adamw, params=[(n, p) for n, p in named if p.ndim >= 2 and not is_matrix(n, p)]),
                     dict(adamw_no_wd, params=[(n, p) for n, p in named if p.ndim == 1])]


def muon_stacks(groups):
    """The names of the expert stacks (3-D) that the param groups give Muon: DTensorMuon's expert_stacks, each
    expert its own matrix (a stack that takes AdamW is stepped elementwise, whole)."""
    return {n for g in groups if g.get("algorithm", "muon") == "muon" for n, p in g["params"] if p.ndim == 3}
