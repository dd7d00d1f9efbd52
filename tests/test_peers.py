"""benchmarks/peers.py's plumbing, with whatever peers this Python has installed (the suite's Python has
none: they live in their own virtual environment, see the script's docstring). Its figures are never
checked: they are a shared machine's. Its bad flags are rows of tests/test_bad_input.py."""

import json
import os
import re
import sys
import types

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import peers  # noqa: E402
import peers_torchtitan  # noqa: E402


def test_one_and_two_processes_ours_bit_identical_every_peer_reported(capsys):
    assert peers.main(["--d", "8", "--layers", "1", "--rounds", "2", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:9].strip() in ("1", "2")]
    assert [r[1] for r in rows if r[1] == "torch.optim.Muon"] == ["torch.optim.Muon"]  # one process only
    for strategy in peers.OURS + (peers.DTENSOR.split()[1],):  # owner, comm-free, and DTensorMuon under FSDP2
        ours = [r for r in rows if r[1:3] == ["ours:", strategy]]
        assert [r[0] for r in ours] == ["1", "2"] and all(r[-1] == "bit-identical" for r in ours)
    for label in (peers.DTENSOR_NORMUON, peers.DTENSOR_PER_HEAD, peers.DTENSOR_OVERLAP):  # each its reference's bits
        same = [r for r in rows if r[1:1 + len(label.split())] == label.split()]
        assert [r[0] for r in same] == ["1", "2"] and all(r[-1] == "bit-identical" for r in same), label
    batched = [line for line in out.splitlines() if f"  {peers.DTENSOR_BATCHED}  " in line]  # torch's bits or near
    assert len(batched) == 2 and all(re.search(r"  (bit-identical|max \|d\| \S+ \([0-9.]+% of the step\)) *$", line)
                                     for line in batched), batched
    assert ("after one step: against torch.optim.Muon, the NorMuon rows against muon_tools.NorMuonReference"
            in out)
    for peer in peers.PEERS:
        version = peers.installed(peer)
        if version is None:
            assert f"  {peer.distribution}: {peers.NOT_INSTALLED}" in out
        elif peer.build is not None:  # a row at 1 and at 2 processes, or its failure, never a crash
            label = peer.label.format(v=version)
            assert out.count(f"  {label} ") == 2 or f"  {label}: failed: " in out
            if peer.compiles and f"  {label}: failed: " not in out:  # its compiling steps, apart from the table
                assert re.search(rf"^  {re.escape(label)}: 1 process [0-9.]+, [0-9.]+ s; 2 processes ", out, re.M)
    assert ("DTensorMuon beside microsoft/dion" in out) == any(
        p.distribution == "dion" and peers.installed(p) for p in peers.PEERS)
    assert "Patches applied at run time" in out


def test_dion_gets_torchs_lr_adjustment_from_two_groups():
    """torch's "original", lr max(1, rows / cols) ** 0.5, from dion's "spectral_norm" (lr (rows / cols) ** 0.5) on
    the tall and square matrices and no adjustment on the wide ones: every matrix of the benchmark's model."""
    weights, _ = peers.matrices(8, 2)
    groups = peers.dion_groups(weights)
    assert [g["adjust_lr"] for g in groups] == ["spectral_norm", None]
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(w) for w in weights.values())
    dion_rate = {"spectral_norm": lambda rows, cols: (rows / cols) ** 0.5, None: lambda rows, cols: 1.0}
    for g in groups:
        for p in g["params"]:
            assert dion_rate[g["adjust_lr"]](*p.shape) == torch.optim._muon._adjust_lr(1.0, "original", p.shape)
    assert {tuple(p.shape) for p in groups[1]["params"]} == {(8, 32)}  # fc2, the wide one


def test_compiled_functions_unwrapped_for_a_block_only():
    """A package's torch.compile'd functions (and an alias of one in another module) are the functions they wrap
    inside `unwrapped`, and compiled again after it, even when the block raises; `uncompiled` keeps the patch."""
    def f(x):
        return x + 1

    compiled = torch.compile(f)  # wrapped, not compiled: nothing is compiled until it is called
    pkg, sub = types.ModuleType("fake_pkg_xyz"), types.ModuleType("fake_pkg_xyz.sub")
    pkg.f, sub.f_alias, sub.plain = compiled, compiled, f
    sys.modules.update({"fake_pkg_xyz": pkg, "fake_pkg_xyz.sub": sub})
    try:
        found = peers.compiled_functions("fake_pkg_xyz")
        assert sorted((m.__name__, a) for m, a, _, _ in found) == [("fake_pkg_xyz", "f"),
                                                                    ("fake_pkg_xyz.sub", "f_alias")]
        with pytest.raises(RuntimeError, match="inside"):
            with peers.unwrapped(found):
                assert pkg.f is f and sub.f_alias is f and sub.plain is f
                raise RuntimeError("inside")
        assert pkg.f is compiled and sub.f_alias is compiled
        assert peers.uncompiled("fake_pkg_xyz") == "torch.compile unwrapped (run eagerly): f, f_alias"
        assert pkg.f is f and sub.f_alias is f
    finally:
        del sys.modules["fake_pkg_xyz"], sys.modules["fake_pkg_xyz.sub"]


def test_a_peer_installed_from_git_names_its_commit():
    commit = "0a059a4542e5aa74b40dcd1dce363836c7afcd48"
    from_git = json.dumps(dict(url="https://github.com/microsoft/dion.git",
                               vcs_info=dict(vcs="git", commit_id=commit, requested_revision=commit)))
    assert peers.git_commit(from_git) == "@0a059a4"
    assert peers.git_commit(json.dumps(dict(url="file:///src/dion", dir_info={}))) == ""  # from a folder
    assert peers.git_commit(None) == ""  # from the registry: pip writes no direct_url.json


def test_dion_beside_ours_and_its_compile_times():
    """The comparison table's numbers are the runs' (medians and minima of sync + step; dion's over ours), the
    compiled rows' first two steps are reported per process count, and nothing is printed without dion."""
    def run(times, compiling=None):
        return dict(times={label: dict(total=t) for label, t in times.items()}, compiling=compiling or {})

    compiled, eager = "dion 0.1.0 Muon, compiled", "dion 0.1.0 Muon, eager"
    runs = {1: run({peers.DTENSOR: [10.0, 12.0, 11.0], compiled: [30.0, 22.0, 25.0], eager: [40.0, 44.0, 41.0],
                    peers.DTENSOR_BATCHED: [20.0, 5.0, 50.0]}, {compiled: [61.25, 0.5]}),
            2: run({peers.DTENSOR: [8.0, 6.0, 7.0], compiled: [7.0, 9.0, 14.0]}, {compiled: [5.0, 0.25]})}
    rows = [line.split() for line in peers.beside_dion(runs).splitlines()[2:]]
    assert rows == [["1", "Muon", "11", "10", "25", "22", "2.27", "2.20", "41", "40", "3.73", "4.00"],
                    ["1", "Muon,", "batched_ns", "20", "5", "25", "22", "1.25", "4.40", "41", "40", "2.05", "8.00"],
                    ["2", "Muon", "7", "6", "9", "7", "1.29", "1.17"]]
    assert peers.compile_times(runs).splitlines()[1:] == [
        f"  {compiled}: 1 process 61.2, 0.5 s; 2 processes 5.0, 0.2 s"]
    ours_only = {1: run({peers.DTENSOR: [1.0], peers.DTENSOR_NORMUON: [2.0]})}
    assert peers.beside_dion(ours_only) == "" and peers.compile_times(ours_only) == ""


def test_distmuon_beside_ours_by_layout():
    """DistMuon's whole-matrix row beside DTensorMuon's as it is and overlapped, its per-head row beside ours per
    head: the runs' medians and minima, DistMuon's over ours; nothing where DistMuon did not run."""
    whole, heads = "torchtitan 0.2.2 DistMuon, whole matrices", "torchtitan 0.2.2 DistMuon, per head"
    runs = {2: dict(times={label: dict(total=t) for label, t in {
        peers.DTENSOR: [10.0, 8.0, 9.0], peers.DTENSOR_OVERLAP: [5.0, 6.0, 4.0], peers.DTENSOR_PER_HEAD: [20.0, 30.0],
        whole: [18.0, 16.0, 20.0], heads: [10.0, 12.0]}.items()})}
    rows = [line.split() for line in peers.beside_torchtitan(runs).splitlines()[2:]]
    assert rows == [["2", "Muon", "9", "8", "18", "16", "2.00", "2.00"],
                    ["2", "Muon,", "by", "layers,", "overlap", "1", "5", "4", "18", "16", "3.60", "4.00"],
                    ["2", "Muon,", "per", "head", "25", "20", "11", "10", "0.44", "0.50"]]
    runs[2]["times"].pop(heads)
    assert len(peers.beside_torchtitan(runs).splitlines()) == 4  # the per-head row gone with DistMuon's
    assert peers.beside_torchtitan({1: dict(times={peers.DTENSOR: dict(total=[1.0])})}) == ""


def test_check_is_bit_exact_else_relative_to_the_step():
    weights = {"w": torch.zeros(2, 2)}
    reference = {"w": torch.tensor([[0.5, -1.0], [0.25, 0.0]])}
    assert peers.check({"w": reference["w"].clone()}, reference, weights) == "bit-identical"
    off = reference["w"].clone()
    off[1, 1] = 0.125
    assert peers.check({"w": off}, reference, weights) == "max |d| 1.2e-01 (12.5% of the step)"


def test_missing_or_broken_peer_is_reported_not_raised():
    absent = peers.Peer("no-such-peer-xyz", "no_such_peer_xyz", "absent {v}", "-", lambda *a: None)
    broken = peers.Peer("torch", "no_such_module_xyz", "broken {v}", "-", lambda *a: None)
    built, patches, status = peers.contenders([absent, broken], 1, 0)
    assert [e.label for e in built] == [f"ours: {s}" for s in peers.OURS] + [
        peers.DTENSOR, peers.DTENSOR_BATCHED, peers.DTENSOR_NORMUON, peers.DTENSOR_PER_HEAD, peers.DTENSOR_OVERLAP]
    assert [e.algorithm for e in built][-5:] == ["muon", "muon", "normuon", peers_torchtitan.PER_HEAD,
                                                 "muon"] and patches == []
    assert status[0] == ("no-such-peer-xyz", peers.NOT_INSTALLED)
    assert status[1][0] == f"broken {peers.installed(broken)}"
    assert status[1][1].startswith("failed: ModuleNotFoundError: No module named 'no_such_module_xyz'")


def test_per_head_reference_is_torch_muon_on_each_head():
    """torchtitan's per-head rows' reference: torch.optim.Muon stepping each qkv head (head_dim rows) as a parameter
    of its own, written back in order; the other matrices as the whole-matrix reference steps them."""
    assert [peers_torchtitan.head_dim(d) for d in (768, 128, 96, 8)] == [64, 64, 32, 8]
    weights, total = peers.matrices(32, 1)
    per_head, whole = peers.reference_step(weights, total,
                                           peers_torchtitan.PER_HEAD), peers.reference_step(weights, total)
    qkv, rows = "layers.0.qkv", peers_torchtitan.head_dim(32)
    heads = {i: torch.nn.Parameter(w.clone()) for i, w in enumerate(weights[qkv].split(rows))}
    for head, g in zip(heads.values(), total[qkv].split(rows)):
        head.grad = g.clone()
    peers.torch_muon(heads).step()
    assert len(heads) == 3 and torch.equal(per_head[qkv], torch.cat(list(heads.values())))
    assert not torch.equal(per_head[qkv], whole[qkv])  # three heads are not one matrix
    assert all(torch.equal(per_head[n], whole[n]) for n in whole if n != qkv)


def test_torchtitan_runtime_gets_a_cpu_stream_from_cudas_keywords():
    """torch.cpu.Stream takes no device keyword (the reason for the patch); flex_shard's runtime, through the patched
    torch, gets one from CUDA's (device, priority) and torch's own CPU module otherwise."""
    with pytest.raises(TypeError):
        torch.cpu.Stream(device=torch.device("cpu"), priority=0)
    handle = peers_torchtitan.CpuStreamKeywords().get_device_module(torch.device("cpu"))
    assert isinstance(handle.Stream(device=torch.device("cpu"), priority=0), torch.cpu.Stream)
    assert handle.Event is torch.cpu.Event and handle.current_stream is torch.cpu.current_stream
    assert peers_torchtitan.CpuStreamKeywords().float32 is torch.float32
