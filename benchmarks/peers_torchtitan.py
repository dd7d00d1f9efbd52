"""torchtitan's DistMuon (torchtitan/distributed/flex_shard/: build_dist_muon), a peer of benchmarks/peers.py: what
it needs to run on CPU Gloo (patched at run time, printed), its two layouts, and the per-head reference.

    whole matrices   every matrix ComputeLayout Owned(): gathered whole on one owner rank, as torch steps it
    per head         each qkv matrix BlockShard(dim=0, block_size=head_dim): its heads' row blocks, each its own
                     matrix (against torch.optim.Muon fed each head as a parameter); the others Owned()

DistMuon is CUDA-only as shipped (pip install --no-deps, benchmarks/requirements-peers.txt). Wherever it runs, the
package's torchtitan/distributed/__init__.py is not run: it imports ParallelDims and through it spmd_types and
torchtitan's configuration, none of which flex_shard uses (pip's --no-deps leaves spmd_types out). On the CPU two
more things are patched (patch("cpu")); a CUDA device runs them as shipped (patch("cuda")): its check that its
parameters live on one CUDA device (the same check, less "CUDA"), and the stream its runtime makes (torch.cpu.Stream
takes no device keyword).
"""

import importlib
import math
import os
import sys
import types

import torch

AXIS = "dp_shard"  # the storage mesh's one axis, named as DistMuon requires (torchtitan's FSDP axis name)
FLEX_SHARD = "torchtitan.distributed.flex_shard"
GPT2_HEAD_DIM = 64  # GPT-2's head width: d = 768 has 12 heads
PER_HEAD = "muon per head"  # the per-head rows' reference (peers.REFERENCES)


def head_dim(d):
    """The heads' width at model width d: GPT-2's 64 where it divides d, else the largest width that divides both."""
    return math.gcd(d, GPT2_HEAD_DIM)


def is_qkv(name):
    return name.rsplit(".", 1)[-1] == "qkv"


def heads(name, tensor):
    """A qkv matrix (3 d, d) as its heads' row blocks (head_dim(d) rows each); any other matrix whole."""
    return tensor.split(head_dim(tensor.shape[1])) if is_qkv(name) else (tensor,)


def per_head_reference(torch_muon):
    """The per-head rows' reference: torch_muon (peers.torch_muon, torch.optim.Muon with the benchmark's options)
    stepping every qkv head as a matrix of its own, the other matrices whole; step() writes the heads back."""
    class PerHeadMuon:
        def __init__(self, params):
            self.params = params

        def step(self):
            pieces = {}
            for name, p in self.params.items():
                for i, (w, g) in enumerate(zip(heads(name, p.detach()), heads(name, p.grad))):
                    pieces[f"{name}.{i}"] = piece = w.clone()
                    piece.grad = g.clone()
            torch_muon(pieces).step()
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(torch.cat([pieces[f"{name}.{i}"] for i in range(len(heads(name, p)))]))
    return PerHeadMuon


def enter_without_init():
    """torchtitan.distributed as a bare package (its __init__.py not run), so that flex_shard imports alone."""
    if "torchtitan.distributed" not in sys.modules:
        import torchtitan

        package = types.ModuleType("torchtitan.distributed")
        package.__path__ = [os.path.join(os.path.dirname(torchtitan.__file__), "distributed")]
        sys.modules[package.__name__] = package
    return importlib.import_module(FLEX_SHARD)


def storage_on_one_device(self):
    """DistMuon's check of its parameters (DTensors, their local shards on one device), on any device type."""
    from torch.distributed.tensor import DTensor

    devices = set()
    for group in self.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                raise TypeError("DistMuon requires DTensor parameters")
            devices.add(p.to_local().device)
    if len(devices) != 1:
        raise ValueError(f"DistMuon requires one device per process (got {sorted(map(str, devices))})")
    return devices.pop()


class CpuStreamKeywords:
    """torch, as flex_shard's runtime module sees it: get_device_module("cpu")'s Stream takes (and drops) the device
    keyword CUDA's takes; everything else is torch's."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def get_device_module(device=None):
        module = torch.get_device_module(device)
        if module is not torch.cpu:
            return module
        names = {n: getattr(torch.cpu, n) for n in dir(torch.cpu) if not n.startswith("__")}
        names["Stream"] = lambda device=None, priority=0: torch.cpu.Stream(priority=priority)
        return types.SimpleNamespace(**names)


def patch(device_type="cpu"):
    """The run-time patches for DistMuon on `device_type`, each in one line (to the imported modules, never their
    files): the package entered without its __init__.py everywhere; on the CPU also the device check and the stream."""
    flex_shard = enter_without_init()
    done = [f"torchtitan.distributed: entered without its __init__.py (it imports ParallelDims, spmd_types and "
            f"torchtitan's config, which {flex_shard.__name__} does not use)"]
    if device_type != "cpu":
        return done
    dist_muon = importlib.import_module(f"{FLEX_SHARD}.dist_muon")
    runtime = importlib.import_module(f"{FLEX_SHARD}._optimizer_reshard_runtime")
    dist_muon.DistMuon._validate_parameter_storage = storage_on_one_device
    runtime.torch = CpuStreamKeywords()
    return done + ["DistMuon._validate_parameter_storage: its check less \"the device is CUDA\" (one device per "
                   "process)", f"{runtime.__name__}.torch.get_device_module('cpu').Stream: the device keyword dropped "
                   "(torch.cpu.Stream takes priority only)"]


def without_ns():
    """--without-ns: DistMuon's Newton-Schulz replaced by the bf16 cast it begins with."""
    module = importlib.import_module(f"{FLEX_SHARD}.dist_muon")
    module._zeropower_via_newtonschulz = lambda update, **kwargs: update.to(torch.bfloat16, copy=True)
    return f"{module.__name__}._zeropower_via_newtonschulz: the bf16 cast only (--without-ns)"


def dist_muon(per_head, contender, options):
    """build(module, weights, world, rank) for peers.Peer: DistMuon on the FSDP2 mesh (`contender`:
    peers.fsdp2_contender, here with the named axis), every matrix Owned() or, per_head, each qkv's heads
    BlockShard; one bucket per layer and layout (a bucket's redistributed matrices share one transport), in layer
    order. options: the benchmark's lr, weight_decay and momentum; the rest torch.optim.Muon's defaults, which are
    DistMuon's (Nesterov, Jordan's triple, 5 steps, eps 1e-7), and torch's "original" lr adjustment."""
    def build(module, weights, world, rank):
        flex_shard = importlib.import_module(FLEX_SHARD)

        def layout(name, p):
            if per_head and is_qkv(name):
                return flex_shard.BlockShard(dim=0, block_size=head_dim(p.shape[1]))
            return flex_shard.Owned()

        def make(params):
            layouts = {n: layout(n, p) for n, p in params.items()}
            buckets = {}
            for n in params:
                buckets.setdefault((n.rsplit(".", 1)[0], type(layouts[n]).__name__), []).append(n)
            return flex_shard.build_dist_muon(
                [dict(params=list(params.values()), param_names=list(params))],
                compute_sharding_by_fqn={n: flex_shard.ComputeLayout(shardings_by_mesh_axis={AXIS: layouts[n]})
                                         for n in params},
                bucket_configs=[flex_shard.BucketConfig(patterns=tuple(names), name=f"{layer} {kind}")
                                for (layer, kind), names in buckets.items()],
                nesterov=True, adjust_lr_fn="original", **options)
        return contender(weights, world, make, axis=AXIS)
    return build
