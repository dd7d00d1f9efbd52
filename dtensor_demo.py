"""DTensorMuon's demo, its verification against torch, its accounting and its command line.

The optimizer lives in distmuon/dtensor/ (sections 1-6: placements, the plan, the
configuration, DTensorMuon, checkpoints); this module continues its numbering with what runs it:

    7. The demo model (FSDP2 x TP x a MoE expert stack), a run, and its verification
       (exact gradients bit for bit; a real training run replayed bit for bit, its gradients within a
       bound derived from the arithmetic, its free-running drift reported beside a one-ulp chaos floor);
       hand-placed meshes (HSDP, expert parallel) and param groups; the explicit configuration
    8. Accounting, beside the lesson's strategies; FSDP2's and TP's own bytes, measured
    9. Main: the command line (spawned Gloo ranks, or one rank per torchrun process)

Everything is checked, bit for bit (torch.equal), against PyTorch's single-device torch.optim.Muon and
torch.optim.AdamW fed the same total gradient; with --batched-ns the Muon matrices are held to the lesson's
derived bound instead (mt.batched_ns_tolerance), everything else still bit for bit.

Launch recipes
--------------
    python dtensor_demo.py                     # 8 Gloo ranks, mesh dp=4 x tp=2, 3 steps, PASS/FAIL
    python dtensor_demo.py --dp 3 --tp 2       # uneven FSDP2 shards (dims that 3 does not divide)
    python dtensor_demo.py --dp 2 --tp 4 --json run.json
    python dtensor_demo.py --compare           # bytes and FLOPs beside the lesson's owner / comm-free, run on this
                                               # model's matrices, same grid; FSDP2's and the TP layers' bytes of a
                                               # training step, measured
    python dtensor_demo.py --batched-ns        # batched Newton-Schulz, held to the lesson's bound
    python dtensor_demo.py --train             # a real FSDP2 x TP training on tokens: the replay bit for bit,
                                               # gradients within the derived bound, the free-running gap beside
                                               # a one-ulp chaos floor (about 10 s)
    python dtensor_demo.py --help
    torchrun --standalone --nproc-per-node 8 dtensor_demo.py --dp 4 --tp 2     # GPUs: NCCL, one per rank
    torchrun --standalone --nproc-per-node 4 dtensor_demo.py --dp 2 --tp 2 --backend gloo --device cpu

Under torchrun each process is one rank of the same demo (section 9): NCCL and cuda:LOCAL_RANK where a GPU
exists (the defaults), Gloo and the CPU with --backend gloo --device cpu; the world size must be --dp x --tp.
"""

from __future__ import annotations

import contextlib
import functools
import math
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import distributed_muon_cpu as dm
import distmuon.checks as mc
import distmuon.owners as mo
import muon_tools as mt
from distributed_muon_cpu import NS_STEPS, newton_schulz_flops
from distmuon.dtensor import (DistributedConfig, DTensorMuon, load_checkpoint, local_indices, local_of,
                                      save_checkpoint)

# =============================================================================
# 7. The demo model, a run, and its verification
# =============================================================================
# A small transformer-like model with an MoE layer, parallelized the way
# torchtitan does it: TP inside a row of the mesh, FSDP2 across the rows.
#
#   name                         shape            TP (mesh dim "tp")        FSDP2 (mesh dim "dp")   optimizer
#   embed.weight                 (V, d)           -                         Shard(0)                AdamW
#   layers.i.norm.weight/.bias   (d,)             -                         Shard(0)                AdamW, no decay
#   layers.i.fc1.weight          (4d, d)          ColwiseParallel: Shard(0) _StridedShard(0)     Muon
#   layers.i.fc1.bias            (4d,)            Shard(0)                  _StridedShard(0)        AdamW, no decay
#   layers.i.fc2.weight          (d, 4d)          RowwiseParallel: Shard(1) Shard(0)                Muon
#   layers.i.fc2.bias            (d,)             Replicate                 Shard(0)                AdamW, no decay
#   layers.i.moe.router.weight   (E, d)           -                         Shard(0)                Muon (one copy per TP column)
#   layers.i.moe.w1              (E, h, d)        expert parallel: Shard(0) Shard(1) [*]            Muon, per expert
#   layers.i.moe.w2              (E, d, h)        expert parallel: Shard(0) Shard(1) [*]            Muon, per expert
#   head.weight                  (V, d)           -                         Shard(0)                AdamW
#
# [*] FSDP2 shards a dim other than 0 only when dp divides it; else it shards the
#     expert dim further (_StridedShard(0)), and each expert then lives whole on some rank.
# "-": FSDP2 puts that parameter on the rank's own dp column, a 1-D mesh; the
# router is then one DTensor per TP column, each orthogonalized by its own owner.
# The default sizes are chosen so that dp = 3 (and dp = 8 on small dims) leaves
# uneven and empty shards.
#
# The verification is the lesson's: exact gradients (integers times 2**-10, so
# that no summation order can matter) are given to every rank as DTensors with
# the parameter's placements, and the same full gradients to torch.optim.Muon
# (one 2-D tensor per matrix, per expert) and torch.optim.AdamW(foreach=False)
# in one process. Every element each rank holds must equal torch's at the same
# place, bit for bit, and every element must be held by some rank. The places
# (element_places) are read off a copy of the model whose parameters hold their
# own flat indices, put through the same parallelize: what TP and FSDP2 do with
# the data, neither the optimizer's local_indices nor DTensor's placement
# arithmetic (torch's distribute_tensor cuts an uneven _StridedShard otherwise
# than FSDP2 does: distmuon/dtensor/, section 2). A real training run (cfg.train: forward
# and backward on tokens) cannot be bit for bit; verify_training, at the end of
# this section, says what it checks instead, and why.
#
# Nothing in a rank's body is CPU-specific: the mesh, the parameters, the
# gradients and the batches live on the rank's device, and what a rank returns
# is copied to the CPU, where the comparison is made.

@dataclass(frozen=True)
class DemoConfig:
    dp: int = 4
    tp: int = 2
    replicate: int = 1  # HSDP: mesh (replicate, dp, tp), fully_shard over (replicate, dp): replicas of each shard
    steps: int = 3
    seed: int = 0
    lr: float = 0.02
    adjust_lr_fn: str = "original"  # Muon's per-matrix lr (DTensorMuon's default)
    momentum: float = 0.95
    weight_decay: float = 0.1
    vocab: int = 100
    d: int = 40
    layers: int = 2
    experts: int = 4
    expert_hidden: int = 36
    batched_ns: bool = False
    timeout_s: float = mt.TIMEOUT_S
    missing_grads: tuple = ()  # (name, step): a gradient None on every rank at that step (tests)
    checkpoint: str = ""  # a folder: save after checkpoint_step (tests)
    checkpoint_step: int = 0
    resume: str = ""  # a folder to load before step resume_step + 1 (tests)
    resume_step: int = 0
    bad: str = ""  # tests: "partial" (a Partial gradient), "assign" (no owners), "gather" (explicit: a short matrix)
    train: bool = False  # real forward / backward through FSDP2 and TP instead of exact gradients (verify_training)
    count_comm: bool = False  # --compare: one training step's collectives, measured (CollectiveCounter, section 8)
    explicit: bool = False  # tests, in Runs: the explicit distributed_config on plain row-chunked tensors instead
    normuon: bool = False  # the Muon group takes NorMuon (distmuon/normuon.py), checked against mt.NorMuonReference


class MoE(nn.Module):
    """A dense soft mixture of experts: every token through every expert, mixed by the router's softmax.
    (A real MoE routes each token to its top-k experts; the optimizer sees the same parameters.)"""

    def __init__(self, d, hidden, experts):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(experts, d, hidden) / math.sqrt(hidden))

    def forward(self, x):
        gates = self.router(x).softmax(-1)
        w1, w2 = (w.full_tensor() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        hidden = torch.einsum("btd,ehd->bteh", x, w1).relu()
        return torch.einsum("bteh,edh,bte->btd", hidden, w2, gates)


class Layer(nn.Module):
    def __init__(self, d, hidden, experts):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.moe = MoE(d, hidden, experts)

    def forward(self, x):
        h = self.norm(x)
        return x + self.fc2(F.gelu(self.fc1(h))) + self.moe(h)


def demo_parameters(cfg):
    """How many parameters DemoModel(cfg) has, without building it: the embedding and the head (vocab x d each),
    and per layer its norm (2 d), fc1 and fc2 (4 d^2 + 4 d, 4 d^2 + d) and its MoE (the router, experts x d, and
    two stacks of experts x hidden x d)."""
    d, e, h = cfg.d, cfg.experts, cfg.expert_hidden
    return 2 * cfg.vocab * d + cfg.layers * (2 * d + 8 * d * d + 5 * d + e * d + 2 * e * h * d)


class DemoModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        torch.manual_seed(cfg.seed)  # every rank and the reference start from the same weights
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.layers = nn.ModuleList(Layer(cfg.d, cfg.expert_hidden, cfg.experts) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def format_assignments(opt):
    """DTensorMuon's assignment as a table: per rank, how many matrices, their GFLOP and their names."""
    load, _ = mo.load_balance(opt.ns_flops, opt.owners, opt.world)
    rows = [[r, sum(o == r for o in opt.owners.values()), f"{load[r] / 1e9:.4f}",
             " ".join(n for n, o in opt.owners.items() if o == r) or "-"] for r in range(opt.world)]
    table = mt.format_table(["rank", "matrices", "NS GFLOP", "owns"], rows, [">", ">", ">", "<"])
    local = sorted(n for names in opt.local_matrices.values() for n in names)
    return table + (f"\nlocal on every holder (plain or all-Replicate): {' '.join(local)}" if local else "")


def expert_stack_names(model):
    return {n for n, p in model.named_parameters() if p.ndim == 3}


def is_muon(name, ndim):
    """The demo's rule: Muon for 2-D weights and expert stacks, except the embedding and the output head."""
    return ndim >= 2 and not name.startswith(("embed.", "head."))


def param_groups(model, cfg):
    """Muon for 2-D weights and expert stacks; AdamW for the rest (no decay on norms and biases)."""
    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if is_muon(n, p.ndim)]
    adamw = [(n, p) for n, p in named if n.startswith(("embed.", "head."))]
    no_wd = [(n, p) for n, p in named if p.ndim < 2]
    return [dict(params=muon, algorithm="normuon" if cfg.normuon else "muon", lr=cfg.lr, weight_decay=cfg.weight_decay,
                 momentum=cfg.momentum, adjust_lr_fn=cfg.adjust_lr_fn),
            dict(params=adamw, algorithm="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay),
            dict(params=no_wd, algorithm="adamw", lr=cfg.lr, weight_decay=0.0)]


def parallelize(model, mesh):
    """TP (Colwise fc1, Rowwise fc2, experts split over tp) inside each row, then FSDP2 over dp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp, dp = mesh["tp"], mesh["dp"]
    fsdp = mesh["replicate", "dp"] if "replicate" in mesh.mesh_dim_names else dp  # HSDP: replicate x shard
    for layer in model.layers:
        parallelize_module(layer, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        for name in ("w1", "w2"):  # expert parallel over the tp dim: each tp rank keeps E / tp experts
            w = getattr(layer.moe, name)
            setattr(layer.moe, name, nn.Parameter(distribute_tensor(w.detach(), tp, [Shard(0)], src_data_rank=None)))
    # FSDP2 cuts each expert (dim 1) where it can: it shards dims other than 0 only evenly, and not a TP rank's
    # empty stack (4 experts over tp = 3: torch.chunk gives 2, 2, 0); else the expert dim.
    every_tp_rank_has_one = lambda p: len(torch.arange(p.shape[0]).chunk(tp.size())) == tp.size()
    experts_on_dim_1 = lambda p: Shard(1) if p.ndim == 3 and p.shape[1] % dp.size() == 0 \
        and every_tp_rank_has_one(p) else None
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp, shard_placement_fn=experts_on_dim_1)
    fully_shard(model, mesh=fsdp, shard_placement_fn=experts_on_dim_1)
    return model


def exact_grads(shapes, seed, step):
    """{name: total gradient}: integers times 2**-10 in [-1/4, 1/4], exact in any summation order."""
    grads = {}
    for i, (name, shape) in enumerate(shapes.items()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + i)
        grads[name] = torch.randint(-dm.GRAD_MAX_INT, dm.GRAD_MAX_INT + 1, shape, generator=g).float() * dm.GRAD_SCALE
    return grads


def build_optimizer(model, cfg):
    return DTensorMuon(param_groups(model, cfg), expert_stacks=expert_stack_names(model), batched_ns=cfg.batched_ns)


def element_places(model, parallelize_fn, device):
    """{name: the global flat index of each element this rank holds, in local order}: `model` (a fresh copy of the
    run's model) with every parameter set to its own flat indices, put through parallelize_fn as the run's model
    is, and read off (float32 holds these integers exactly below 2**24)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() >= 2 ** 24:
                raise ValueError(f"{name}: {p.numel():,} elements; its flat indices are not exact in float32")
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape))
    return {n: local_of(p).detach().reshape(-1).to("cpu", torch.int64)
            for n, p in parallelize_fn(model.to(device)).named_parameters()}


def give_grads(model, cfg, step, where=None):
    """Every parameter's exact total gradient, as a DTensor with its placements (None where cfg says so);
    where: element_places of the model, needed when it has DTensors."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    missing = {n for n, s in cfg.missing_grads if s == step}
    for name, g in exact_grads(shapes, cfg.seed, step).items():
        p = dict(model.named_parameters())[name]
        if name in missing:
            p.grad = None
        elif isinstance(p, DTensor):
            local = g.reshape(-1)[where[name]].view(p.to_local().shape)
            p.grad = DTensor.from_local(local.to(p.device), p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
        else:
            p.grad = g.to(p.device)


BATCH, SEQ = 2, 8  # a real training step (cfg.train, cfg.count_comm): tokens per DP rank


def batch(cfg, step, dp_rank):
    """The (tokens, targets) DP rank dp_rank sees at `step` (on the CPU); the TP ranks of a row see the same."""
    g = torch.Generator().manual_seed(cfg.seed * 7919 + step * 104729 + dp_rank)
    tokens = torch.randint(0, cfg.vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def run_on_mesh(cfg, rank, device):
    """Build, parallelize and step the demo on a mesh of the first dp x tp ranks; return what the parent checks,
    every tensor on the CPU.

    device: this rank's ("cpu"; "cuda:<local rank>" under torchrun with NCCL): the mesh, the
    parameters, their gradients and the batches live there. Ranks outside the mesh only take
    part in creating it (DeviceMesh and new_group are collective over the whole world) and
    return None.
    """
    from torch.distributed.device_mesh import DeviceMesh

    world = cfg.replicate * cfg.dp * cfg.tp
    # What init_device_mesh(kind, (dp, tp)) builds when the mesh is the whole world; DeviceMesh itself also takes
    # the first dp x tp ranks of a larger world (the tests run many meshes in one spawn of 8 ranks).
    shape, names = ((cfg.dp, cfg.tp), ("dp", "tp")) if cfg.replicate == 1 else \
        ((cfg.replicate, cfg.dp, cfg.tp), ("replicate", "dp", "tp"))
    mesh = DeviceMesh(torch.device(device).type, torch.arange(world).view(shape), mesh_dim_names=names)
    group = dist.new_group(list(range(world))) if world < dist.get_world_size() else None
    if rank >= world:
        return None
    model = parallelize(DemoModel(cfg).to(device), mesh)
    where = element_places(DemoModel(cfg), lambda m: parallelize(m, mesh), device)
    config = DistributedConfig(assign=lambda ns_flops, holders, world: {0: []}) if cfg.bad == "assign" else None
    opt = DTensorMuon(param_groups(model, cfg), expert_stacks=expert_stack_names(model), batched_ns=cfg.batched_ns,
                      group=group, distributed_config=config)
    if cfg.bad == "partial":
        from torch.distributed.tensor import Partial

        p = opt.param_by_name["layers.0.fc2.weight"]
        p.grad = DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh, [Partial(), Partial()],
                                    run_check=False, shape=p.shape, stride=p.stride())
        opt.step()
    dp_rank = mesh.get_coordinate()[-2]
    counter = CollectiveCounter(mesh, opt.axis) if cfg.count_comm else None
    if counter is not None:  # one training step's forward and backward, measured; its gradients are dropped
        tokens, targets = (t.to(device) for t in batch(cfg, 0, dp_rank))
        with counter.measuring("forward"):
            loss = model(tokens, targets)
        with counter.measuring("backward"):
            loss.backward()
        opt.zero_grad(set_to_none=True)
    first = 1
    if cfg.resume:
        load_checkpoint(cfg.resume, model, opt)
        first = cfg.resume_step + 1
    step_ms, losses, grads, weights = [], [], [], []  # the last three: cfg.train, one entry per step
    for step in range(first, cfg.steps + 1):
        if cfg.train:
            opt.zero_grad()
            weights.append(local_params(model))  # the weights this step's gradients are taken at
            loss = model(*(t.to(device) for t in batch(cfg, step, dp_rank)))
            loss.backward()  # FSDP2: grads reduce-scattered (mean over dp)
            losses.append(loss.item())
            grads.append(local_grads(model))  # this rank's part of the total gradient the optimizer is given
        else:
            give_grads(model, cfg, step, where)
        measured = counter.measuring("optimizer step") if counter and step == cfg.steps else contextlib.nullcontext()
        t0 = time.perf_counter()
        with measured:
            opt.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if cfg.checkpoint and step == cfg.checkpoint_step:
            save_checkpoint(cfg.checkpoint, model, opt)
    named = list(model.named_parameters())
    return dict(rank=rank, params=local_params(model), where=where, losses=losses, grads=grads, weights=weights,
                ledger=asdict(opt.ledger), comm=counter.records if counter else [], owners=opt.owners,
                batched_ns=opt.batched_ns, table=format_assignments(opt) if rank == 0 else "",
                state_bytes=opt.state_bytes(), step_ms=step_ms, optimizer_places=optimizer_places(model),
                placements={n: str(tuple(p.placements)) if isinstance(p, DTensor) else "plain" for n, p in named})


def local_params(model):
    """{name: a CPU copy of what this rank holds of the parameter}."""
    return {n: local_of(p).detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def optimizer_places(model):
    """{name: the global flat index of each local element} as DTensorMuon's local_indices finds it from the
    placements alone (the tests hold it to element_places, what the wrappers did)."""
    return {n: local_indices(tuple(p.shape), tuple(p.device_mesh.shape), p.placements,
                             p.device_mesh.get_coordinate()) for n, p in model.named_parameters()
            if isinstance(p, DTensor)}


def local_grads(model):
    """{name: a CPU copy of what this rank holds of the parameter's gradient} (total_grads puts them together)."""
    return {n: local_of(p.grad).detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def run_demo_rank(rank, cfg, device):
    """The body of every rank of the demo (mt.spawn_ranks, or a torchrun process): one run on the whole world."""
    torch.set_num_threads(1)
    return run_on_mesh(cfg, rank, device)


class OneProcess:
    """What every one-process reference of a real training shares (this demo's Reference and the GPT's in
    examples/train_gpt_dtensor.py): the plain model's loss and gradients of a step's whole global batch at
    any weights, in fp32 (the ranks' precision) or float64 (the yardstick of verify_training's bound), and
    the chaos floor's one-ulp start. A subclass sets CHAOS_PARAM and tokens_per_step, builds make_model()
    and global_batch(step), and steps torch's optimizers: weights(), step(grads, missing), stepped(name)."""

    CHAOS_PARAM = ""  # the parameter whose entry 0 the chaos floor moves by one ulp

    def __init__(self, cfg, device="cpu"):
        torch.set_num_threads(1)  # bf16 matmul bits may depend on it: the ranks run with one thread too
        self.cfg, self.device = cfg, device
        self.plain = {}  # {dtype: the plain model in that dtype}, built at first use

    def gradients_at(self, weights, step, dtype=torch.float32):
        """(loss, {name: gradient}, on the CPU) of the whole global batch of `step`, every DP rank's tokens at
        once (one mean loss, one matmul per layer), by the plain model in `dtype` at `weights` ({name: full})."""
        if dtype not in self.plain:
            self.plain[dtype] = self.make_model().to(self.device, dtype)
        model = self.plain[dtype]
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
        model.zero_grad(set_to_none=True)
        loss = model(*(t.to(self.device) for t in self.global_batch(step)))
        loss.backward()
        return loss.item(), {n: p.grad.to("cpu", copy=True) for n, p in model.named_parameters()}

    def nudge(self):
        """Entry 0 of CHAOS_PARAM one ulp up, where torch's optimizers hold it: the chaos floor's start
        (muon_tools.py, section 12)."""
        mt.one_ulp_up(self.stepped(self.CHAOS_PARAM))


class Reference(OneProcess):
    """torch.optim.Muon (one 2-D tensor per matrix, per expert) + torch.optim.AdamW(foreach=False) in one process,
    from the demo's initial weights; and the plain model, for the loss and gradients of a whole batch."""

    CHAOS_PARAM = "layers.0.fc1.weight"  # the first layer's first matrix, as train_gpt's CHAOS_PARAM

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        self.model = self.plain[torch.float32] = self.make_model()
        self.tokens_per_step = BATCH * SEQ * cfg.dp
        self.stacks = expert_stack_names(self.model)
        self.tensors = {}  # what the optimizers step: each expert of a stack its own 2-D matrix
        for name, p in self.model.named_parameters():
            self.tensors.update((key, nn.Parameter(piece.clone())) for key, piece in self.pieces(name, p.detach()))
        groups = param_groups(self.model, cfg)
        of = lambda g: [self.tensors[key] for n, p in g["params"] for key, _ in self.pieces(n, p)]
        self.optimizers = [
            (mt.NorMuonReference if cfg.normuon else torch.optim.Muon)(
                of(groups[0]), lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=True,
                adjust_lr_fn=cfg.adjust_lr_fn),
            torch.optim.AdamW([dict(params=of(g), weight_decay=g["weight_decay"]) for g in groups[1:]], lr=cfg.lr,
                              foreach=False)]

    def make_model(self):
        return DemoModel(self.cfg).to(self.device)

    def global_batch(self, step):
        """(tokens, targets) of every DP rank at `step`, concatenated in DP-rank order."""
        return (torch.cat(t) for t in zip(*(batch(self.cfg, step, d) for d in range(self.cfg.dp))))

    def pieces(self, name, tensor):
        """[(the optimizers' name, tensor)] of a parameter (or its gradient): a stack's experts one by one."""
        if name in self.stacks:
            return [(f"{name}[{e}]", tensor[e]) for e in range(tensor.shape[0])]
        return [(name, tensor)]

    def stepped(self, name):
        """The tensor torch's optimizers step that starts with the parameter's entry 0."""
        return self.tensors[self.pieces(name, self.model.get_parameter(name))[0][0]]

    def step(self, grads, missing=()):
        """One step of both optimizers, given every full gradient {name: tensor}; the names in missing get None."""
        for name, g in grads.items():
            for key, piece in self.pieces(name, g.to(self.device)):
                self.tensors[key].grad = None if name in missing else piece.clone()
        for opt in self.optimizers:
            opt.step()

    def weights(self):
        """{name: the full parameter as the optimizers hold it now}, CPU copies."""
        return {name: torch.stack([self.tensors[key] for key, _ in self.pieces(name, p)]).detach().to("cpu")
                if name in self.stacks else self.tensors[name].detach().to("cpu", copy=True)
                for name, p in self.model.named_parameters()}


def run_reference(cfg, device="cpu", losses=None, reference=None, nudge=False):
    """{name: full parameter, on the CPU} after cfg.steps steps of torch's optimizers, fed exact_grads; with
    cfg.train, free-running instead: each step the gradient of the whole batch at its own weights (each step's
    loss appended to `losses`). reference: another model's OneProcess class (examples/train_gpt_dtensor.py).
    nudge: start with entry 0 of the reference's CHAOS_PARAM one ulp up (the chaos floor)."""
    ref = (reference or Reference)(cfg, device)
    if nudge:
        ref.nudge()
    shapes = {n: tuple(t.shape) for n, t in ref.weights().items()}
    for step in range(1, cfg.steps + 1):
        if cfg.train:
            loss, grads = ref.gradients_at(ref.weights(), step)
            if losses is not None:
                losses.append(loss)
        else:
            grads = exact_grads(shapes, cfg.seed, step)
        ref.step(grads, {n for n, s in cfg.missing_grads if s == step})
    return ref.weights()


def verify(cfg, results, reference):
    """One check per parameter: every rank's local elements against torch's at the same places (torch.equal),
    every element held by some rank, and the largest difference.

    "ok" is "identical", except that with cfg.batched_ns a Muon parameter is also ok when every element is
    held and within batched_ns_tolerance (batched Newton-Schulz need not give torch's bits); every other
    parameter must still be bit-identical. cfg may be None (no batched run: tolerance 0).
    """
    checks = []
    for name, ref in reference.items():
        flat = ref.reshape(-1)
        same = all(torch.equal(r["params"][name].reshape(-1), flat[r["where"][name]]) for r in results)
        covered = torch.zeros(flat.numel(), dtype=torch.bool)
        for r in results:
            covered[r["where"][name]] = True
        diff = max(((r["params"][name].reshape(-1) - flat[r["where"][name]]).abs().max().item()
                    if r["where"][name].numel() else 0.0) for r in results)
        batched = cfg is not None and cfg.batched_ns and is_muon(name, ref.ndim)
        # the lesson's bound, per matrix (each expert of a stack: its (out, in))
        tolerance = mt.batched_ns_tolerance(cfg.steps, cfg.lr, cfg.adjust_lr_fn, ref.shape[-2:]) if batched else 0.0
        checks.append(dict(name=name, shape=tuple(ref.shape), placements=results[0]["placements"][name],
                           identical=same and bool(covered.all()), max_abs_diff=diff,
                           optimizer="Muon" if is_muon(name, ref.ndim) else "AdamW", tolerance=tolerance,
                           ok=(same or diff <= tolerance) and bool(covered.all())))
    return checks


# A real training run (cfg.train): FSDP2 x TP forward and backward on real
# tokens, against the same model in one process on the whole batch. Checked as
# every real training of the repository is (muon_tools.py, section 12: the
# policy, the bound and the chaos floor, shared with examples/train_gpt.py):
#
#   replay     torch's optimizers, from the same initial weights, fed the ranks'
#              own total gradients (every rank's part of every .grad before each
#              step, put together at its places: total_grads): every element
#              every rank holds is torch.equal to theirs, at every step. The
#              optimizer is exact on a real FSDP2 x TP run.
#   gradients  before each step, the plain model at the ranks' own weights takes
#              the loss and gradients of the whole global batch, in fp32 and in
#              float64: the ranks' error against float64 within mt.bound_ratio's
#              bound, REALIZED_FACTOR x the one process's + n u max |G_fp64|.
#   trained    both runs free-running from the same start: the losses' largest
#              relative gap, reported beside the chaos floor (the same one-process
#              run started with entry 0 of CHAOS_PARAM one ulp up), as a ratio;
#              never a verdict.
#
# Why the gradients are not bit-identical. Four sums run in another order here
# than in the one process (the demo's step batch: BATCH x SEQ = 16 tokens per DP
# rank, 64 on the 4 x 2 mesh; the GPT's: --batch x --context):
#   * FSDP2's reduce-scatter over dp: each rank sums a weight's gradient over its
#     own tokens, then dp of those partial sums are added (and divided by dp);
#   * the reference's one matmul per layer sums all the step's tokens at once;
#   * RowwiseParallel (fc2, the GPT's projections): each TP rank sums its part
#     of the inner dimension, and the all-reduce over tp adds the partial sums;
#   * ColwiseParallel's backward (fc1, qkv, fc): the gradient of the input sums
#     over the output rows as tp partial sums, all-reduced over tp.
#   (The experts are gathered whole by full_tensor() and run the reference's own
#   einsum; every other layer is replicated over tp and sums as the reference does.)
# The bound's n is the step's tokens (one reordered reduction; FSDP2's division by
# dp is one rounding more, of at most u); a loss is the mean of the DP ranks'
# losses against the float64 loss of the whole batch, with the same n. A test
# halves one rank's gradient and sees FAIL (the replay stays exact: the optimizer
# did what it was given).


def step_errors(ref, weights, step, ranks_loss, ranks_grads):
    """At the ranks' own weights before `step`: the one process's fp32 and float64 loss and gradients against
    the ranks'. {figure: largest value}, each relative to the float64 loss or the tensor's largest float64
    entry, and bound_ratio (with where: its (step, parameter or "loss"))."""
    loss, grads = ref.gradients_at(weights, step)
    loss64, grads64 = ref.gradients_at(weights, step, torch.float64)
    n = ref.tokens_per_step
    out = dict(step_loss_max_rel_diff=abs(ranks_loss - loss) / abs(loss), ranks_loss_err=abs(ranks_loss - loss64)
               / abs(loss64), one_process_loss_err=abs(loss - loss64) / abs(loss64),
               bound_ratio=mt.bound_ratio(abs(ranks_loss - loss64), abs(loss - loss64), n, abs(loss64)),
               bound_worst=(step, "loss"))
    for name, g64 in grads64.items():
        scale = g64.abs().max().item()
        ranks_err = (ranks_grads[name].double() - g64).abs().max().item()
        one_err = (grads[name].double() - g64).abs().max().item()
        figures = dict(grad_max_rel_diff=((ranks_grads[name] - grads[name]).abs().max() / grads[name].abs().max())
                       .item(), ranks_grad_err=ranks_err / scale, one_process_grad_err=one_err / scale)
        out.update((k, largest([out.get(k, 0.0), v])) for k, v in figures.items())
        ratio = mt.bound_ratio(ranks_err, one_err, n, scale)
        if worse(ratio, out["bound_ratio"]):
            out.update(bound_ratio=ratio, bound_worst=(step, name))
    return out


def worse(a, b):
    """Whether figure a is worse than b: larger, or NaN where b is not (a NaN must show, and fail)."""
    return not math.isnan(b) and (math.isnan(a) or a > b)


def worse_of(a, b):
    """Two steps' step_errors, the largest of each figure (bound_worst goes with bound_ratio)."""
    out = {k: largest([a[k], b[k]]) for k in a if k != "bound_worst"}
    out["bound_worst"] = b["bound_worst"] if worse(b["bound_ratio"], a["bound_ratio"]) else a["bound_worst"]
    return out


def replay_differs(ref, ranks, steps, first=1):
    """Feed ref (a OneProcess) the ranks' own total gradients of `steps` steps from step `first` (their grads and
    weights lists start there; params: after their last step): [(step, name)] where some rank's elements after
    that step are not torch.equal to torch's (step first - 1: the weights before step first)."""
    def ranks_at(s):  # every rank's local weights before step first + s; after the last when the list ends
        return [dict(r, params=r["weights"][s] if s < len(r["weights"]) else r["params"]) for r in ranks]

    shapes = {n: tuple(t.shape) for n, t in ref.weights().items()}
    differs = [(first - 1, c["name"]) for c in verify(None, ranks_at(0), ref.weights()) if not c["identical"]]
    for s in range(steps):
        ref.step(total_grads(ranks, s, shapes))
        differs += [(first + s, c["name"]) for c in verify(None, ranks_at(s + 1), ref.weights()) if not c["identical"]]
    return differs


def assemble(ranks, shapes):
    """{name: full tensor} put together from every rank's local elements (r["params"]) at their places."""
    full = {n: torch.full((math.prod(shape),), float("nan")) for n, shape in shapes.items()}
    for r in ranks:
        for name, local in r["params"].items():
            full[name][r["where"][name]] = local.reshape(-1)
    return {n: t.view(shapes[n]) for n, t in full.items()}


def total_grads(ranks, s, shapes):
    """{name: the total gradient of the ranks' step s (0-based in their grads lists)}: every rank's part at its
    places (the last rank's where replicas overlap; replica_gap says whether they agree)."""
    return assemble([dict(r, params=r["grads"][s]) for r in ranks], shapes)


def replica_gap(ranks, s, full):
    """The largest |d| between a rank's part of a gradient of step s and the total at its places: 0 when every
    copy of an element (the ranks a Replicate dim or a plain parameter repeats it on) is the same."""
    return largest([(r["grads"][s][n].reshape(-1) - full[n].reshape(-1)[r["where"][n]]).abs().max()
                    for r in ranks for n in full if r["where"][n].numel()])


def largest(values):
    """The largest of some numbers (or 0-d tensors), NaN if any is NaN (Python's max() may skip a NaN)."""
    return torch.tensor([float(v) for v in values] or [0.0], dtype=torch.float64).max().item()


def verify_training(cfg, results, device="cpu", reference=None):
    """The real FSDP2 x TP training (cfg.train; every rank's result) against one process, the three comparisons
    above: a dict of the figures and "passed" (the replay exact, the replicas equal, bound_ratio <= 1; the
    free-running gap only reported). reference: a OneProcess class for another model (the GPT of
    examples/train_gpt_dtensor.py); None: the demo's."""
    by_rank = {r["rank"]: r for r in results}
    ranks = [by_rank[r] for r in sorted(by_rank)]
    row_heads = [by_rank[d * cfg.tp] for d in range(cfg.dp)]  # the TP ranks of a DP row share its batch and loss
    ranks_loss = [statistics.fmean(r["losses"][s] for r in row_heads) for s in range(cfg.steps)]
    reference = reference or Reference
    ref, errors = reference(cfg, device), None
    shapes = {n: tuple(t.shape) for n, t in ref.weights().items()}
    grads = [total_grads(ranks, s, shapes) for s in range(cfg.steps)]
    replica_diff = largest([replica_gap(ranks, s, grads[s]) for s in range(cfg.steps)])
    for s in range(cfg.steps):
        weights = assemble([dict(r, params=r["weights"][s]) for r in ranks], shapes)
        step = step_errors(ref, weights, s + 1, ranks_loss[s], grads[s])
        errors = step if errors is None else worse_of(errors, step)
    differs = replay_differs(ref, ranks, cfg.steps)  # ref's optimizers have not stepped yet
    free_losses, nudged_losses = [], []
    trained = verify(None, ranks, run_reference(cfg, device, free_losses, reference))
    run_reference(cfg, device, nudged_losses, reference, nudge=True)
    drift = mt.loss_drift([[x] for x in ranks_loss], [[x] for x in free_losses])  # one loss per step: the batch's
    floor = mt.loss_drift([[x] for x in nudged_losses], [[x] for x in free_losses])
    worst = max(trained, key=lambda c: c["max_abs_diff"])
    out = dict(replay_differs=differs, replica_max_diff=replica_diff, **errors, tokens_per_step=ref.tokens_per_step,
               trained_loss_max_rel_diff=drift, chaos_floor_loss_max_rel_diff=floor, chaos_param=ref.CHAOS_PARAM,
               chaos_ratio=drift / floor if floor else None, trained_identical=sum(c["identical"] for c in trained),
               trained_max_abs_diff=worst["max_abs_diff"], trained_worst=worst["name"], n_params=len(shapes),
               steps=cfg.steps)
    out["passed"] = not differs and replica_diff == 0 and out["bound_ratio"] <= 1
    return out


def training_table(out):
    """verify_training's figures for people: one row per comparison, what was measured, against what."""
    n, steps = out["n_params"], out["steps"]
    replay = (f"{n}/{n} parameters identical after each of {steps} steps" if not out["replay_differs"] else
              f"{len(out['replay_differs'])} (step, parameter) differ, first {out['replay_differs'][0]}")
    where, ratio, share = out["bound_worst"], out["chaos_ratio"], out["bound_ratio"]
    share = f"{share:.2g}" if share < 100 else f"{share:,.0f}"  # NaN: "nan" (and FAIL)
    rows = [["replay", "torch's optimizers fed the ranks' own gradients", replay, "torch.equal",
             "PASS" if not out["replay_differs"] else "FAIL"],
            ["replicas", "each rank's part of each gradient vs the total at its places, max |d|",
             f"{out['replica_max_diff']:.1e}", "0",
             "PASS" if out["replica_max_diff"] == 0 else "FAIL"],
            ["gradients", "error vs float64, of each tensor's largest entry",
             f"ranks {out['ranks_grad_err']:.1e}, one process {out['one_process_grad_err']:.1e}",
             f"{mt.REALIZED_FACTOR} x one process + n u", ""],
            ["losses", "error vs float64, relative",
             f"ranks {out['ranks_loss_err']:.1e}, one process {out['one_process_loss_err']:.1e}",
             f"n = {out['tokens_per_step']:,} tokens", ""],
            ["", "largest share of the bound (step, where)", f"{share} ({where[0]}, {where[1]})",
             "<= 1", "PASS" if out["bound_ratio"] <= 1 else "FAIL"],
            ["trained", f"free-running loss gap over {steps} steps, relative",
             f"{out['trained_loss_max_rel_diff']:.1e}",
             f"chaos floor {out['chaos_floor_loss_max_rel_diff']:.1e}: {ratio:.2g}x" if ratio is not None else
             "chaos floor 0: one ulp did not reach the losses", "reported"]]
    return (mt.format_table(["check", "what", "measured", "bound / baseline", "verdict"], rows,
                            ["<", "<", ">", "<", "<"])
            + f"\nchaos floor: the one-process run with entry 0 of {out['chaos_param']} one ulp up; free-running "
              f"weights: {out['trained_identical']}/{n} identical, largest |d| {out['trained_max_abs_diff']:.1e} "
              f"({out['trained_worst']})")


# The explicit form (distmuon/dtensor/, section 4), on parallelism DTensor does not describe: plain
# tensors, each rank keeping its torch.chunk of every matrix's rows (uneven,
# possibly empty). The gather and redistribute below are deliberately plain
# (a padded all-gather and a broadcast per matrix): what a user might write
# first; the optimizer only checks what they return.
EXPLICIT_SHAPES = {"a.weight": (30, 20), "b.weight": (20, 30), "c.weight": (7, 5)}


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


def run_explicit_rank(rank, cfg, device):
    """Every rank: its rows of each EXPLICIT_SHAPES matrix, cfg.steps steps with exact gradients."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    torch.manual_seed(cfg.seed)
    full = {n: torch.randn(s) for n, s in EXPLICIT_SHAPES.items()}
    params = {n: nn.Parameter(rows_of(t, rank, world).clone()) for n, t in full.items()}
    config = explicit_config(world)
    if cfg.bad == "gather":  # tests: at step 2, rank 0's gather gives every matrix it owns a row short
        gather = config.gather
        config = replace(config, gather=lambda u, o: {n: t[:-1] if rank == 0 and step == 2 else t
                                                      for n, t in gather(u, o).items()})
    opt = DTensorMuon([dict(params=list(params.items()), algorithm="muon", lr=cfg.lr,
                            weight_decay=cfg.weight_decay, momentum=cfg.momentum)], distributed_config=config)
    out = dict(rank=rank, owners=opt.owners)
    for step in range(1, cfg.steps + 1):
        for name, g in exact_grads(EXPLICIT_SHAPES, cfg.seed, step).items():
            params[name].grad = rows_of(g, rank, world).clone()
        if cfg.bad and step == 2:
            out.update(refused_step(opt, params))
            break
        opt.step()
    return dict(out, params={n: p.detach() for n, p in params.items()})


def refused_step(opt, params):
    """{"error": what opt.step() raised here ("" if nothing), "unchanged": whether every local parameter and
    state tensor kept its bits}: a step that must be refused, tried."""
    before = local_params_of(params), local_state(opt)
    error = ""
    try:
        opt.step()
    except ValueError as e:
        error = str(e)
    after = local_params_of(params), local_state(opt)
    tensors = lambda snapshot: list(snapshot[0].values()) + [t for s in snapshot[1].values() for t in s.values()]
    return dict(error=error, unchanged=all(torch.equal(a, b) for a, b in zip(tensors(before), tensors(after))))


def run_explicit_reference(cfg):
    torch.set_num_threads(1)
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
#   * equal-size groups (one matrix, one vector: the case that == on tensors broke);
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
    return {n: {k: local_of(t).detach().to("cpu", copy=True) for k, t in opt.state[p].items()}
            for n, p in opt.param_by_name.items()}


def run_placed_rank(rank, run, device):
    """Every rank of the run's mesh: its parameters placed, run.steps steps of exact gradients."""
    from torch.distributed.device_mesh import DeviceMesh

    world = math.prod(run.mesh)
    mesh = DeviceMesh(torch.device(device).type, torch.arange(world).view(run.mesh), mesh_dim_names=run.dims)
    group = dist.new_group(list(range(world))) if world < dist.get_world_size() else None
    if rank >= world:
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
    return dict(out, params=local_params_of(params), where=where, ledger=asdict(opt.ledger), owners=opt.owners,
                placements={n: str(tuple(p.placements)) for n, p in params.items()})


def local_params_of(params):
    return {n: local_of(p).detach().to("cpu", copy=True) for n, p in params.items()}


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
                 ([mt.NorMuonReference(groups["normuon"])] if groups["normuon"] else []) + \
                 ([torch.optim.AdamW(groups["adamw"], foreach=False)] if groups["adamw"] else [])
    for step in range(1, run.steps + 1):
        for n, g in exact_grads(shapes, run.seed, step).items():
            for p, piece in zip(tensors[n], pieces(n, g)):
                p.grad = piece.clone()
        for opt in optimizers:
            opt.step()
    return {n: torch.stack([p.detach() for p in ps]) if n in stacks else ps[0].detach() for n, ps in tensors.items()}


@dataclass(frozen=True)
class Runs:
    """Several DemoConfigs in ONE spawn of dp x tp ranks, one after another, each on its own (sub-)mesh:
    starting 8 ranks costs seconds here, a run on a small model much less."""

    runs: tuple
    dp: int = 8
    tp: int = 1
    timeout_s: float = mt.TIMEOUT_S


def run_many_rank(rank, runs, device):
    torch.set_num_threads(1)
    results = []
    for cfg in runs.runs:
        if isinstance(cfg, LessonRuns):
            results.append(run_lesson_rank(rank, cfg, device))
        elif isinstance(cfg, PlacedRun):
            results.append(run_placed_rank(rank, cfg, device))
        elif cfg.explicit:
            results.append(run_explicit_rank(rank, cfg, device))
        elif cfg.bad:  # tests: the error every rank of the mesh raises, the same on each (never a hang)
            try:
                results.append(run_on_mesh(cfg, rank, device))
            except ValueError as e:
                results.append(dict(rank=rank, error=str(e)))
        else:
            results.append(run_on_mesh(cfg, rank, device))
        dist.barrier()  # the next run's checkpoint may be this one's: every rank done writing first
    return results


# =============================================================================
# 8. Accounting, beside the lesson's strategies
# =============================================================================
# Bytes come from each rank's Ledger: the lesson's send_parts records what every
# all-to-all really sends and receives (exact counts, not a ring model), and
# newton_schulz_owned the FLOPs of every Newton-Schulz call. Gloo's profiler
# records no message sizes, hence the ledger.
#
# Beside the lesson, like for like (--compare): the lesson's OwnerMuon and
# CommFreeMuon are run for real, on the same dp x tp grid, over THIS demo
# model's parameters, given to the lesson as its ParamSpecs (lesson_specs):
# every expert of a stack is its own 2-D matrix (the lesson has no 3-D
# parameters, and no expert parallelism), TP-split as Megatron splits an MLP
# (w1's experts by rows, w2's by columns: column / row parallel, as fc1 / fc2),
# where tp divides the dim; the embedding, head, norms and router are not
# TP-split (as in the demo). Both lessons' ledgers count their own bytes, and
# their results are checked against torch like DTensorMuon's. What each counts is
# NOT the same work, and the table says so:
#   * DTensorMuon's step moves only the owner exchange (and the grad-presence
#     vote): FSDP2 reduce-scatters the gradients in backward and all-gathers
#     the parameters in forward and backward, outside the optimizer, where its
#     Ledger does not look (CollectiveCounter, below, measures them);
#   * the lesson's step holds ZeRO-1 itself: the gradient reduce-scatter and
#     the parameter all-gather (ring counts, (n-1)/n of a bucket per rank; for
#     comm-free the Muon matrices' reduce at / broadcast from the owner row
#     instead) are inside its step, beside its owner exchange; ZeRO-1 keeps
#     whole parameters, so nothing of DP moves in its forward and backward.
# So "owner exchange" compares like with like, and so does "step + DP": the
# optimizer step plus the data-parallel bytes of forward and backward.
DTENSOR_PHASES = ("grad presence", "gather at owner", "scatter from owner")


def account(cfg, results):
    """Bytes per phase (last step; every rank), NS FLOPs per rank (last step), and whether steps moved the same."""
    ledgers = [r["ledger"] for r in results]
    tables = [mt.bytes_per_step(ledgers, s, DTENSOR_PHASES) for s in range(1, cfg.steps + 1)]
    flops = [sum(c["flops"] for c in ledger["compute"] if c["step"] == cfg.steps) for ledger in ledgers]
    return tables[-1], all(t == tables[0] for t in tables), flops


def single_device_flops(cfg):
    model = DemoModel(cfg)
    stacks = expert_stack_names(model)
    return sum(newton_schulz_flops(tuple(p.shape[-2:])) * (p.shape[0] if n in stacks else 1)
               for g in param_groups(model, cfg)[:1] for n, p in g["params"])


# FSDP2's and the TP layers' own traffic, measured (--compare)
# -------------------------------------------------------------
# FSDP2 and DTensor's TP layers move bytes in forward and backward, outside the
# optimizer, where no Ledger sees them, and Gloo's profiler records no message
# sizes. So CollectiveCounter counts them: a TorchDispatchMode, active around one
# training step, that sees every collective this rank dispatches, with its
# tensors and its process group. In torch 2.14 they reach the dispatcher as:
#   FSDP2            c10d._allgather_base_: the parameters, in forward, and again in
#                    backward for every unit but the root (which keeps its parameters
#                    unsharded from forward to backward); c10d._reduce_scatter_base_:
#                    the gradients, in backward. ONE flat buffer per unit (a layer;
#                    the root: embedding and head), each parameter's shard padded on
#                    its FSDP dim to ceil(size / dp) (the padding travels too).
#   DTensor TP       _c10d_functional.all_reduce: RowwiseParallel fc2's output in
#                    forward, ColwiseParallel fc1's input gradient in backward;
#                    _c10d_functional.all_gather_into_tensor: the experts' full_tensor()
#                    in forward (its backward only slices, no message).
#   DTensorMuon      c10d.allreduce_ (the grad-presence vote) and c10d.alltoall_base_
#                    (the owner exchange): the same bytes as its Ledger (a test checks).
# Bytes SENT per rank, counted as the lesson's Ledger counts (its section 2): a
# ring all-gather sends (n - 1) shards, a ring reduce-scatter (n - 1) chunks of
# numel / n, a ring all-reduce 2 (n - 1) chunks of ceil(numel / n), an all-to-all
# what goes to the other ranks; n is the group's size. (Gloo's own algorithms may
# move more: its reduce-scatter is an all-reduce.) Any other collective is
# recorded as "not counted: <op>", and the tests assert that there is none.
c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional
unbox, group_named = dist.ProcessGroup.unbox, dist.distributed_c10d._resolve_process_group
# op: (kind, its arguments -> ([the tensors counted], the process group, input split sizes or None)). Arguments:
# c10d ops (output, input, group, ...) but allreduce_ ([tensors], group, ...) and alltoall_base_ (..., output
# splits, input splits); functional ones (input, ..., group name) with the group size or splits in between.
COLLECTIVES = {
    c10d._allgather_base_.default: ("all-gather", lambda a: ([a[1]], unbox(a[2]), None)),
    c10d._reduce_scatter_base_.default: ("reduce-scatter", lambda a: ([a[1]], unbox(a[2]), None)),
    c10d.allreduce_.default: ("all-reduce", lambda a: (a[0], unbox(a[1]), None)),
    c10d.alltoall_base_.default: ("all-to-all", lambda a: ([a[1]], unbox(a[2]), a[4])),
    funcol.all_reduce.default: ("all-reduce", lambda a: ([a[0]], group_named(a[2]), None)),
    funcol.all_gather_into_tensor.default: ("all-gather", lambda a: ([a[0]], group_named(a[2]), None)),
    funcol.reduce_scatter_tensor.default: ("reduce-scatter", lambda a: ([a[0]], group_named(a[3]), None)),
    funcol.all_to_all_single.default: ("all-to-all", lambda a: ([a[0]], group_named(a[3]), a[2])),
}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
NOT_MESSAGES = ("wait_tensor", "_wrap_tensor_autograd")  # in those namespaces, but they move nothing


def ring_sent(kind, numel, n, rank, splits):
    """Elements a rank sends in one collective of `numel` elements (its shard for an all-gather) over n ranks."""
    if kind == "all-gather":
        return (n - 1) * numel
    if kind == "reduce-scatter":
        return (n - 1) * (numel // n)
    if kind == "all-reduce":
        return 2 * (n - 1) * -(-numel // n)
    splits = list(splits) or [numel // n] * n  # all-to-all: what goes to the others
    per_split = numel // sum(splits) if sum(splits) else 0
    return (sum(splits) - splits[rank]) * per_split


class CollectiveCounter(TorchDispatchMode):
    """Every collective this rank dispatches while measuring(phase) is active: records of dicts (phase, op, axis,
    dtype, numel, ranks, sent), sent in bytes as the Ledger counts them."""

    def __init__(self, mesh, axis):
        super().__init__()
        # Group name -> mesh dim. The optimizer's group first: a mesh dim spanning it may be the same group, and
        # is then named after the dim.
        self.axis_of = {(axis.group or dist.group.WORLD).group_name: "world"}
        self.axis_of.update({mesh.get_group(d).group_name: d for d in mesh.mesh_dim_names})
        self.phase, self.records = "", []

    @contextlib.contextmanager
    def measuring(self, phase):
        self.phase = phase
        with self:
            yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES and func.overloadpacket.__name__ not in NOT_MESSAGES:
            given = list(args) + [kwargs.get(a.name, a.default_value) for a in func._schema.arguments[len(args):]]
            self.records.append(self.record(func, given))
        return func(*args, **kwargs)

    def record(self, func, args):
        if func not in COLLECTIVES:
            return dict(phase=self.phase, op=f"not counted: {func}", axis="?", dtype="?", numel=0, ranks=0, sent=0)
        kind, unpack = COLLECTIVES[func]
        tensors, group, splits = unpack(args)
        numel, dtype = sum(t.numel() for t in tensors), tensors[0].dtype
        sent = ring_sent(kind, numel, group.size(), group.rank(), splits or ()) * dtype.itemsize
        return dict(phase=self.phase, op=kind, axis=self.axis_of.get(group.group_name, group.group_name),
                    dtype=str(dtype).replace("torch.", ""), numel=numel, ranks=group.size(), sent=sent)


FORWARD_BACKWARD = ("forward", "backward")


def measured_sent(results, phases, axis=None):
    """Bytes each rank sent (a list, rank order) in the measured phases, on one mesh dim (None: all)."""
    return [sum(c["sent"] for c in r["comm"] if c["phase"] in phases and axis in (None, c["axis"]))
            for r in sorted(results, key=lambda r: r["rank"])]


def measured_table(results):
    """{(phase, op, axis, dtype): dict(calls=[per rank], sent=[bytes per rank])} of the measured training step."""
    table = {}
    ranks = sorted(results, key=lambda r: r["rank"])
    for i, r in enumerate(ranks):
        for c in r["comm"]:
            row = table.setdefault((c["phase"], c["op"], c["axis"], c["dtype"]),
                                   dict(calls=[0] * len(ranks), sent=[0] * len(ranks)))
            row["calls"][i] += 1
            row["sent"][i] += c["sent"]
    return table


# The demo's TP split dims, as the lesson's ParamSpec.tp_split_dim (-1: not split); experts per matrix.
LESSON_TP_SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "moe.w1": 0, "moe.w2": 1}
OWNER_EXCHANGE = ("gather at owner", "scatter from owner")
DP_IN_STEP = ("grad reduce-scatter", "param all-gather", "grad reduce at owner", "update broadcast from owner")


def lesson_specs(cfg):
    """This demo model's parameters as the lesson's [dm.ParamSpec]: each expert of a stack its own 2-D matrix."""
    model = DemoModel(cfg)
    stacks = expert_stack_names(model)
    specs = []
    for name, p in model.named_parameters():
        group = "muon" if is_muon(name, p.ndim) else "adamw" if name.startswith(("embed.", "head.")) \
            else "adamw_no_wd"
        shape = tuple(p.shape[1:]) if name in stacks else tuple(p.shape)
        split = LESSON_TP_SPLIT.get(".".join(name.split(".")[-2:]), -1)
        if split >= 0 and shape[split] % cfg.tp:
            split = -1  # the lesson splits evenly only: replicated over TP instead
        names = [f"{name}[{e}]" for e in range(p.shape[0])] if name in stacks else [name]
        specs += [dm.ParamSpec(n, shape, split, group) for n in names]
    return specs


def lesson_config(cfg, strategy):
    return mt.RunConfig(dp=cfg.dp, tp=cfg.tp, steps=cfg.steps, seed=cfg.seed, lr=cfg.lr, momentum=cfg.momentum,
                        weight_decay=cfg.weight_decay, strategy=strategy)


@dataclass(frozen=True)
class LessonRuns:
    """The lesson's strategies on this demo's matrices, on the grid dp x tp (a mt.spawn_ranks cfg, or a run
    inside Runs)."""

    demo: DemoConfig
    strategies: tuple = ("owner", "comm-free")

    @property
    def dp(self):
        return self.demo.dp

    @property
    def tp(self):
        return self.demo.tp

    @property
    def timeout_s(self):
        return self.demo.timeout_s


def run_lesson_rank(rank, runs, device):
    """Every rank: the lesson's own steps (dm.run_steps, with mt.build_optimizer) on lesson_specs, one optimizer
    per strategy; {strategy: what run_steps returned}."""
    torch.set_num_threads(1)
    cfg = runs.demo
    specs = lesson_specs(cfg)
    grid = dm.make_grid(cfg.dp, cfg.tp, rank)
    out = {}
    for strategy in runs.strategies:
        lcfg = lesson_config(cfg, strategy)
        out[strategy] = dm.run_steps(lcfg, specs, functools.partial(mt.build_optimizer, specs, lcfg), grid, device)
    return dict(rank=rank, lesson=out)


def lesson_accounts(runs, results):
    """{strategy: dict(checks, table, flops)}: each lesson run checked against torch (as the lesson checks
    itself), its bytes per phase (last step) and its Newton-Schulz FLOPs per rank (last step)."""
    cfg, specs = runs.demo, lesson_specs(runs.demo)
    accounts = {}
    for strategy in runs.strategies:
        lcfg = lesson_config(cfg, strategy)
        ledgers = [r["lesson"][strategy]["ledger"] for r in results]
        reference = mt.reference_params(specs, lcfg)
        checks = dm.check_against_torch(specs, [r["lesson"][strategy] for r in results], reference, cfg.tp)
        accounts[strategy] = dict(checks=checks, table=mt.bytes_per_step(ledgers, cfg.steps, mt.PHASES_OF[strategy]),
                                  flops=mt.flops_per_step(ledgers, specs, cfg.steps, NS_STEPS))
    return accounts


def phase_bytes(table, phases):
    """Bytes sent per rank (a list) over the phases of `table` among `phases`."""
    rows = [table[p]["sent"] for p in phases if p in table]
    return [sum(col) for col in zip(*rows)] if rows else None


def comparison_rows(cfg, results, accounts):
    """One row per optimizer (this one and the lesson's strategies; same matrices, same grid, last step), as
    COMPARISON_HEADER; and {optimizer: (bytes sent per rank in its step plus DP in forward / backward, NS FLOPs
    per rank)}. DTensorMuon's forward / backward figures are CollectiveCounter's (results run with count_comm)."""
    table, _, flops = account(cfg, results)
    single = single_device_flops(cfg)
    runs = [("DTensorMuon", table, flops, sum(flops) / single,
             measured_sent(results, FORWARD_BACKWARD, "dp"), measured_sent(results, FORWARD_BACKWARD, "tp"))]
    for strategy, acc in accounts.items():  # ZeRO-1 keeps whole parameters: no DP message in forward / backward
        runs.append((f"lesson {strategy}", acc["table"], acc["flops"]["per_rank"], acc["flops"]["redundancy"],
                     [0] * len(flops), None))
    rows, per_rank = [], {}
    for label, t, f, redundancy, dp_outside, tp_outside in runs:
        total = [a + b for a, b in zip(phase_bytes(t, tuple(t)), dp_outside)]
        dp_bytes = phase_bytes(t, DP_IN_STEP)
        rows.append([label, mt.human_bytes(max(phase_bytes(t, OWNER_EXCHANGE))),
                     mt.human_bytes(max(dp_bytes) if dp_bytes else 0), mt.human_bytes(max(dp_outside)),
                     mt.human_bytes(max(total)), mt.human_bytes(sum(total)),
                     mt.human_bytes(max(tp_outside)) if tp_outside else "not run", f"{max(f) / 1e9:.4f}",
                     f"{sum(f) / len(f) / 1e9:.4f}", f"{redundancy:.2f}"])
        per_rank[label] = (total, f)
    return rows, per_rank


COMPARISON_HEADER = ["optimizer", "owner exchange", "DP in step", "DP in fwd/bwd", "step + DP", "all ranks",
                     "TP in fwd/bwd", "NS GFLOP max", "mean", "redundancy"]
MEASURED_HEADER = ["phase", "collective", "mesh dim", "dtype", "calls", "sent/rank (max)", "sent, all ranks"]


def measured_rows(results):
    """The measured training step (CollectiveCounter) as rows of MEASURED_HEADER."""
    return [[phase, op, axis, dtype, max(t["calls"]), mt.human_bytes(max(t["sent"])), mt.human_bytes(sum(t["sent"]))]
            for (phase, op, axis, dtype), t in measured_table(results).items()]


def print_comparison(cfg, rows, per_rank, accounts, results, print_fn=print):
    ledger_sent = phase_bytes(account(cfg, results)[0], DTENSOR_PHASES)
    counted_sent = measured_sent(results, ("optimizer step",))
    print_fn(f"\n[8] FSDP2 and the TP layers in one training step (forward and backward of {BATCH} x {SEQ} tokens per "
             f"DP rank), measured by CollectiveCounter: every collective each rank dispatched, bytes sent per rank "
             f"as the Ledger counts (ring counts for all-gather, reduce-scatter, all-reduce; the optimizer step's "
             f"own collectives beside them, {'equal to' if counted_sent == ledger_sent else 'NOT equal to'} its "
             f"Ledger's on every rank):")
    print_fn(mt.format_table(MEASURED_HEADER, measured_rows(results), ["<", "<", "<", "<", ">", ">", ">"]))
    print_fn(f"\n[8] Beside the lesson's owner and comm-free strategies, run for real on THIS model's matrices "
             f"(each expert its own 2-D matrix), same mesh dp={cfg.dp} x tp={cfg.tp}, last step; bytes sent per "
             f"rank (max over ranks) unless 'all ranks':")
    for strategy, acc in accounts.items():
        n_same = sum(c["identical"] for c in acc["checks"])
        print_fn(f"lesson {strategy} on these {len(acc['checks'])} parameters: {n_same}/{len(acc['checks'])} "
                 f"bit-identical to torch")
    print_fn(mt.format_table(COMPARISON_HEADER, rows, ["<"] + [">"] * 9))
    for label, (sent, flops) in per_rank.items():
        print_fn(f"{label:<24} step + DP, sent per rank: {', '.join(mt.human_bytes(b) for b in sent)}")
        print_fn(f"{'':<24} NS GFLOP per rank: {', '.join(f'{f / 1e9:.4f}' for f in flops)}")
    print_fn("owner exchange = gather at owner + scatter from owner (bf16, exact all-to-all counts). DP in step = "
             "ZeRO-1's grad reduce-scatter + param all-gather (fp32, ring counts), and for comm-free the matrices' "
             "grad reduce at the owner row (fp32) and the update broadcast from it (bf16); DTensorMuon's step has none. DP in fwd/bwd = "
             "FSDP2's param all-gathers (forward, and again in backward) and grad reduce-scatters (measured above); "
             "ZeRO-1 keeps whole parameters and has none. step + DP = the optimizer step (with the grad-presence "
             "vote) + DP in fwd/bwd. TP in fwd/bwd = the TP layers' all-reduces and the experts' all-gathers "
             "(measured); the lesson's runs have no model, so theirs were not run.")


# =============================================================================
# 9. Main: the command line
# =============================================================================
# Checks every argument before any rank starts (exit 2, one line), then starts
# dp x tp Gloo ranks with the lesson's launcher (a failing, killed or silent
# rank: exit 1 naming it; Ctrl-C 130; SIGTERM 143), runs torch's reference in
# this process, and prints the mesh, the owners, the bytes and the verdict.
#
# Under torchrun (RANK, WORLD_SIZE and LOCAL_RANK set), this process is one
# rank instead, through muon_tools.run_under_torchrun (shared with the lesson's GPU
# twin and the GPT example): the same checks on every rank (rank 0 prints the
# line; the world size must be dp x tp), the device checks and the join (NCCL
# needs cuda, a GPU per LOCAL_RANK; the process is bound to cuda:LOCAL_RANK),
# the same rank body (run_demo_rank) on that device, and rank 0 gathers every
# rank's results (gather_object), runs the reference on its device and prints
# the same report. A rank's error is printed by that rank in one line (exit 1);
# torchrun stops the others. --compare is refused there: it spawns the lesson's
# strategies on Gloo ranks of its own.

def validate(cfg):
    mt.check_topology(cfg.dp, cfg.tp)
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1 (got {cfg.steps})")
    mt.check_seed(cfg.seed)
    mc.check_hyperparameters(mt.flag, bucket_size=1, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             momentum=cfg.momentum, adjust_lr_fn=cfg.adjust_lr_fn)
    if cfg.lr == 0:
        raise ValueError("--lr must be > 0: with lr 0 no weight moves and the comparison proves nothing")
    if cfg.layers < 1 or cfg.experts < 1:
        raise ValueError(f"--layers and --experts must be >= 1 (got {cfg.layers}, {cfg.experts})")
    if demo_parameters(cfg) > mt.MAX_DEMO_PARAMETERS:  # every rank builds the whole model before sharding it
        raise ValueError(f"--layers {cfg.layers} x --experts {cfg.experts}: {demo_parameters(cfg):,} parameters, more "
                         f"than the {mt.MAX_DEMO_PARAMETERS:,} a laptop's ranks can each hold whole")
    with torch.random.fork_rng(devices=[]):  # the seed it sets (manual_seed) undone on the way out
        model = DemoModel(replace(cfg, layers=1))  # every layer's shapes; milliseconds ("meta" took a second)
    groups = param_groups(model, cfg)
    mt.check_step_numbers(mt.flag, groups, [p.shape[-2:] for _, p in groups[0]["params"]])  # each expert a matrix
    if cfg.train and (4 * cfg.d) % cfg.tp:
        raise ValueError(f"--train with TP {cfg.tp}: torch's ColwiseParallel -> RowwiseParallel forward needs TP to "
                         f"divide the hidden size {4 * cfg.d} (it takes the uneven pieces for even ones); without "
                         f"--train (exact gradients, no forward) any TP runs")
    if cfg.train and cfg.batched_ns:
        raise ValueError("--train checks its replay against torch bit for bit, which --batched-ns does not promise: "
                         "use one of them")
    mt.check_launch(cfg.timeout_s)


def build_parser():
    d = DemoConfig()
    p = mt.OneLineParser(description="Distributed Muon for DTensor parameters (FSDP2 x TP on a 2-D mesh, "
                                            "a MoE expert stack) on CPU Gloo ranks, or one rank per process under "
                                            "torchrun, checked bit for bit against torch.optim.Muon / AdamW.")
    p.add_argument("--dp", type=int, default=d.dp, help="FSDP2 (mesh dim 'dp') size (default %(default)s)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel (mesh dim 'tp') size (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of weights and gradients (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (default %(default)s)")
    p.add_argument("--momentum", type=float, default=d.momentum, help="Muon momentum (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="weight decay (default %(default)s)")
    p.add_argument("--layers", type=int, default=d.layers, help="layers of the demo model (default %(default)s)")
    p.add_argument("--experts", type=int, default=d.experts, help="experts per MoE layer (default %(default)s)")
    p.add_argument("--batched-ns", action="store_true",
                   help="owners orthogonalize same-shape matrices in one batched call: need not be bit-identical "
                        "to torch, so each Muon matrix is checked within steps x adjusted lr x 1.5 x 2**-5 (the "
                        "lesson's bound) and every other parameter bit for bit")
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s", metavar="SECONDS",
                   help="a rank silent this long ends the run (default %(default)s)")
    p.add_argument("--train", action="store_true",
                   help=f"real forward and backward on random tokens ({BATCH} x {SEQ} per DP rank a step) instead of "
                        "exact gradients, checked as train_gpt checks a training: the replay of the ranks' own "
                        "gradients bit for bit, the gradients within a bound derived from the arithmetic, the "
                        "free-running gap reported beside a one-ulp chaos floor")
    p.add_argument("--compare", action="store_true",
                   help="also run the lesson's owner and comm-free strategies on this model's matrices, on the same "
                        "grid, measure what FSDP2 and the TP layers send in one training step, and print bytes and "
                        "Newton-Schulz FLOPs per rank side by side")
    p.add_argument("--json", metavar="PATH", help="write the run's checks, owners, bytes and FLOPs")
    p.add_argument("--traceback", action="store_true", help="on a rank's failure, print its traceback too")
    mt.add_backend_flags(p)
    return p


def report_parameters(cfg, checks, print_fn=print):
    """[7] of exact gradients: one row per parameter against torch; returns mt.verdict's (passed, line)."""
    print_fn("[7] Every rank's local elements against torch.optim.Muon / AdamW in one process:")
    rows = [[c["name"], "x".join(map(str, c["shape"])), c["placements"], c["optimizer"],
             f"{c['max_abs_diff']:.1e}" if c["max_abs_diff"] else "0",
             "yes" if c["identical"] else f"no, <= {c['tolerance']:.1e}" if c["ok"] else "NO"]
            for c in checks]
    print_fn(mt.format_table(["parameter", "shape", "placements", "optimizer", "max |d|", "identical"], rows,
                             ["<", ">", "<", "<", ">", ">"]) + "\n")
    if cfg.batched_ns:
        bounds = {"x".join(map(str, c["shape"][-2:])): c["tolerance"] for c in checks if c["optimizer"] == "Muon"}
        print_fn("--batched-ns: each Muon matrix is held to steps x adjusted lr x 1.5 x BATCHED_NS_BOUND (2**-5) "
                 "of torch's (the lesson's batched_ns_tolerance), every other parameter bit for bit; bounds: "
                 + ", ".join(f"{shape} {bound:.1e}" for shape, bound in bounds.items()) + "\n")
    return mt.verdict(checks)


def report(cfg, results, checks, print_fn=print):
    """The checks ([7]: verify's per-parameter list; verify_training's dict with cfg.train), the bytes and
    FLOPs ([8]) and the verdict, printed; returns the JSON dict."""
    if cfg.train:
        print_fn(f"[7] A real training ({BATCH} x {SEQ} = {BATCH * SEQ} random tokens per DP rank a step, {cfg.steps} "
                 f"steps) against torch.optim.Muon / AdamW in one process on each step's whole batch (FSDP2 and TP "
                 f"sum in other orders):")
        print_fn(training_table(checks) + "\n")
        passed = checks["passed"]
        line = (f"{'PASS' if passed else 'FAIL'}: the replay bit for bit, the gradients within the derived bound "
                f"(the free-running gap reported, not checked)")
    else:
        passed, line = report_parameters(cfg, checks, print_fn)
    world = cfg.dp * cfg.tp
    table, same, flops = account(cfg, results)
    print_fn(f"[8] Bytes per step, counted by the ledger (exact all-to-all counts; "
             f"{'the same every step' if same else 'last step; steps differ'}):")
    rows = [[phase, t["dtype"], mt.human_bytes(max(t["sent"])), mt.human_bytes(max(t["received"])),
             mt.human_bytes(sum(t["sent"]))] for phase, t in table.items()]
    max_sent, all_sent = mt.total_bytes(table)
    rows.append(["total", "", mt.human_bytes(max_sent), mt.human_bytes(mt.total_bytes(table, "received")[0]),
                 mt.human_bytes(all_sent)])
    print_fn(mt.format_table(["phase", "dtype", "sent/rank (max)", "received/rank (max)", "sent, all ranks"], rows,
                             ["<", "<", ">", ">", ">"]))
    print_fn("per rank sent: " + ", ".join(mt.human_bytes(sum(t["sent"][r] for t in table.values()))
                                           for r in range(world)))
    single = single_device_flops(cfg)
    print_fn(f"[8] Newton-Schulz GFLOP per rank (last step): {', '.join(f'{f / 1e9:.4f}' for f in flops)}; "
             f"single device {single / 1e9:.4f}; redundancy {sum(flops) / single:.2f}\n")
    print_fn(f"Result: {line}")
    return dict(config=asdict(cfg), torch=torch.__version__, passed=passed, checks=checks, owners=results[0]["owners"],
                bytes_per_step=table, bytes_same_every_step=same, ns_flops_per_rank=flops, ns_flops_single=single,
                state_bytes=[r["state_bytes"] for r in results])


def demo_config(args):
    return DemoConfig(dp=args.dp, tp=args.tp, steps=args.steps, seed=args.seed, lr=args.lr, momentum=args.momentum,
                      weight_decay=args.weight_decay, layers=args.layers, experts=args.experts,
                      batched_ns=args.batched_ns, timeout_s=args.timeout_s, count_comm=args.compare, train=args.train)


def print_header(cfg, ranks, print_fn=print):
    print_fn(f"DTensorMuon: {cfg.dp * cfg.tp} {ranks}, mesh dp={cfg.dp} x tp={cfg.tp} (rank = dp_rank * tp + tp_rank), "
             f"{cfg.steps} steps, torch {torch.__version__}")
    print_fn(mt.format_grid(cfg.dp, cfg.tp) + "\n")


def finish(cfg, results, ranks_s, device="cpu", print_fn=print):
    """Once every rank's result is in one process: the owners and placements, the verification against torch's
    reference (run on `device`; compared on the CPU) and the report; returns the JSON dict."""
    print_fn("[3] Owners: longest-processing-time over Newton-Schulz FLOPs, among each matrix's holders")
    print_fn(results[0]["table"] + "\n")
    print_fn("[2] Placements: " + "; ".join(sorted({f"{n.split('.')[-2]}.{n.split('.')[-1]} {p}"
                                                   for n, p in results[0]["placements"].items()
                                                   if n.startswith("layers.0.")})) + "\n")
    t0 = time.perf_counter()
    checks = verify_training(cfg, results, device) if cfg.train else verify(cfg, results, run_reference(cfg, device))
    checked_s = time.perf_counter() - t0
    out = report(cfg, results, checks, print_fn)
    # the ranks step together (each step ends in collectives): a step takes as long as its slowest rank's
    steps = len(results[0]["step_ms"])
    steps_s = sum(max(r["step_ms"][i] for r in results) for i in range(steps)) / 1e3
    made = "forward and backward" if cfg.train else "the exact gradients"
    shown = mt.rounded_parts(dict(steps=steps_s, rest=ranks_s - steps_s), 1)  # tenths of a second that add up
    print_fn(f"Timing: ranks {sum(shown.values()):.1f} s = {steps} optimizer steps {shown['steps']:.1f} s (each its "
             f"slowest rank's) + the rest {shown['rest']:.1f} s (start, build, {made}, the copies the checks read); "
             f"torch's reference and the checks {checked_s:.1f} s")
    out["timings"] = dict(ranks_s=ranks_s, optimizer_steps_s=steps_s, reference_and_checks_s=checked_s)
    return out


def main(argv=None):
    args = build_parser().parse_args(argv)
    if mt.under_torchrun():
        return main_torchrun(args)

    def work():
        mt.backend_flags(args)
        cfg = demo_config(args)
        validate(cfg)
        if args.json:
            mt.check_writable(args.json)
        print_header(cfg, "CPU ranks over Gloo")
        t0 = time.perf_counter()
        results = mt.spawn_ranks(cfg, run_demo_rank)
        out = finish(cfg, results, time.perf_counter() - t0)
        if args.compare:
            lesson = LessonRuns(cfg)
            accounts = lesson_accounts(lesson, mt.spawn_ranks(lesson, run_lesson_rank))
            rows, per_rank = comparison_rows(cfg, results, accounts)
            print_comparison(cfg, rows, per_rank, accounts, results)
            out["comparison"] = dict(header=COMPARISON_HEADER, rows=rows, per_rank=per_rank,
                                     measured_header=MEASURED_HEADER, measured_rows=measured_rows(results),
                                     measured=[r["comm"] for r in results],
                                     lesson_checks={s: a["checks"] for s, a in accounts.items()},
                                     lesson_bytes_per_step={s: a["table"] for s, a in accounts.items()})
            lesson_ok = all(c["identical"] for a in accounts.values() for c in a["checks"])
            out["passed"] = out["passed"] and lesson_ok
        mt.write_json(args.json, out)
        return 0 if out["passed"] else 1

    return mt.exit_code(work, args.traceback)


def main_torchrun(args):
    """Under torchrun: this process is one rank (section 9's comment); rank 0 prints, verifies and writes --json."""
    def prepare(world):
        cfg = demo_config(args)
        mt.check_topology(cfg.dp, cfg.tp, world)
        validate(cfg)
        if args.compare:
            raise ValueError("--compare spawns the lesson's strategies on Gloo ranks of its own: run it without "
                             "torchrun")
        if args.json:
            mt.check_writable(args.json)
        return cfg

    def body(cfg, rank, device):
        if rank == 0:
            print_header(cfg, f"ranks under torchrun over {'NCCL' if args.backend == 'nccl' else 'Gloo'} "
                              f"({args.device})")
        return run_demo_rank(rank, cfg, device)

    def report_at_rank_0(cfg, gathered, device, seconds):
        out = finish(cfg, gathered, seconds, device)
        out["launcher"] = dict(launcher="torchrun", backend=args.backend, device=args.device)
        mt.write_json(args.json, out)
        return 0 if out["passed"] else 1

    args.backend, args.device = mt.backend_flags(args)
    return mt.run_under_torchrun(args.backend, args.device, prepare, body, report_at_rank_0, args.traceback)


if __name__ == "__main__":
    sys.exit(main())
