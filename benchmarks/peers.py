"""The peers side by side, like for like: every Muon on the package registry that runs on CPU Gloo, and
microsoft/dion's Muon and NorMuon (installed from git), timed as *its gradient synchronization + its step*
against ours (DTensorMuon under FSDP2 like them, with a Muon and with a NorMuon param group, and with its opt-in
batched_ns, the batching dion does; the lesson's owner and comm-free, whose ZeRO-1 step includes its reduction),
and each checked after one step against
torch.optim.Muon (the NorMuon rows against muon_tools.NorMuonReference, NorMuon on torch.optim.Muon's pieces).

    What a data-parallel step costs, per optimizer          what is timed here
    ---------------------------------------------------     -------------------------------------
    DDP peer (muon-optimizer)    all-reduce + its step      the all-reduce DDP does (25 MiB
                                                            buckets, averaged), then step()
    FSDP2 peer (dtensor-muon,    reduce-scatter + its step  the reduce-scatter FSDP2 does (one per
      muon-fsdp2, muonium, dion)                            layer, averaged), then step()
    ours, FSDP2 (DTensorMuon)    reduce-scatter + its step  the same reduce-scatter, then step()
    ours, ZeRO-1 (owner,         its step                   step(): it reduces the gradients itself
      comm-free)

Both collectives are run and timed on Gloo here, never assumed. The model is scaling.py's 4
transformer layers (qkv, proj, fc, fc2), Muon's matrices only (no AdamW: the peers' AdamWs differ
more than their Muons). On N processes every rank holds the same local gradient: g where DDP / FSDP2
average it (the peers, DTensorMuon), g / N for owner and comm-free, which sum; both give g exactly for
N a power of two, and torch.optim.Muon in one process is fed g. Each process runs one thread.

Install the peers into their own virtual environment that sees the system torch, with --no-deps,
so that the torch this project runs on is never replaced (requirements.txt never lists them):

    python -m venv --system-site-packages /work/peers-venv
    /work/peers-venv/bin/pip install --no-deps -r benchmarks/requirements-peers.txt
    /work/peers-venv/bin/python benchmarks/peers.py                     # d = 768, 1 and 2 processes
    /work/peers-venv/bin/python benchmarks/peers.py --ranks 1 2 4 --d 128   # a CPU without bf16 units
    /work/peers-venv/bin/python benchmarks/peers.py --ranks 1 2 4 --without-ns   # all but Newton-Schulz, d = 768
    /work/peers-venv/bin/python benchmarks/peers.py --peers dion --ranks 1 2 4 --d 2048   # DTensorMuon and dion
    python benchmarks/peers.py --d 32 --rounds 2 --ranks 1              # ours only, no peer installed

NVIDIA's emerging-optimizers 0.3.0 needs Python >= 3.12: the same recipe with a 3.12 python (pyenv's), whose
venv cannot see this torch; it gets torch 2.14.1 from the registry, the same version as the system's (the
requirements file installs emerging-optimizers and its absl-py only there; torch brings triton, which its
import needs):

    python3.12 -m venv /work/peers312-venv
    /work/peers312-venv/bin/pip install torch==2.14.1 && /work/peers312-venv/bin/pip install --no-deps -r benchmarks/requirements-peers.txt
    /work/peers312-venv/bin/python benchmarks/peers.py --ranks 1 2 4 --d 128

A peer that is not installed is reported as "not installed"; one that fails, with its error's first
line. Patches a peer needs to run here are applied at run time, to the imported modules (never to
their files), and printed:
  * torch.compile unwrapped (muon-fsdp2's, dtensor-muon's and muonium's Newton-Schulz loops, and
    muonium's compiled update): every contender then runs the same eager bf16 matmuls as
    torch.optim.Muon and ours, and no time goes into compiling;
  * dtensor-muon's MuonForeach moves every batch to torch.device("cuda") unconditionally: the move
    is made the identity on CPU.
dion is timed both ways: compiled, as its users run it (torch.compile's recompile limit raised to 100 as its own
train.py does; its first two steps, where it compiles, are printed apart from the table), and eager (its compiled
functions unwrapped around its own construction and steps only, so that both run in one process). Its rows get a
table of their own beside DTensorMuon's: the same reduce-scatter, then each one's step.
torchtitan's DistMuon (build_dist_muon, installed from git) runs in two layouts, every matrix gathered whole on one
owner (Owned) and each qkv matrix by heads (BlockShard, checked against torch.optim.Muon fed each head as a matrix),
with the three patches CPU Gloo needs (benchmarks/peers_torchtitan.py says which and why), one bucket a layer. Its
rows get a table beside DTensorMuon's: whole matrices beside ours as it is and beside ours a layer a group with the
next layer's gather in flight (exchange_bytes, overlap=1: what DistMuon's buckets do), per head beside ours with
ns_blocks="heads" (each qkv head its own matrix, the same reference).
Peers are configured as close to torch.optim.Muon as their options allow (lr 0.02, weight decay
0.1, momentum 0.95, Nesterov, 5 quintic Newton-Schulz steps, lr scaled by max(1, rows/cols)^0.5);
where they still differ, the check below says by how much. dion's nearest: its "NS5" (use_polar_express=False;
its own five triples, Jordan's one triple being no option of it), torch's eps, the lr scaling from two param
groups (dion_groups), and its sum momentum M = mu M + G, which no option makes torch's average (the reason its
bits differ); its NorMuon with NorMuon's beta2 0.95 (its own epsilon, 1e-8, is fixed).

Default size: scaling.py's 4 layers at d = 768 (GPT-2 small's width), as issue 22 asks, on a CPU with
bf16 matrix units (AVX512-BF16 / AMX: this one's first line says its bf16 GFLOP/s); on one without,
bf16 matmuls run tens of times slower than fp32 and a step takes minutes: use --d 128 there, as
scaling.py does; or --without-ns, which times everything but Newton-Schulz (each contender's replaced by its
bf16 cast, torch's and ours by scaling.py's): the distributed machinery alone, like for like, even where bf16
matmuls crawl and each contender's own Newton-Schulz would decide the race (its check column then compares
steps that are not Muon's: dtensor-muon and muonium scale their input before the function replaced, and dion's
sum momentum is 1 / (1 - mu) times torch's average, so they differ from torch's so replaced by far more than with
Newton-Schulz, which normalizes the scale away). Figures and ratios, never verdicts: the
machine is shared and noisy, so every round steps every contender once, in turn (interleaved), and the ratios
come from one run. benchmarks/peers_1gpu.py times DTensorMuon, dion and torch.optim.Muon on one GPU.
"""

import contextlib
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import os
import statistics
import sys
import tempfile
import time
import types


if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


import distributed_muon_cpu  # noqa: E402
from distmuon import checks  # noqa: E402
from distmuon import dtensor  # noqa: E402
from distmuon import large_runs  # noqa: E402
from distmuon import owners  # noqa: E402
import muon_tools  # noqa: E402
import peers_torchtitan  # noqa: E402
import scaling  # noqa: E402

LR, WEIGHT_DECAY, MOMENTUM = scaling.HYPERPARAMETERS["lr"], scaling.HYPERPARAMETERS["weight_decay"], 0.95
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default
DION_RECOMPILE_LIMIT = 100  # torch._dynamo's, as microsoft/dion's train.py sets it
TORCH = "torch.optim.Muon"
OURS = ("owner", "comm-free")  # the lesson's ZeRO-1 strategies: their step reduces the gradients
IN_STEP = "none: in its step"
FSDP2_SYNC = "FSDP2 reduce-scatter"
DTENSOR = "ours: DTensorMuon"  # distmuon/dtensor/ under FSDP2, synchronized as the FSDP2 peers are
DTENSOR_NORMUON = "ours: DTensorMuon, NorMuon"  # the same with a NorMuon param group (distmuon/normuon.py)
DTENSOR_BATCHED = "ours: DTensorMuon, batched_ns"  # same-shape matrices in one call: within a bound, not torch's bits
DTENSOR_PER_HEAD = "ours: DTensorMuon, per head"  # each qkv head its own matrix (ns_blocks="heads"), as DistMuon's
DTENSOR_OVERLAP = "ours: DTensorMuon, by layers, overlap 1"  # a layer a group, the next one's gather in flight
NOT_INSTALLED = "not installed"


# ----------------------------------------------------------------------------------------------
# 1. The model and the reference
# ----------------------------------------------------------------------------------------------

def matrices(d, layers, device="cpu"):
    """(starting weights, total gradient): {name: tensor} each, scaling.py's Muon matrices, on `device`."""
    params, grads = scaling.parameters(d, layers, device)
    return ({n: p for n, p in params.items() if p.ndim == 2},
            {n: g for n, g in grads.items() if params[n].ndim == 2})


def torch_muon(params):
    return torch.optim.Muon(list(params.values()), lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                            nesterov=True, adjust_lr_fn="original")


def normuon_reference(params):
    """NorMuon's reference (torch has none): muon_tools.NorMuonReference, on torch.optim.Muon's pieces, with the
    options above and NorMuon's defaults (beta2 0.95, eps 1e-10)."""
    return muon_tools.NorMuonReference(list(params.values()), lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                               nesterov=True, adjust_lr_fn="original")


REFERENCES = {"muon": (TORCH, torch_muon), "normuon": ("muon_tools.NorMuonReference", normuon_reference),
              peers_torchtitan.PER_HEAD: (f"{TORCH}, each qkv head a matrix",
                                          peers_torchtitan.per_head_reference(torch_muon))}


def reference_step(weights, total, algorithm="muon"):
    """The reference's weights (torch.optim.Muon's, or NorMuonReference's for "normuon") after one step fed the
    total gradient, in this process."""
    params = {n: w.clone() for n, w in weights.items()}
    for n, p in params.items():
        p.grad = total[n].clone()
    REFERENCES[algorithm][1](params).step()
    return params


def check(after, reference, weights):
    """'bit-identical', else max |delta| and its size relative to the largest element of the reference's step."""
    if all(torch.equal(after[n], reference[n]) for n in reference):
        return "bit-identical"
    delta = max((after[n] - reference[n]).abs().max().item() for n in reference)
    step = max((reference[n] - weights[n]).abs().max().item() for n in reference)
    return f"max |d| {delta:.1e} ({delta / step:.1%} of the step)"


# ----------------------------------------------------------------------------------------------
# 2. The gradient synchronization each peer's wrapper does, run on Gloo
# ----------------------------------------------------------------------------------------------

def ddp_all_reduce(params, local, world):
    """DDP after backward: gradients copied into 25 MiB buckets, each all-reduced and averaged."""
    names, buckets, size = list(params), [[]], 0
    for n in names:
        if size and size + local[n].numel() * 4 > DDP_BUCKET_BYTES:
            buckets, size = buckets + [[]], 0
        buckets[-1].append(n)
        size += local[n].numel() * 4
    for bucket in buckets:
        flat = torch.cat([local[n].reshape(-1) for n in bucket])
        dist.all_reduce(flat)
        flat.div_(world)
        for n, piece in zip(bucket, flat.split([local[n].numel() for n in bucket])):
            params[n].grad = piece.view_as(local[n])


def fsdp2_reduce_scatter(params, local, world, mesh):
    """FSDP2 after a layer's backward: its gradients copied in rank by rank (each rank's dim-0 chunk
    of every matrix), one reduce-scatter per layer, averaged; each rank keeps its shards."""
    from torch.distributed.tensor import DTensor, Shard

    for layer in sorted({n.rsplit(".", 1)[0] for n in params}):
        names = [n for n in params if n.rsplit(".", 1)[0] == layer]
        flat = torch.cat([local[n].chunk(world)[r].reshape(-1) for r in range(world) for n in names])
        shard = flat.new_empty(flat.numel() // world)
        dist.reduce_scatter_tensor(shard, flat)
        shard.div_(world)
        for n, piece in zip(names, shard.split([local[n].numel() // world for n in names])):
            full = local[n]
            params[n].grad = DTensor.from_local(piece.view(full.shape[0] // world, *full.shape[1:]), mesh,
                                                [Shard(0)], shape=full.shape, stride=full.stride())


# ----------------------------------------------------------------------------------------------
# 3. The contenders
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Contender:
    """One optimizer ready to step: `sync(local gradients)` sets its params' .grad the way its
    wrapper would, `step()` steps it, `full()` returns its weights as whole tensors."""
    params: dict
    sync: object
    step: object
    full: object


def full_weights(params):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in params.items()}


def ddp_contender(weights, world, make):
    params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    return Contender(params, lambda local: ddp_all_reduce(params, local, world), make(params).step,
                     lambda: full_weights(params))


def fsdp2_contender(weights, world, make, axis=None):
    """FSDP2's Shard(0) parameters on a mesh of the weights' device, one a rank (its one axis named `axis`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(next(iter(weights.values())).device.type, (world,),
                            mesh_dim_names=(axis,) if axis else None)
    params = {n: torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for n, w in weights.items()}
    return Contender(params, lambda local: fsdp2_reduce_scatter(params, local, world, mesh),
                     make(params).step, lambda: full_weights(params))


def ours(strategy):
    def build(weights, world, rank):
        params = {n: w.clone() for n, w in weights.items()}

        def sync(local):
            for n, p in params.items():
                p.grad = local[n]

        groups = [dict(params=list(params.items()), algorithm="muon")]
        optimizer = owners.OPTIMIZERS[strategy](groups, grid=distributed_muon_cpu.make_grid(world, 1, rank), lr=LR,
                                            weight_decay=WEIGHT_DECAY, momentum=MOMENTUM)
        return Contender(params, sync, optimizer.step, lambda: full_weights(params))
    return build


def dtensor_muon(algorithm, batched_ns=False, per_head=False, overlap=0):
    """DTensorMuon on FSDP2's Shard(0) parameters: the optimizer practitioners adopt, timed as the FSDP2 peers;
    one param group of `algorithm` ("muon" or "normuon"); batched_ns, its opt-in batched Newton-Schulz (Muon only:
    same-shape matrices in one call, as dion batches them; within BATCHED_NS_BOUND of torch's result, not its bits);
    per_head, each qkv head its own matrix (a row layout of head_dim rows, ns_blocks="heads"), as DistMuon's
    BlockShard; overlap K, the matrices exchanged a layer a group (exchange_bytes: one layer's bf16 bytes, as
    DistMuon's buckets here) with K groups' gathers in flight."""
    def build(weights, world, rank):
        options = dict(lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, batched_ns=batched_ns)
        if per_head:
            options.update(ns_blocks="heads", row_layouts={
                n: large_runs.RowLayout((peers_torchtitan.head_dim(w.shape[1]),),
                                        w.shape[0] // peers_torchtitan.head_dim(w.shape[1]))
                for n, w in weights.items() if peers_torchtitan.is_qkv(n)})
        if overlap:
            layers = {n.rsplit(".", 1)[0] for n in weights}  # every layer of the same sizes
            options.update(exchange_bytes=2 * sum(w.numel() for w in weights.values()) // len(layers), overlap=overlap)
        return fsdp2_contender(weights, world, lambda params: dtensor.DTensorMuon(
            [dict(params=list(params.items()), algorithm=algorithm)], **options))
    return build


def compiled_functions(package):
    """[(module, attribute, its torch.compile'd function, the function that one wraps)] for every compiled function
    held by the package's loaded modules (an alias imported into another module counts apart)."""
    found = []
    for name, module in sorted(sys.modules.items()):
        if module is not None and (name == package or name.startswith(package + ".")):
            for attr, value in list(vars(module).items()):
                original = getattr(value, "_torchdynamo_orig_callable", None)
                if callable(value) and original is not None:
                    found.append((module, attr, value, original))
    return found


def uncompiled(package):
    """Every torch.compile'd function held by the package's loaded modules replaced by the function it
    wraps: the patch, in one line."""
    found = compiled_functions(package)
    for module, attr, _, original in found:
        setattr(module, attr, original)
    return f"torch.compile unwrapped (run eagerly): {', '.join(sorted({attr for _, attr, _, _ in found}))}"


@contextlib.contextmanager
def unwrapped(found):
    """uncompiled()'s patch for the duration of the block only, then the compiled functions back: `found` from
    compiled_functions(), so that one process runs a package both compiled and eagerly."""
    for module, attr, _, original in found:
        setattr(module, attr, original)
    try:
        yield
    finally:
        for module, attr, compiled, _ in found:
            setattr(module, attr, compiled)


def without_triton(package):
    """Its Newton-Schulz defaults to a Triton kernel that asserts CUDA tensors: the plain loop instead."""
    module = importlib.import_module(f"{package}.orthogonalize.orthogonalize")
    choose = module._get_orthogonalization_fn
    module._get_orthogonalization_fn = lambda strategy, use_triton: choose(strategy, False)
    return f"{package}.orthogonalize.orthogonalize._get_orthogonalization_fn: never the Triton kernel (CUDA only)"


def emerging(module, weights, world, rank):
    """NVIDIA's Muon (Megatron-core's, single-device: every rank steps every matrix), with DDP's all-reduce;
    its "simple" coefficients are Jordan's triple, "shape_scaling" torch's original lr adjustment."""
    return ddp_contender(weights, world, lambda params: module.Muon(
        list(params.values()), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=True,
        coefficient_type="simple", num_ns_steps=5, scale_mode="shape_scaling"))


def keller_jordan(module, weights, world, rank):
    return ddp_contender(weights, world, lambda params: module.Muon(
        list(params.values()), lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM))


def muon_fsdp2(module, weights, world, rank):
    return fsdp2_contender(weights, world, lambda params: module.Muon([dict(
        params=list(params.values()), use_muon=True, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
        rms_scale=False, nesterov=True, ns_steps=5)]))


def dtensor_muon_peer(module, weights, world, rank):
    return fsdp2_contender(weights, world, lambda params: module.MuonForeach(
        list(params.values()), lr=LR, wd=WEIGHT_DECAY, use_cautious_wd=False, momentum=MOMENTUM,
        nesterov=True, ns_steps=5, orthogonalization_strategy="newton_schulz"))


def muonium(module, weights, world, rank):
    return fsdp2_contender(weights, world, lambda params: module.Muon(
        list(params.values()), lr=LR, wd=WEIGHT_DECAY, use_cautious_wd=False, momentum=MOMENTUM,
        nesterov=True, ns_steps=5, orthogonalization_strategy="newton_schulz"))


def dion_groups(params):
    """torch's lr adjustment ("original": lr max(1, rows / cols) ** 0.5) from dion's options, exactly: its
    "spectral_norm" (lr (rows / cols) ** 0.5) for the tall and square matrices, none for the wide ones."""
    tall = [p for p in params.values() if p.shape[0] >= p.shape[1]]
    wide = [p for p in params.values() if p.shape[0] < p.shape[1]]
    return [dict(params=ps, adjust_lr=adjust) for ps, adjust in ((tall, "spectral_norm"), (wide, None)) if ps]


def dion(cls, eager):
    """microsoft/dion's Muon or NorMuon on the FSDP2 mesh, as close to torch.optim.Muon as its options go: its sum
    momentum (M = mu M + G) with Nesterov, its "NS5" Newton-Schulz (use_polar_express=False: 5 iterations, each
    its own (a, b, c); Jordan's one triple is no built-in option), torch's eps, torch's lr adjustment
    (dion_groups); NorMuon's beta2 ours. Compiled (as shipped), or eager: its torch.compile'd functions unwrapped
    around its construction (it keeps its Newton-Schulz function) and each step, only there."""
    def build(module, weights, world, rank):
        found = compiled_functions("dion") if eager else []
        extra = dict(muon_beta2=checks.OPTIONS["normuon"]["beta2"]) if cls == "NorMuon" else {}

        def make(params):
            with unwrapped(found):
                optimizer = getattr(module, cls)(
                    dion_groups(params), distributed_mesh=next(iter(params.values())).device_mesh, lr=LR,
                    mu=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=True, epsilon=checks.OPTIONS["muon"]["eps"],
                    use_polar_express=False, **extra)

            def step():
                with unwrapped(found):
                    optimizer.step()
            return types.SimpleNamespace(step=step)
        return fsdp2_contender(weights, world, make)
    return build


def patch_dion():
    """dion compiles per shape and list length: its own train.py raises dynamo's recompile limit to 100 (with the
    default, 8, its fullgraph functions end in FailOnRecompileLimitHit). And inductor compiles in this process, not
    in its pool of compile workers (a pool of processes in each rank: on 4 processes here the run's memory ran out)."""
    import torch._inductor.config

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, DION_RECOMPILE_LIMIT)
    torch._inductor.config.compile_threads = 1
    return [f"torch._dynamo.config.recompile_limit = {DION_RECOMPILE_LIMIT} (dion's train.py's; the default 8 "
            "ends its compiled rows in FailOnRecompileLimitHit)",
            "torch._inductor.config.compile_threads = 1: compiled in each rank itself, without a pool of compile "
            "workers (the same kernels; with the pools, 4 processes ran out of memory here)",
            "its eager rows: torch.compile unwrapped around their construction and step only (the compiled rows "
            "run it as shipped)"]


class BroadcastAllGather:
    """torch.distributed, but with all_gather done as one broadcast from each rank, which Gloo allows
    for tensors of unequal shapes (its all_gather refuses them; NCCL's takes them)."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_gather(outputs, tensor, group=None, async_op=False):
        for src, output in enumerate(outputs):  # outputs[rank] is `tensor` itself
            dist.broadcast(output, src, group=group)


def patch_keller_jordan():
    importlib.import_module("muon").dist = BroadcastAllGather()
    return ["muon.dist.all_gather: one broadcast per rank (Gloo's all_gather refuses the unequal shapes it gathers)"]


def patch_dtensor_muon():
    foreach = importlib.import_module("dtensor_muon.optim.optim_foreach")
    foreach.move_tensors_to_device = lambda tensors, device_in, device_out: tensors
    return [uncompiled("dtensor_muon"), without_triton("dtensor_muon"),
            "dtensor_muon.optim.optim_foreach.move_tensors_to_device: the identity (it moves every batch to cuda)"]


def patch_muonium():
    optim = importlib.import_module("muonium.optim.optim")
    optim.Muon._get_muon_impl = optim.Muon._raw_muon_impl
    return [uncompiled("muonium"), without_triton("muonium"),
            "muonium.optim.optim.Muon._get_muon_impl: its uncompiled update (it compiles the whole update)"]


def cast_only(module, name):
    """--without-ns: a peer's Newton-Schulz function replaced by the bf16 cast it begins with, as
    scaling.without_newton_schulz does to torch's and ours."""
    module = importlib.import_module(module)
    setattr(module, name, lambda matrix, *args, **kwargs: matrix.bfloat16())
    return f"{module.__name__}.{name}: the bf16 cast only (--without-ns)"


def no_orthogonalization(package):
    """--without-ns for dtensor-muon and muonium: their orthogonalization loop (fed bf16) returns its input."""
    module = importlib.import_module(f"{package}.orthogonalize.orthogonalize")
    module._get_orthogonalization_fn = lambda strategy, use_triton: lambda matrix, **kwargs: matrix
    return f"{package}.orthogonalize.orthogonalize._get_orthogonalization_fn: the bf16 input returned (--without-ns)"


TORCHTITAN_NOTE = ("torchtitan's DistMuon: benchmarks/requirements-peers.txt says how to install it, from its git "
                   "repository at the commit this script was run against")
DION_NOTE = ("microsoft/dion is not on the package registry: benchmarks/requirements-peers.txt says how to install it "
             "from its git repository")


@dataclasses.dataclass
class Peer:
    distribution: str  # its name on the package registry
    module: str
    label: str
    sync: str
    build: object
    patch: object = lambda: []
    note: str = ""  # why it may be absent
    without_ns: object = None  # --without-ns: replaces its Newton-Schulz by the bf16 cast, returns what it did
    algorithm: str = "muon"  # what it computes, and so its reference (REFERENCES): "muon" or "normuon"
    compiles: bool = False  # torch.compile'd as shipped: its first two steps reported apart (compile time)


PEERS = [
    Peer("muon-optimizer", "muon", "muon-optimizer {v} Muon", "DDP all-reduce", keller_jordan,
         patch_keller_jordan, without_ns=lambda: cast_only("muon", "zeropower_via_newtonschulz5")),
    Peer("dtensor-muon", "dtensor_muon", "dtensor-muon {v} MuonForeach", FSDP2_SYNC, dtensor_muon_peer,
         patch_dtensor_muon, without_ns=lambda: no_orthogonalization("dtensor_muon")),
    Peer("muon-fsdp2", "muon_fsdp2", "muon-fsdp2 {v} Muon", FSDP2_SYNC, muon_fsdp2,
         lambda: [uncompiled("muon_fsdp2")], without_ns=lambda: cast_only("muon_fsdp2", "zeropower_via_newtonschulz5")),
    Peer("muonium", "muonium", "muonium {v} Muon", FSDP2_SYNC, muonium, patch_muonium,
         without_ns=lambda: no_orthogonalization("muonium")),
    Peer("emerging-optimizers", "emerging_optimizers.orthogonalized_optimizers", "emerging-optimizers {v} Muon",
         "DDP all-reduce", emerging,
         note="its 0.3.0 needs Python >= 3.12, where the registry offers a 3.11 pip only a placeholder: run this "
              "script with a 3.12 virtual environment's python (the docstring's recipe)",
         without_ns=lambda: cast_only("emerging_optimizers.orthogonalized_optimizers.muon_utils", "newton_schulz")),
] + [Peer("dion", "dion", f"dion {{v}} {cls}, {mode}", FSDP2_SYNC, dion(cls, eager=mode == "eager"), patch_dion,
          note=DION_NOTE, without_ns=lambda: cast_only("dion.megabatch_base", "zeropower_via_newtonschulz5"),
          algorithm=cls.lower(), compiles=mode == "compiled")
     for cls in ("Muon", "NorMuon") for mode in ("compiled", "eager")
] + [Peer("torchtitan", "torchtitan", f"torchtitan {{v}} DistMuon, {kind}", FSDP2_SYNC,
          peers_torchtitan.dist_muon(per_head, fsdp2_contender, dict(lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM)),
          peers_torchtitan.patch, note=TORCHTITAN_NOTE, without_ns=peers_torchtitan.without_ns,
          algorithm=peers_torchtitan.PER_HEAD if per_head else "muon")
     for per_head, kind in ((False, "whole matrices"), (True, "per head"))]


def installed(peer):
    """Its version (with "@" and the commit's first 7 digits where pip installed it from git), or None."""
    try:
        distribution = importlib.metadata.distribution(peer.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    return distribution.version + git_commit(distribution.read_text("direct_url.json"))


def git_commit(direct_url):
    """"@" and the commit's first 7 digits from pip's record of where it installed a package from (PEP 610's
    direct_url.json), "" for one from the registry (no record) or from a folder."""
    commit = json.loads(direct_url or "{}").get("vcs_info", {}).get("commit_id", "")
    return f"@{commit[:7]}" if commit else ""


@dataclasses.dataclass
class Entry:
    """One row of the table: its label and sync's, build(weights, world, rank) -> Contender, and what the Peer
    says of it (its reference; whether it compiles)."""
    label: str
    sync: str
    build: object
    algorithm: str = "muon"
    compiles: bool = False


def contenders(peers, world, rank, without_ns=False):
    """[Entry], patches applied, [(label, status)]."""
    built = ([Entry(f"ours: {s}", IN_STEP, ours(s)) for s in OURS]
             + [Entry(DTENSOR, FSDP2_SYNC, dtensor_muon("muon")),
                Entry(DTENSOR_BATCHED, FSDP2_SYNC, dtensor_muon("muon", batched_ns=True)),
                Entry(DTENSOR_NORMUON, FSDP2_SYNC, dtensor_muon("normuon"), "normuon"),
                Entry(DTENSOR_PER_HEAD, FSDP2_SYNC, dtensor_muon("muon", per_head=True), peers_torchtitan.PER_HEAD),
                Entry(DTENSOR_OVERLAP, FSDP2_SYNC, dtensor_muon("muon", overlap=1))])
    patches, status = [], []
    for peer in peers:
        version = installed(peer)
        if version is None:
            status.append((peer.distribution, NOT_INSTALLED + (f" ({peer.note})" if peer.note else "")))
            continue
        if peer.build is None:
            status.append((peer.distribution, f"{version} installed; {peer.note}"))
            continue
        label = peer.label.format(v=version)
        try:
            module = importlib.import_module(peer.module)
            patches += [f"{peer.distribution}: {p}" for p in peer.patch()]
            if without_ns:
                patches.append(f"{peer.distribution}: {peer.without_ns()}")
        except Exception as error:  # a peer that cannot even be imported here is reported, not fatal
            status.append((label, f"failed: {muon_tools.one_line(error)}"))
            continue
        built.append(Entry(label, peer.sync, lambda w, n, r, b=peer.build, m=module: b(m, w, n, r), peer.algorithm,
                           peer.compiles))
    return built, patches, status


# ----------------------------------------------------------------------------------------------
# 4. One run on N processes: every contender checked once, then timed in interleaved rounds
# ----------------------------------------------------------------------------------------------

def local_gradients(total, sync, world, shared):
    """What this rank's backward would hand the contender: g where a wrapper averages (DDP, FSDP2), g / N for
    our ZeRO-1 strategies, whose step sums; one copy of each kind (`shared`), read by every contender (each round
    gives each a fresh clone), not one per contender (what that held: notes/measured/from_code_comments.md)."""
    share = 1 / world if sync == IN_STEP else 1.0
    if share not in shared:
        shared[share] = total if share == 1.0 else {n: g * share for n, g in total.items()}
    return shared[share]


def rank_main(rank, world, port, out_dir, d, layers, rounds, peer_names, without_ns=False):
    torch.set_num_threads(1)
    if without_ns:  # torch's and ours; each peer's in contenders()
        scaling.without_newton_schulz()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    weights, total = matrices(d, layers)
    references = {}  # the references' weights after one step, each made when a contender first needs it
    built, patches, status = contenders([p for p in PEERS if p.distribution in peer_names], world, rank, without_ns)
    runners, checks, compiling, shared = {}, {}, {}, {}
    if world == 1:
        params = {n: w.clone() for n, w in weights.items()}
        optimizer = torch_muon(params)

        def torch_sync(local):
            for n, p in params.items():
                p.grad = local[n]
        runners[TORCH] = ("-", Contender(params, torch_sync, optimizer.step, None), total)
    for entry in built:
        try:
            contender = entry.build(weights, world, rank)
            local = local_gradients(total, entry.sync, world, shared)
            firsts = []
            for _ in range(2 if entry.compiles else 1):  # the check's step; a compiled one's second step too
                dist.barrier()
                t0 = time.perf_counter()
                contender.sync({n: g.clone() for n, g in local.items()})
                contender.step()
                firsts.append(time.perf_counter() - t0)
                if len(firsts) == 1:
                    if entry.algorithm not in references:
                        references[entry.algorithm] = reference_step(weights, total, entry.algorithm)
                    checks[entry.label] = check(contender.full(), references[entry.algorithm], weights)
            if entry.compiles:
                compiling[entry.label] = firsts
            runners[entry.label] = (entry.sync, contender, local)
        except Exception as error:  # reported in the table; every rank fails alike (same code, same data)
            status.append((entry.label, f"failed: {muon_tools.one_line(error)}"))
    references = {entry.label: REFERENCES[entry.algorithm][0] for entry in built}
    times = {label: dict(sync=[], step=[]) for label in runners}
    for _ in range(rounds):
        for label, (_, contender, local) in runners.items():
            fresh = {n: g.clone() for n, g in local.items()}  # sync and step may write into the gradients
            dist.barrier()
            t0 = time.perf_counter()
            contender.sync(fresh)
            t1 = time.perf_counter()
            contender.step()
            t2 = time.perf_counter()
            times[label]["sync"].append((t1 - t0) * 1e3)
            times[label]["step"].append((t2 - t1) * 1e3)
    mine = dict(times=times, checks=checks, patches=patches, status=status, compiling=compiling,
                references=references, syncs={label: s for label, (s, _, _) in runners.items()})
    muon_tools.write_atomically(os.path.join(out_dir, f"{rank}.pt"), lambda f: torch.save(mine, f))
    dist.destroy_process_group()


def on_processes(world, d, layers, rounds, peer_names, without_ns=False):
    """The slowest rank's times per round, and rank 0's checks, patches and statuses."""
    with tempfile.TemporaryDirectory() as out_dir:
        muon_tools.run_processes(rank_main, (world, muon_tools.free_port(), out_dir, d, layers, rounds, peer_names,
                                             without_ns), world,
                         folders=(out_dir,))
        per_rank = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]
    result = per_rank[0]
    for label, firsts in result["compiling"].items():
        result["compiling"][label] = [max(r["compiling"][label][i] for r in per_rank) for i in range(len(firsts))]
    for label, kinds in result["times"].items():
        for kind in kinds:
            kinds[kind] = [max(r["times"][label][kind][i] for r in per_rank) for i in range(rounds)]
        kinds["total"] = [max(r["times"][label]["sync"][i] + r["times"][label]["step"][i] for r in per_rank)
                          for i in range(rounds)]
    return result


# ----------------------------------------------------------------------------------------------
# 5. The table
# ----------------------------------------------------------------------------------------------

def table(runs):
    """Rows for every run; times in ms, ratios to torch.optim.Muon's step in one process: of the medians,
    and of the minima (on a shared machine the least disturbed step of each)."""
    torch_t = runs[1]["times"][TORCH]["total"]
    torch_ms = statistics.median(torch_t)
    rows = []
    for world, run in sorted(runs.items()):
        for label, t in run["times"].items():
            median = statistics.median(t["total"])
            rows.append([world, label, run["syncs"][label], f"{statistics.median(t['sync']):.1f}",
                         f"{statistics.median(t['step']):.0f}", f"{min(t['total']):.0f}", f"{median:.0f}",
                         f"{median / torch_ms:.2f}", f"{torch_ms / median:.2f}x", f"{min(torch_t) / min(t['total']):.2f}x",
                         "(the reference)" if label == TORCH else run["checks"][label]])
    return torch_ms, muon_tools.format_table(
        ["processes", "optimizer", "gradient sync (timed)", "sync ms", "step ms", "min ms", "median ms",
         "time / torch's", "speed-up", "speed-up of minima", "after one step vs its reference"],
        rows, [">", "<", "<", ">", ">", ">", ">", ">", ">", ">", "<"])


def compile_times(runs):
    """The compiled rows' first two steps (sync + step, the slowest rank's), where torch.compile compiles, one line
    a row; "" if none compiles."""
    compiling = {}
    for world, run in sorted(runs.items()):
        for label, firsts in run["compiling"].items():
            compiling.setdefault(label, []).append(f"{world} process{'es' * (world > 1)} "
                                                   + ", ".join(f"{s:.1f}" for s in firsts) + " s")
    if not compiling:
        return ""
    return ("Compiled rows: their first two steps (sync + step, the slowest rank), torch.compile compiling, "
            "apart from the table:" + "".join(f"\n  {label}: {'; '.join(c)}" for label, c in compiling.items()))


def medians_and_minima(times, ours, theirs):
    """The cells comparing `theirs` with `ours` (labels in `times`, each {label: [ms]}): their median and minimum,
    then theirs over ours of each (above 1: ours the shorter); blank cells where `theirs` is None."""
    if theirs is None:
        return [""] * 4
    return [f"{statistics.median(times[theirs]):.0f}", f"{min(times[theirs]):.0f}",
            f"{statistics.median(times[theirs]) / statistics.median(times[ours]):.2f}",
            f"{min(times[theirs]) / min(times[ours]):.2f}"]


def beside(runs, pairs, find, columns):
    """One row per process count and (ours, ours_as, key) of `pairs` where ours ran and find(labels, key) names one
    or more peer rows (None where that one did not run): ours' median and minimum ms, then each peer's cells."""
    rows = []
    for world, run in sorted(runs.items()):
        totals = {label: t["total"] for label, t in run["times"].items()}
        for ours, ours_as, key in pairs:
            theirs = find(list(totals), key)
            if ours not in totals or not any(theirs):
                continue
            cells = [f"{statistics.median(totals[ours]):.0f}", f"{min(totals[ours]):.0f}"]
            for label in theirs:
                cells += medians_and_minima(totals, ours, label)
            rows.append([world, ours_as, *cells])
    return muon_tools.format_table(columns, rows, [">", "<"] + [">"] * (len(columns) - 2)) if rows else ""


def beside_dion(runs):
    """DTensorMuon's sync + step beside dion's, per process count and algorithm: ms (median, min), and dion's over
    ours (above 1: ours the shorter); "" where dion did not run."""
    def find(labels, algorithm):
        return [next((label for label in labels if label.startswith("dion ")
                      and label.endswith(f" {algorithm}, {mode}")), None) for mode in ("compiled", "eager")]
    return beside(runs, ((DTENSOR, "Muon", "Muon"), (DTENSOR_BATCHED, "Muon, batched_ns", "Muon"),
                         (DTENSOR_NORMUON, "NorMuon", "NorMuon")), find,
                  ["processes", "ours", "ours median ms", "ours min ms", "dion compiled median ms", "min ms",
                   "dion/ours (medians)", "(minima)", "dion eager median ms", "min ms", "dion/ours (medians)",
                   "(minima)"])


def beside_torchtitan(runs):
    """DTensorMuon's sync + step beside torchtitan's DistMuon, per process count and layout (whole matrices: ours
    as it is and a layer a group with the next one's gather in flight, as DistMuon's buckets; per head: ours with
    ns_blocks="heads"): ms (median, min), and DistMuon's over ours; "" where DistMuon did not run."""
    def find(labels, kind):
        return [next((label for label in labels if label.startswith("torchtitan ")
                      and label.endswith(f"DistMuon, {kind}")), None)]
    return beside(runs, ((DTENSOR, "Muon", "whole matrices"),
                         (DTENSOR_OVERLAP, "Muon, by layers, overlap 1", "whole matrices"),
                         (DTENSOR_PER_HEAD, "Muon, per head", "per head")), find,
                  ["processes", "ours", "ours median ms", "ours min ms", "DistMuon median ms", "min ms",
                   "DistMuon/ours (medians)", "(minima)"])


def main(argv=None):
    p = muon_tools.OneLineParser(description="The peers' Muon (gradient sync + step) against ours and torch's.")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts, powers of two (default: 1 2)")
    scaling.model_arguments(p, rounds_help="timed steps of each optimizer")
    distributions = list(dict.fromkeys(peer.distribution for peer in PEERS))
    p.add_argument("--peers", nargs="*", default=distributions, choices=distributions,
                   help="peers to include (default: all)")
    p.add_argument("--without-ns", action="store_true",
                   help="time everything but Newton-Schulz: every contender's replaced by its bf16 cast")
    args = p.parse_args(argv)
    if any(not 1 <= n <= muon_tools.MAX_WORLD or n & (n - 1) for n in args.ranks):
        p.error(f"--ranks must be powers of two up to {muon_tools.MAX_WORLD} (the averaged and the summed gradient are then exact)")
    scaling.check_model(p, args, max(args.ranks))
    if any(args.d % n for n in args.ranks):
        p.error(f"--d {args.d} must be divisible by every --ranks (FSDP2's even dim-0 shards)")
    torch.set_num_threads(1)
    speed = {str(dt).replace("torch.", ""): scaling.matmul_gflops(args.d, dt) for dt in (torch.bfloat16, torch.float32)}
    load = os.getloadavg()[0]
    runs = {n: on_processes(n, args.d, args.layers, args.rounds, args.peers, args.without_ns)
            for n in sorted({1, *args.ranks})}
    torch_ms, rows = table(runs)
    print(f"This CPU, one thread, {args.d} x {args.d} matmul: "
          + ", ".join(f"{dt} {g:.1f} GFLOP/s" for dt, g in speed.items()))
    print(f"Load average at the start: {load:.1f} on {os.cpu_count()} cores (above the processes run here, "
          "other jobs share the cores: read ratios, not absolute times)")
    print(f"{args.layers} layers at d = {args.d} (Muon's matrices only), 1 thread per process, median of "
          f"{args.rounds} interleaved rounds, {os.cpu_count()} cores here; torch {torch.__version__}")
    if args.without_ns:
        print("WITHOUT Newton-Schulz (--without-ns): every contender's, torch's too, is replaced by its bf16 cast, "
              "so what is timed is the rest (synchronization, momentum, exchanges, copies, the update); these are not "
              "Muon steps, and the check below compares them to torch's step so replaced")
    print(f"{TORCH} in one process: median {torch_ms:.0f} ms; a peer's time is its gradient sync + its step, "
          "ours is its step (which reduces); on N processes, the slowest rank's\n")
    print(rows)
    print(f"after one step: against {TORCH}, the NorMuon rows against {REFERENCES['normuon'][0]} (NorMuon on "
          f"{TORCH}'s pieces, notes/14-normuon.md), the per-head rows against {REFERENCES[peers_torchtitan.PER_HEAD][0]} "
          f"({peers_torchtitan.head_dim(args.d)} rows)")
    compiling = compile_times(runs)
    if compiling:
        print(compiling)
    dion_rows = beside_dion(runs)
    if dion_rows:
        print("\nDTensorMuon beside microsoft/dion, sync + step (the same FSDP2 reduce-scatter in both):\n" + dion_rows)
    titan_rows = beside_torchtitan(runs)
    if titan_rows:
        print("\nDTensorMuon beside torchtitan's DistMuon, sync + step (the same FSDP2 reduce-scatter in both; "
              "DistMuon a bucket a layer):\n" + titan_rows)
    statuses = dict(s for run in runs.values() for s in run["status"])
    patches = sorted({p for run in runs.values() for p in run["patches"]})
    print("\nPeers not run:" + ("".join(f"\n  {name}: {s}" for name, s in statuses.items()) or " none"))
    print("sync ms and step ms: medians of their own; speed-up: torch's median over this one's; of minima: "
          "torch's least disturbed step over this one's")
    print("Patches applied at run time (to the imported modules, not their files):"
          + ("".join(f"\n  {patch}" for patch in patches) or " none"))
    return 0


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
