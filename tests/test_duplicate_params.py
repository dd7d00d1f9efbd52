"""A tensor given twice in one param group, as torch's optimizers take it: torch's add_param_group warns that this
"will cause an error" in future (pytorch/pytorch#40967), and torch.optim.Muon and AdamW step such a tensor once per
entry, with one state. DTensorMuon does the same, bit for bit: on one rank, and on 2 Gloo ranks with the tensor
plain or sharded by distribute_tensor; Muon with and without Nesterov, float32 and bfloat16 (CASES). The lesson's ZeRO-1
optimizers refuse it (their flat buffers would give each entry its own state), in one line, changing nothing."""

import copy
import warnings

import pytest
import torch

import test_dtensor_dtypes_and_pickle
import distributed_muon_cpu
import muon_tools
from test_dtensor_dtypes_and_pickle import Spawn
from distmuon.dtensor import DTensorMuon

SHAPES = {"w": (9, 4), "other": (4, 10), "b": (6,)}  # w twice in the Muon group, b twice in the AdamW group
STEPS = 3
# Not (False, bfloat16): there torch.optim.Muon's Newton-Schulz divides a bf16 momentum buffer in place by its norm
# (update is the buffer itself, and .bfloat16() no copy), a difference from DTensorMuon with or without duplicates.
CASES = [(True, torch.float32), (True, torch.bfloat16), (False, torch.float32)]
TORCH_WARNING = "optimizer contains a parameter group with duplicate parameters; in future, this will cause an error"


def start(dtype):
    return test_dtensor_dtypes_and_pickle.start(dtype, SHAPES)


def gradient(name, step, dtype):
    return test_dtensor_dtypes_and_pickle.gradient(name, step, dtype, SHAPES)


def steps_as_torch(nesterov, dtype, place=lambda t: t):
    """DTensorMuon over [w, w, other] (Muon) and [b, b] (AdamW), each placed by `place`, against torch.optim.Muon and
    AdamW over the same lists of whole tensors, STEPS steps: (the names whose full tensor or state is not torch's
    bits, or that did not move; the warnings DTensorMuon's construction gave)."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    ours = {n: torch.nn.Parameter(place(t)) for n, t in start(dtype).items()}
    ref = {n: torch.nn.Parameter(t) for n, t in start(dtype).items()}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt = DTensorMuon([dict(params=[ours["w"], ours["w"], ours["other"]], nesterov=nesterov),
                           dict(params=[ours["b"], ours["b"]], algorithm="adamw", weight_decay=0.01)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refs = [torch.optim.Muon([ref["w"], ref["w"], ref["other"]], nesterov=nesterov),
                torch.optim.AdamW([ref["b"], ref["b"]], weight_decay=0.01)]
    for step in range(STEPS):
        for name in SHAPES:
            ours[name].grad = place(gradient(name, step, dtype))
            ref[name].grad = gradient(name, step, dtype)
        opt.step()
        for r in refs:
            r.step()
    theirs = {p: s for r in refs for p, s in r.state.items()}
    wrong = [n for n in SHAPES if not torch.equal(full(ours[n]), ref[n]) or torch.equal(ref[n], start(dtype)[n])
             or not all(torch.equal(full(v), theirs[ref[n]][k]) for k, v in opt.state[ours[n]].items())]
    return wrong, [str(w.message) for w in said]


def ranks_body(rank, spawn, device):
    """steps_as_torch for each case, plain and sharded (Shard(0) on a mesh of the 2 ranks): {case: wrong names}."""
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    shard = lambda t: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)
    return {f"{kind} {nesterov} {dtype}": steps_as_torch(nesterov, dtype, place)[0]
            for kind, place in (("plain", lambda t: t), ("sharded", shard)) for nesterov, dtype in CASES}


@pytest.fixture(scope="module")
def ranks():
    return muon_tools.spawn_ranks(Spawn(), ranks_body)


@pytest.mark.parametrize("nesterov,dtype", CASES)
def test_a_tensor_twice_steps_as_torchs_on_one_rank(single_process_group, nesterov, dtype):
    torch.set_num_threads(1)
    wrong, said = steps_as_torch(nesterov, dtype)
    assert wrong == [], "not torch's bits (parameter or state), or did not move"
    assert len(said) == 2 and all(TORCH_WARNING in s for s in said), said  # torch's warning, once per group


@pytest.mark.parametrize("kind", ["plain", "sharded"])
@pytest.mark.parametrize("nesterov,dtype", CASES)
def test_a_tensor_twice_steps_as_torchs_on_two_ranks(ranks, kind, nesterov, dtype):
    assert [r[f"{kind} {nesterov} {dtype}"] for r in ranks] == [[], []], "not torch's bits, on each rank"


def test_the_zero1_optimizers_refuse_a_tensor_twice_changing_nothing(single_process_group):
    w, v = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(4, 3))
    with pytest.warns(UserWarning, match=TORCH_WARNING), pytest.raises(
            ValueError, match=r"^parameters a and b are the same tensor: ZeRO-1's layout gives each entry its own "
                              r"range of the flat buffers .* pass it once \(DTensorMuon steps it as torch does\)$"):
        distributed_muon_cpu.DistributedMuon([dict(params=[("a", w), ("b", w)])], grid=single_process_group)
    opt = distributed_muon_cpu.DistributedMuon([dict(params=[("v", v)])], grid=single_process_group)
    groups = [list(g["params"]) for g in opt.param_groups]
    with pytest.warns(UserWarning, match=TORCH_WARNING), pytest.raises(ValueError, match="are the same tensor"):
        opt.add_param_group(dict(params=[("a", w), ("b", w)]))
    assert [list(g["params"]) for g in opt.param_groups] == groups and list(opt.param_by_name) == ["v"]


def test_a_tensor_twice_saves_and_loads_as_torchs(single_process_group):
    """The state dict numbers the tensor's entries as torch's does; torch's own state dict, loaded into a fresh
    DTensorMuon, steps on as torch.optim.Muon does."""
    torch.set_num_threads(1)
    ours = {n: torch.nn.Parameter(t) for n, t in start(torch.float32).items() if n != "b"}
    ref = {n: torch.nn.Parameter(t) for n, t in start(torch.float32).items() if n != "b"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = DTensorMuon([ours["w"], ours["w"], ours["other"]])
        torchs = torch.optim.Muon([ref["w"], ref["w"], ref["other"]])
        for step in range(2):
            for name in ours:
                ours[name].grad, ref[name].grad = gradient(name, step, torch.float32), gradient(name, step, torch.float32)
            (opt if step == 0 else loaded).step()
            torchs.step()
            if step == 0:
                assert opt.state_dict()["param_groups"][0]["params"] == torchs.state_dict()["param_groups"][0]["params"]
                loaded = DTensorMuon([ours["w"], ours["w"], ours["other"]])
                loaded.load_state_dict(copy.deepcopy(torchs.state_dict()))  # torch's load shares its tensors
    assert all(torch.equal(ours[n], ref[n]) for n in ours)
