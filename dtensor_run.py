"""The demo's model and one run of it on a mesh: a small transformer with a mixture-of-experts layer,
parallelized as torchtitan does (TP inside a row of the mesh, FSDP2 across the rows), stepped by DTensorMuon on
exact gradients or on real batches. dtensor_demo.py runs it; dtensor_verify.py checks it against torch."""

import contextlib
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import distributed_muon_cpu
from distmuon import owners
import muon_tools
from collective_counter import CollectiveCounter
from distmuon.dtensor import DTensorMuon, load_checkpoint, local_indices, local_of, save_checkpoint

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
# The check is the lesson's: exact gradients (integers times 2**-10, so that no
# summation order can matter) go to every rank as DTensors with the parameter's
# placements, and the same full gradients to torch's optimizers in one process
# (dtensor_verify.py). Where each local element sits (element_places) is read off
# a copy of the model whose parameters hold their own flat indices, put through
# the same parallelize: what TP and FSDP2 do with the data, not the optimizer's
# arithmetic. Nothing in a rank's body is CPU-specific: what a rank returns is
# copied to the CPU, where the comparison is made.


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
    exchange_bytes: int | str | None = None  # DTensorMuon's: the step group by group, at most this many bytes each
    overlap: int = 0  # DTensorMuon's: K groups' gathers in flight while a group's Newton-Schulz runs
    timeout_s: float = muon_tools.TIMEOUT_S
    missing_grads: tuple = ()  # (name, step): a gradient None on every rank at that step
    checkpoint: str = ""  # a folder: save after checkpoint_step
    checkpoint_step: int = 0
    resume: str = ""  # a folder to load before step resume_step + 1
    resume_step: int = 0
    train: bool = False  # real forward / backward through FSDP2 and TP instead of exact gradients (verify_training)
    count_comm: bool = False  # --compare: one training step's collectives, measured (CollectiveCounter)
    normuon: bool = False  # the Muon group takes NorMuon (distmuon/normuon.py), checked against muon_tools.NorMuonReference


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
    load, _ = owners.load_balance(opt.ns_flops, opt.owners, opt.world)
    rows = [[r, sum(o == r for o in opt.owners.values()), f"{load[r] / 1e9:.4f}",
             " ".join(n for n, o in opt.owners.items() if o == r) or "-"] for r in range(opt.world)]
    table = muon_tools.format_table(["rank", "matrices", "NS GFLOP", "owns"], rows, [">", ">", ">", "<"])
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
        grads[name] = torch.randint(-distributed_muon_cpu.GRAD_MAX_INT, distributed_muon_cpu.GRAD_MAX_INT + 1, shape,
                                    generator=g).float() * distributed_muon_cpu.GRAD_SCALE
    return grads


def build_optimizer(model, cfg):
    return DTensorMuon(param_groups(model, cfg), expert_stacks=expert_stack_names(model), batched_ns=cfg.batched_ns,
                       exchange_bytes=cfg.exchange_bytes, overlap=cfg.overlap)


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


def mesh_of(shape, names, device):
    """(mesh, group): a DeviceMesh of `shape` over the first prod(shape) ranks of the world, and the process group
    its optimizer takes (None when the mesh is the whole world). Collective over the whole world, as DeviceMesh and
    new_group are: every rank calls it, those outside the mesh too (the tests run many meshes in one spawn)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = math.prod(shape)
    mesh = DeviceMesh(torch.device(device).type, torch.arange(world).view(shape), mesh_dim_names=names)
    return mesh, dist.new_group(list(range(world))) if world < dist.get_world_size() else None


def build_on_mesh(cfg, rank, device, distributed_config=None):
    """(mesh, model, where, opt): the demo parallelized on a mesh of the first replicate x dp x tp ranks, its
    element_places and its DTensorMuon; None on ranks outside the mesh. device: this rank's ("cpu";
    "cuda:<local rank>" under torchrun with NCCL)."""
    shape, names = ((cfg.dp, cfg.tp), ("dp", "tp")) if cfg.replicate == 1 else \
        ((cfg.replicate, cfg.dp, cfg.tp), ("replicate", "dp", "tp"))
    mesh, group = mesh_of(shape, names, device)
    if rank >= math.prod(shape):
        return None
    model = parallelize(DemoModel(cfg).to(device), mesh)
    where = element_places(DemoModel(cfg), lambda m: parallelize(m, mesh), device)
    opt = DTensorMuon(param_groups(model, cfg), expert_stacks=expert_stack_names(model), batched_ns=cfg.batched_ns,
                      group=group, distributed_config=distributed_config, exchange_bytes=cfg.exchange_bytes,
                      overlap=cfg.overlap)
    return mesh, model, where, opt


def run_on_mesh(cfg, rank, device):
    """Build the demo on its mesh (build_on_mesh) and step it; return what the parent checks, every tensor on the
    CPU (None on ranks outside the mesh)."""
    built = build_on_mesh(cfg, rank, device)
    if built is None:
        return None
    mesh, model, where, opt = built
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


def local_copies(named):
    """{name: a CPU copy of what this rank holds of the tensor} of (name, tensor or DTensor) pairs."""
    return {n: local_of(t).detach().to("cpu", copy=True) for n, t in named}


def local_params(model):
    """{name: a CPU copy of what this rank holds of the parameter}."""
    return local_copies(model.named_parameters())


def optimizer_places(model):
    """{name: the global flat index of each local element} as DTensorMuon's local_indices finds it from the
    placements alone (the tests hold it to element_places, what the wrappers did)."""
    return {n: local_indices(tuple(p.shape), tuple(p.device_mesh.shape), p.placements,
                             p.device_mesh.get_coordinate()) for n, p in model.named_parameters()
            if isinstance(p, DTensor)}


def local_grads(model):
    """{name: a CPU copy of what this rank holds of the parameter's gradient} (total_grads puts them together)."""
    return local_copies((n, p.grad) for n, p in model.named_parameters())


def run_demo_rank(rank, cfg, device):
    """The body of every rank of the demo (muon_tools.spawn_ranks, or a torchrun process): one run on the whole world."""
    torch.set_num_threads(1)
    return run_on_mesh(cfg, rank, device)

