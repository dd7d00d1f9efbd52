"""What an optimizer's step holds at once: the bytes of the tensors it creates, alive together at their peak.

LiveBytes (a TorchDispatchMode) sees every tensor an operator returns inside it; a storage that existed before it
was entered (parameters, gradients, state: found by the garbage collector) is not counted, a new one counts from the
first tensor on it until the last Python tensor on it is gone. What a kernel allocates inside itself and frees
before returning, and what the allocator keeps after a free, are not seen: RSS measures those
(benchmarks/at_scale.py). at_scale_rank is one rank of benchmarks/at_scale.py's model stepped under it.
"""

from __future__ import annotations

from dataclasses import dataclass
import gc
import pickle
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_key(t):
    """Where t's storage lies (None for a tensor subclass without one, e.g. a DTensor)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


class LiveBytes(TorchDispatchMode):
    """peak: the most bytes of new storages alive at once; at_peak: [(bytes, the operator that made it)] then."""

    def __init__(self):
        super().__init__()
        self.known = {storage_key(t) for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter)}
        self.live, self.now, self.peak, self.at_peak = {}, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t, str(func.overloadpacket))
        return out

    def _track(self, t, made_by):
        key = storage_key(t)
        if key in (0, None) or key in self.known:
            return
        storage = t.untyped_storage()
        if key in self.live:
            self.live[key][1] += 1
        else:
            self.live[key] = [storage.nbytes(), 1, made_by]
            self.now += storage.nbytes()
            if self.now > self.peak:
                self.peak = self.now
                self.at_peak = sorted(((n, op) for n, _, op in self.live.values()), reverse=True)
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


@dataclass(frozen=True)
class StepMemoryRun:
    """One step of at_scale.py's model (d, 8 blocks) on a dp x tp mesh; exchange_bytes as DTensorMuon takes it."""
    dp: int = 2
    tp: int = 1
    d: int = 128
    exchange_bytes: int | None = 2**20
    without_ns: bool = True
    timeout_s: float = 120


def at_scale_rank(rank, cfg, device):
    """One step of DTensorMuon on at_scale.py's model: the bytes of each all-gather of its construction (an
    all_gather's tensor, an all_gather_object's pickle), this rank's parameter bytes, the step's peak of new storages
    (LiveBytes) and what was alive then, and its peak RSS over the RSS before it (freed buffers handed back to the
    system at once: glibc's mmap threshold fixed at 128 KiB, so that RSS is what is held, not what glibc keeps)."""
    import ctypes

    import at_scale
    import scaling
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 2**17)
    if cfg.without_ns:
        scaling.without_newton_schulz()
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    model = at_scale.placed_model(cfg.d, mesh)
    at_scale.make_gradients(model, cfg.d)
    gathered, all_gather, all_gather_object = [], torch.distributed.all_gather, torch.distributed.all_gather_object

    def recorded(output, tensor, *args, **kwargs):  # construction's swap of descriptions: what this rank sends
        gathered.append(tensor.numel() * tensor.element_size())
        return all_gather(output, tensor, *args, **kwargs)

    def recorded_object(output, obj, group=None):
        gathered.append(len(pickle.dumps(obj)))
        return all_gather_object(output, obj, group=group)
    torch.distributed.all_gather, torch.distributed.all_gather_object = recorded, recorded_object
    try:
        opt = at_scale.build_dtensor_muon(model, exchange_bytes=cfg.exchange_bytes)
    finally:
        torch.distributed.all_gather, torch.distributed.all_gather_object = all_gather, all_gather_object
    locals_before = [at_scale.dtensor.local_of(p).clone() for p in model.parameters()]
    live = LiveBytes()
    at_scale.reset_peak()
    before = at_scale.rss()[0]
    with live:
        opt.step()
    rss_peak = at_scale.rss()[1] - before
    params = sum(at_scale.dtensor.local_of(p).numel() * 4 for p in model.parameters())
    moved = sum(not torch.equal(at_scale.dtensor.local_of(p), b) for p, b in zip(model.parameters(), locals_before))
    return dict(rank=rank, params=params, peak=live.peak, at_peak=live.at_peak[:8], rss_peak=rss_peak, moved=moved,
                count=len(locals_before), gathered=gathered)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
