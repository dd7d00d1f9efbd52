"""benchmarks/peers.py's plumbing, with whatever peers this Python has installed (the suite's Python has
none: they live in their own virtual environment, see the script's docstring). Its figures are never
checked: they are a shared machine's. Its bad flags are rows of tests/test_bad_input.py."""

import os
import sys

import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import peers  # noqa: E402


def test_one_and_two_processes_ours_bit_identical_every_peer_reported(capsys):
    assert peers.main(["--d", "8", "--layers", "1", "--rounds", "2", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:9].strip() in ("1", "2")]
    assert [r[1] for r in rows if r[1] == "torch.optim.Muon"] == ["torch.optim.Muon"]  # one process only
    for strategy in peers.OURS + (peers.DTENSOR.split()[1],):  # owner, comm-free, and DTensorMuon under FSDP2
        ours = [r for r in rows if r[1:3] == ["ours:", strategy]]
        assert [r[0] for r in ours] == ["1", "2"] and all(r[-1] == "bit-identical" for r in ours)
    for peer in peers.PEERS:
        version = peers.installed(peer)
        if version is None:
            assert f"  {peer.distribution}: {peers.NOT_INSTALLED}" in out
        elif peer.build is not None:  # a row at 1 and at 2 processes, or its failure, never a crash
            label = peer.label.format(v=version)
            assert out.count(f"  {label} ") == 2 or f"  {label}: failed: " in out
    assert "Patches applied at run time" in out


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
    assert [label for label, _, _ in built] == [f"ours: {s}" for s in peers.OURS] + [peers.DTENSOR] and patches == []
    assert status[0] == ("no-such-peer-xyz", peers.NOT_INSTALLED)
    assert status[1][0] == f"broken {peers.installed(broken)}"
    assert status[1][1].startswith("failed: ModuleNotFoundError: No module named 'no_such_module_xyz'")
