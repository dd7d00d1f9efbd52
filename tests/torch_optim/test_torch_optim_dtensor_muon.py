"""PyTorch's own optimizer tests (test/test_optim.py, TestOptimRenewed over optim_db) with DTensorMuon in optim_db's
Muon entry, on a one-rank Gloo group: every test torch.optim.Muon passes must pass with DTensorMuon too. Each test
runs twice in this process, once with torch.optim.Muon in the entry (the set to match, found anew on every run, not
written down) and once with DTensorMuon. README.md beside this file: the test file's origin, and each gap's cause.
"""

import functools

import pytest
import torch

import torch_optim_harness as harness

PROBLEM = harness.upstream_problem()
if PROBLEM:
    pytest.skip(PROBLEM, allow_module_level=True)

# The tests torch.optim.Muon passes and DTensorMuon does not yet, with their causes. Each is held to failing (an
# xfail, strict: one that passes fails the run until its line goes), so this dict shrinks as fixes land and ends
# empty. Emptying it by hand shows every one of them failing.
DTENSOR_MUON_KNOWN_GAPS = {}  # {test name: its cause (README.md: where in distmuon, and the fix)}


@functools.cache
def upstream_class(which):
    """The upstream CPU test class with torch.optim.Muon ("torch") or DTensorMuon ("dtensor") in the Muon entry."""
    cls = torch.optim.Muon if which == "torch" else harness.dtensor_muon_class()
    return harness.load(cls, which)


@functools.cache
def torch_result(name):
    return harness.run_test(upstream_class("torch"), name)


NAMES = harness.muon_test_names(upstream_class("torch"))


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(single_process_group):
    """DTensorMuon runs on the suite's one-rank Gloo world (tests/conftest.py), made once per session."""


@pytest.mark.parametrize("name", NAMES)
def test_dtensor_muon_passes_what_torch_muon_passes(name):
    outcome, detail, _ = torch_result(name)
    if outcome != "passed":
        pytest.skip(f"torch.optim.Muon's outcome is {outcome} ({detail}): not in the set to match")
    outcome, detail, text = harness.run_test(upstream_class("dtensor"), name)
    gap = DTENSOR_MUON_KNOWN_GAPS.get(name)
    if gap:
        assert outcome != "passed", f"passes now: remove it from DTENSOR_MUON_KNOWN_GAPS (was: {gap})"
        pytest.xfail(f"{gap}. Now: {detail}")
    assert outcome == "passed", f"torch.optim.Muon passes it; DTensorMuon's outcome is {outcome}: {detail}\n{text}"


def test_the_known_gaps_are_tests_torch_muon_passes():
    """A gap that names no test, or one torch's Muon does not pass, is a stale line."""
    stale = sorted(n for n in DTENSOR_MUON_KNOWN_GAPS if n not in NAMES or torch_result(n)[0] != "passed")
    assert not stale, f"DTENSOR_MUON_KNOWN_GAPS names tests torch.optim.Muon does not pass here: {stale}"


def test_the_swapped_class_is_the_one_the_tests_run():
    """The swap reaches the tests: a class that refuses every construction fails a test torch's Muon passes (were
    torch's Muon still in the entry, every DTensorMuon result above would be torch's)."""

    class Muon(torch.optim.Muon):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("the swapped class was constructed")

    name = "test_optimizer_can_be_printed_Muon_cpu_float32"
    outcome, detail, _ = harness.run_test(harness.load(Muon, "refusing"), name)
    assert torch_result(name)[0] == "passed"
    assert (outcome, detail) == ("failed", "RuntimeError: the swapped class was constructed")
