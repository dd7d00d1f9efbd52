"""DTensorMuon's construction on 2 Gloo ranks: the ranks' agreement (distmuon/dtensor/optimizer.py DescriptionSwap)
started before the state is made and finished after it. Where the ranks agree, one all_gather of 33 bytes a rank and
no all_gather_object; where their parameter lists differ, the Copies gathered and every rank plans the same; a
problem on one rank raised on every rank, naming it; and a construction or add_param_group refused by another rank's
problem leaves no state behind (the state made while the agreement travelled goes again). And a step where only one
rank has a Muon matrix (a plain one of its own): every rank runs the step's one exchange, so none waits for a peer
that skipped it, and the matrix steps as torch.optim.Muon steps it.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import muon_tools
from distmuon import checks
from distmuon.dtensor import DTensorMuon
from test_arguments import plan_of


@dataclass(frozen=True)
class Spawn:
    dp: int = 2
    tp: int = 1
    timeout_s: float = 120


def shared(mesh, seed=0):
    """[(name, DTensor)]: two matrices sharded over the mesh, the same on every rank."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    return [(name, distribute_tensor(torch.randn(8, 4, generator=g), mesh, [Shard(0)])) for name in ("w", "v")]


def gathers():
    """A recorder of the all-gathers of the construction that follows: ("all_gather", bytes sent) or
    ("all_gather_object", None); stop() puts torch's back and returns them."""
    said, originals = [], (dist.all_gather, dist.all_gather_object)

    def all_gather(output, tensor, *args, **kwargs):
        said.append(("all_gather", tensor.numel() * tensor.element_size()))
        return originals[0](output, tensor, *args, **kwargs)

    def all_gather_object(output, obj, *args, **kwargs):
        said.append(("all_gather_object", None))
        return originals[1](output, obj, *args, **kwargs)

    dist.all_gather, dist.all_gather_object = all_gather, all_gather_object

    def stop():
        dist.all_gather, dist.all_gather_object = originals
        return said
    return stop


def refusal(make):
    """The line make() raised (a ValueError), or None where it built."""
    try:
        make()
    except ValueError as e:
        return str(e)
    return None


def construction_rank(rank, spawn, device):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    # every rank describes the same parameters: one all_gather of a flag and a digest, nothing else
    stop = gathers()
    opt = DTensorMuon(shared(mesh), lr=0.02)
    out["agreeing"] = dict(gathers=stop(), names=opt.names, owners=opt.owners, state=sorted(
        (n, sorted(opt.state[p])) for n, p in opt.param_by_name.items()))
    # a plain matrix of this rank's own beside them: the digests differ, the Copies are gathered
    own = (f"own{rank}", torch.randn(4, 4, generator=torch.Generator().manual_seed(rank)))
    stop = gathers()
    opt = DTensorMuon(shared(mesh) + [own], lr=0.02)
    out["differing"] = dict(gathers=stop(), names=opt.names, owners=opt.owners,
                            local=opt.local_matrices, held=sorted(n for n, p in opt.param_by_name.items()
                                                                  if opt.state[p]))
    # a problem on rank 1 alone (its expert_stacks name no parameter), with Copies equal to rank 0's
    stacks = ("nope",) if rank == 1 else ()
    out["problem"] = refusal(lambda: DTensorMuon(shared(mesh), lr=0.02, expert_stacks=stacks))
    # add_param_group: rank 1's new parameter is no matrix; rank 0's is, and it made its state before the agreement
    opt = DTensorMuon(shared(mesh), lr=0.02)
    before = plan_of(opt)
    extra = torch.randn(*((6, 6) if rank == 0 else (6, 6, 2)), generator=torch.Generator().manual_seed(7))
    out["add"] = refusal(lambda: opt.add_param_group(dict(params=[("x", extra)])))
    out["add_unchanged"] = plan_of(opt) == before and extra not in opt.state
    opt.add_param_group(dict(params=[("x", torch.randn(6, 6))]))  # a valid one after it, on every rank
    out["added"] = sorted(n for n, p in opt.param_by_name.items() if opt.state[p])
    # one exchange, a Muon matrix on rank 1 alone: rank 0 has nothing of Muon to send, and runs the exchange anyway
    g = torch.Generator().manual_seed(3)
    bias, solo = torch.nn.Parameter(torch.randn(4, generator=g)), torch.nn.Parameter(torch.randn(6, 5, generator=g))
    groups = [dict(params=[("b", bias)], algorithm="adamw")] + ([dict(params=[("solo", solo)])] if rank == 1 else [])
    opt = DTensorMuon(groups, lr=0.02)
    reference = torch.optim.Muon([torch.nn.Parameter(solo.detach().clone())], lr=0.02)
    bias.grad = torch.full_like(bias, 2.0**-10)
    solo.grad = reference.param_groups[0]["params"][0].grad = torch.arange(30.0).view(6, 5) * 2.0**-10
    before = solo.detach().clone()
    opt.step()
    reference.step()
    out["solo"] = dict(moved=not torch.equal(solo.detach(), before),
                       torch=torch.equal(solo.detach(), reference.param_groups[0]["params"][0].detach()))
    return out


@pytest.fixture(scope="module")
def ranks():
    return muon_tools.spawn_ranks(Spawn(), construction_rank)


def test_agreeing_ranks_send_one_all_gather_of_33_bytes_and_make_every_state(ranks):
    for r in ranks:
        assert r["agreeing"]["gathers"] == [("all_gather", 33)], r["agreeing"]["gathers"]
        assert r["agreeing"]["names"] == ["v", "w"]
        assert r["agreeing"]["state"] == [("v", ["momentum_buffer"]), ("w", ["momentum_buffer"])]
    assert ranks[0]["agreeing"]["owners"] == ranks[1]["agreeing"]["owners"] and ranks[0]["agreeing"]["owners"]


def test_ranks_with_different_parameters_gather_their_copies_and_plan_alike(ranks):
    for rank, r in enumerate(ranks):
        d = r["differing"]
        assert d["gathers"] == [("all_gather", 33), ("all_gather_object", None), ("all_gather_object", None)]
        assert d["names"] == ["own0", "own1", "v", "w"]  # every rank's names: what the gradient vote runs on
        assert d["local"] == {f"own{rank}": [f"own{rank}"]} and d["held"] == sorted([f"own{rank}", "v", "w"])
    assert ranks[0]["differing"]["owners"] == ranks[1]["differing"]["owners"]


def test_a_problem_on_one_rank_is_raised_on_every_rank_naming_it(ranks):
    why = "expert_stacks names no Muon parameter: nope"
    assert [r["problem"] for r in ranks] == [f"rank 1: {why}", why]


def test_an_add_param_group_refused_by_another_rank_leaves_no_state_behind(ranks):
    why = checks.not_a_matrix("x", (6, 6, 2), expert_stacks=True)
    assert [r["add"] for r in ranks] == [f"rank 1: {why}", why]
    assert all(r["add_unchanged"] for r in ranks)  # rank 0 made x's state, then the agreement refused it
    assert all(r["added"] == ["v", "w", "x"] for r in ranks)


def test_a_muon_matrix_on_one_rank_alone_steps_and_no_rank_waits_for_another(ranks):
    assert ranks[1]["solo"] == dict(moved=True, torch=True)
    assert not ranks[0]["solo"]["moved"]  # not rank 0's parameter: it never stepped it
