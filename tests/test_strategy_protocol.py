"""The step and its strategy see each other through distmuon/strategy.py's typed interface: every strategy of the
lesson (wrapped by large runs or not) is a Strategy, every optimizer of the lesson a StepContext, and no strategy
module reaches into the optimizer by an underscored attribute."""

import os
import re

import pytest
import torch

from conftest import ROOT
import distributed_muon_cpu
from distmuon import large_runs
from distmuon import owners
from distmuon.strategy import StepContext, Strategy


def test_every_strategy_is_a_strategy_and_every_optimizer_a_step_context(single_process_group):
    for name, optimizer in owners.OPTIMIZERS.items():
        for wrapper in (None, large_runs.LargeRuns()):
            opt = optimizer([dict(params=[("w", torch.zeros(4, 3, requires_grad=True))])],
                            grid=single_process_group, large_runs=wrapper)
            assert isinstance(opt, StepContext) and isinstance(opt.strategy, Strategy), (name, wrapper)
            assert opt.strategy.name == name
    assert not isinstance(object(), Strategy) and not isinstance(distributed_muon_cpu.Gather(), StepContext)  # the check can fail


@pytest.mark.parametrize("path", ["distmuon/owners.py", "distmuon/large_runs.py"])
def test_no_strategy_touches_an_underscored_attribute_of_the_optimizer(path):
    with open(os.path.join(ROOT, path)) as f:
        source = f.read()
    assert re.findall(r"\b(?:opt|optimizer)\._\w+", source) == []
    assert re.findall(r"\b(?:opt|optimizer)\._\w+", "opt._update_state(x)") == ["opt._update_state"]
