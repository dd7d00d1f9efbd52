"""CollectiveCounter: every collective a rank dispatches while it measures (FSDP2's, the TP layers', DTensorMuon's),
with the bytes it sends as the lesson's Ledger counts them. dtensor_demo.py --compare prints what it measured."""

import contextlib

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

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

