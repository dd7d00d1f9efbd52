"""What torch.distributed's collectives need here beyond their plain call: a reduce-scatter that adds in rank order.

Part of the library (distmuon), below the lesson: it imports no other file of the project. The lesson's section 2
(distributed_muon_cpu.py) wraps every collective with its byte count; its reduce-scatter starts here.

Gloo's reduce_scatter is a full all-reduce: more bytes, and slower (notes/measured/gloo_collectives_2core.txt). There
each rank's i-th shard goes straight to rank i in one all-to-all, and rank i adds what it received in rank order:
a ring's bytes, and one order of the float32 sum, the same on every run, which examples/train_gpt.py's one-process
reference can repeat bit for bit. Other backends (NCCL) take torch's reduce-scatter.
"""

import torch.distributed as dist

# torch 2.14 renames all_gather_into_tensor / reduce_scatter_tensor to *_single; older torch has the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def sum_in_order(contributions):
    """contributions[0] + contributions[1] + ..., left to right: one order, the same on every run (a new tensor:
    the first addition writes it, no copy first)."""
    if len(contributions) == 1:
        return contributions[0].clone()
    total = contributions[0] + contributions[1]
    for contribution in contributions[2:]:
        total += contribution
    return total


def reduce_scatter_sum(bucket, axis):
    """torch's reduce-scatter with ReduceOp.SUM (the total gradient, as the reference is fed) over `axis` (the
    lesson's Axis: its size and ProcessGroup), started: (work, a function that returns this rank's shard)."""
    shard_numel = bucket.numel() // axis.size
    if dist.get_backend(axis.group) == "gloo":
        received = bucket.new_empty(bucket.numel())
        work = dist.all_to_all_single(received, bucket, group=axis.group, async_op=True)
        return work, lambda: sum_in_order(received.view(axis.size, shard_numel))
    out = bucket.new_empty(shard_numel)
    work = reduce_scatter_single(out, bucket, op=dist.ReduceOp.SUM, group=axis.group, async_op=True)
    return work, lambda: out
