"""DTensorMuon on 2 Gloo ranks, parameters sharded by distribute_tensor: float64, bfloat16 and float16 parameters
stepped as torch.optim.Muon and AdamW step them on one process (momentum and the update added in the parameter's
dtype, Newton-Schulz in bf16), and a pickled optimizer of the world group (plain and sharded parameters), whose
copy steps as torch's pickled copy does; its pickle, unpickled in a process of one rank, is refused in one line
(its group is not there).

Two things of torch's own set the reference for 16-bit parameters (notes/07-pitfalls.md):
- torch 2.14's Muon, on a bf16 parameter without Nesterov, normalizes its own momentum buffer in place (its
  Newton-Schulz casts with .bfloat16(), the buffer itself, then divides in place); pytorch/pytorch PR #194664
  casts a copy instead. The reference here is torch's Muon so mended (DTensorMuon keeps the buffer, as it does).
- torch's CPU add_(x, alpha=) in bf16 and fp16 rounds its vectorized body and its scalar tail differently, so an
  element's last bit depends on where it lies in the tensor, and a shard puts other elements in the tail than the
  whole parameter does: there each parameter is within one of its dtype's steps (eps x |p|) per optimizer step.
  Where every shard and the whole hold a multiple of 64 elements (ALIGNED, as a real model's weights do), all of
  them take the vectorized body, and the bits are torch's.
"""

import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import muon_tools
from distmuon.dtensor import DTensorMuon

# Muon's matrices (a tall one split across the ranks unevenly, a wide one; one row, all of it on rank 0, in a group
# without Nesterov: its update is its momentum, the very tensor in bf16, which the owner must not orthogonalize over)
# and an AdamW vector, each Shard(0).
SHAPES = {"tall.weight": (9, 4), "wide.weight": (4, 10), "row.weight": (1, 6), "bias": (6,),
          "block.weight": (16, 64), "block.bias": (128,)}
MUON = ("tall.weight", "wide.weight", "block.weight")
PLAIN_MOMENTUM = ("row.weight",)
# Every shard, and the whole, a multiple of 64 elements: torch's vectorized body only, so torch's bits in any dtype
ALIGNED = ("block.weight", "block.bias")
DTYPES = (torch.float64, torch.bfloat16, torch.float16, torch.float32)
STEPS = 3


@dataclass
class Spawn:
    dp: int = 2
    tp: int = 1
    timeout_s: float = 120.0


def start(dtype, shapes=SHAPES):
    """{name: the full starting tensor}, the same on every rank."""
    return {n: torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype)
            for i, (n, s) in enumerate(shapes.items())}


def gradient(name, step, dtype, shapes=SHAPES):
    """The total gradient of a parameter at a step, the same on every rank."""
    return torch.randn(shapes[name], generator=torch.Generator().manual_seed(100 * step + len(name))).to(dtype)


LR = 0.05  # Muon's: large enough to move a bf16 weight of about 1 (its step there is 2**-7) at every step


def groups(params):
    """[a Muon group, one without Nesterov, an adamw group] of {name: tensor}."""
    return [dict(params=[(n, params[n]) for n in MUON], lr=LR),
            dict(params=[(n, params[n]) for n in PLAIN_MOMENTUM], lr=LR, nesterov=False),
            dict(params=[(n, p) for n, p in params.items() if n not in MUON + PLAIN_MOMENTUM], algorithm="adamw",
                 weight_decay=0.01)]


def torchs(params):
    return [torch.optim.Muon([params[n] for n in MUON], lr=LR),
            torch.optim.Muon([params[n] for n in PLAIN_MOMENTUM], lr=LR, nesterov=False),
            torch.optim.AdamW([p for n, p in params.items() if n not in MUON + PLAIN_MOMENTUM], weight_decay=0.01)]


def run(optimizers, params, steps, grad_of):
    for step in steps:
        for name, p in params.items():
            p.grad = grad_of(name, step, p)
        for opt in optimizers:
            opt.step()


def pickled_run(place, grad_of):
    """float32 parameters placed by `place`, one step, the optimizer pickled and unpickled, two more steps of the
    copy: (the parameters whose full tensor is not torch's pickled copy's after them, or that the copy did not move;
    the pickle's bytes)."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    ours = {n: torch.nn.Parameter(place(t)) for n, t in start(torch.float32).items()}
    ref = {n: torch.nn.Parameter(t) for n, t in start(torch.float32).items()}
    opt, ref_opts = DTensorMuon(groups(ours)), torchs(ref)
    run([opt], ours, range(1), grad_of)
    run(ref_opts, ref, range(1), lambda name, step, p: gradient(name, step, p.dtype))
    blob = pickle.dumps(opt)
    copy, ref_copies = pickle.loads(blob), [pickle.loads(pickle.dumps(o)) for o in ref_opts]
    copied = dict(copy.param_by_name)
    in_groups = MUON + PLAIN_MOMENTUM + tuple(n for n in SHAPES if n not in MUON + PLAIN_MOMENTUM)  # torchs' order
    ref_copied = dict(zip(in_groups, [p for o in ref_copies for g in o.param_groups for p in g["params"]]))
    run([copy], copied, range(1, STEPS), grad_of)
    run(ref_copies, ref_copied, range(1, STEPS), lambda name, step, p: gradient(name, step, p.dtype))
    wrong = [n for n in SHAPES if not torch.equal(full(copied[n]), ref_copied[n]) or
             torch.equal(full(copied[n]), full(ours[n]))]
    return wrong + ([] if copy.axis.group is dist.group.WORLD else ["the group"]), blob


def without_aliasing():
    """torch's Muon as pytorch/pytorch PR #194664 mends it: its Newton-Schulz fed a copy of the update (the same
    operations; only a bf16 momentum buffer without Nesterov, which torch 2.14 overwrote, is kept)."""
    import torch.optim._muon as torch_muon

    newton_schulz = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = lambda update, *args: newton_schulz(update.clone(), *args)


def problems(ours, ref, first, dtype):
    """The parameters not torch's (torch.equal; 16-bit but ALIGNED: further than one step of the dtype per optimizer
    step, the module's docstring) or that did not move from `first`."""
    far = lambda a, b: (a.double() - b.double()).abs() > STEPS * torch.finfo(dtype).eps * b.double().abs()
    return ([n for n in SHAPES if ours[n].dtype != dtype or (
                bool(far(ours[n], ref[n]).any()) if dtype.itemsize == 2 and n not in ALIGNED
                else not torch.equal(ours[n], ref[n]))]
            + [f"{n} did not move" for n in SHAPES if torch.equal(ref[n], first[n])])


def ranks_body(rank, spawn, device):
    """Each dtype: DTensorMuon over sharded parameters against torch's optimizers over whole ones, on this rank
    ({dtype: its problems}); then pickled_run of plain and of sharded parameters, and the plain one's pickle."""
    torch.set_num_threads(1)
    without_aliasing()
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    mesh, out = init_device_mesh("cpu", (2,)), {}
    shard = lambda t: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)
    sharded_grad = lambda name, step, p: shard(gradient(name, step, p.dtype))
    whole_grad = lambda name, step, p: gradient(name, step, p.dtype)
    for dtype in DTYPES:
        ours = {n: torch.nn.Parameter(shard(t)) for n, t in start(dtype).items()}
        ref = {n: torch.nn.Parameter(t) for n, t in start(dtype).items()}
        opt = DTensorMuon(groups(ours))
        run([opt], ours, range(STEPS), sharded_grad)
        run(torchs(ref), ref, range(STEPS), whole_grad)
        out[str(dtype)] = problems({n: t.full_tensor() for n, t in ours.items()}, ref, start(dtype), dtype)
    for kind, place, grad_of in (("plain", lambda t: t, whole_grad), ("sharded", shard, sharded_grad)):
        out[f"pickle {kind}"], blob = pickled_run(place, grad_of)
        out.setdefault("blob", blob)  # the plain one's: a process of one rank unpickles it
    return out


@pytest.fixture(scope="module")
def ranks():
    return muon_tools.spawn_ranks(Spawn(), ranks_body)


@pytest.mark.parametrize("dtype", [str(d) for d in DTYPES])
def test_each_dtype_steps_as_torchs_on_two_ranks(ranks, dtype):
    assert [r[dtype] for r in ranks] == [[], []], "parameters not torch's (bits; 16-bit: one step), on each rank"


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_a_pickled_optimizer_of_the_world_steps_as_torchs_pickled_copy(ranks, kind):
    assert [r[f"pickle {kind}"] for r in ranks] == [[], []], "parameters not torch's pickled copy's bits, on each rank"


def test_a_pickle_whose_group_is_not_here_is_refused(single_process_group, ranks):
    """Rank 0's pickle (a world of ranks 0 and 1), unpickled on this one-rank world: refused in one line."""
    with pytest.raises(ValueError, match=r"^this DTensorMuon was pickled with the process group of ranks \[0, 1\], "
                                         r"which this process does not have: create it \(dist.new_group\("):
        pickle.loads(ranks[0]["blob"])
