"""The Ledger: what one rank communicated and computed, step by step, and in what order. Every collective of the
lesson (distributed_muon_cpu.py, section 2) records in it, in one line, what it sends and receives (Gloo's profiler
records no message sizes), labelled with its phase; section 7 records its waits too, and every Newton-Schulz its
FLOPs."""

from dataclasses import dataclass, field


@dataclass
class Ledger:
    """What this rank communicated and computed, step by step, and in what order."""

    step: int = 0
    comm: list = field(default_factory=list)  # dicts: step, phase, op, axis, dtype, sent, received (bytes)
    compute: list = field(default_factory=list)  # dicts: step, name, shape, flops
    events: list = field(default_factory=list)  # (step, "launch" | "wait" | "newton-schulz", phase or matrix)

    def record_comm(self, phase, op, axis, sent_numel, received_numel, dtype):
        size = dtype.itemsize
        self.comm.append(dict(step=self.step, phase=phase, op=op, axis=axis.name, dtype=str(dtype).replace("torch.", ""),
                              sent=sent_numel * size, received=received_numel * size))
        self.events.append((self.step, "launch", phase))

    def record_ring(self, phase, op, axis, shard):
        """A ring collective of `shard`-sized pieces: (n - 1) pieces out and in."""
        ring = (axis.size - 1) * shard.numel()
        self.record_comm(phase, op, axis, ring, ring, shard.dtype)

    def record_wait(self, phase):
        self.events.append((self.step, "wait", phase))

    def record_compute(self, name, shape, flops):
        self.compute.append(dict(step=self.step, name=name, shape=tuple(shape), flops=flops))
        self.events.append((self.step, "newton-schulz", name))
