"""dtensor_demo.py's command line for a real training (--train): refused before any rank starts where its
check cannot hold; and the training checks it takes from muon_tools/training_checks.py, as examples/train_gpt.py
does, not from examples/. The run itself and its report are tested on the shared spawn of tests/test_dtensor.py."""

import math
import subprocess
import sys

import torch
import torch.nn as nn

from conftest import ROOT
import muon_tools

import dtensor_demo  # on sys.path: conftest puts the project root there


def test_train_with_batched_ns_is_refused_in_one_line(capsys):
    """--train checks its replay against torch bit for bit; --batched-ns is not bit-identical to torch."""
    assert dtensor_demo.main(["--train", "--batched-ns"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --train checks its replay against torch bit for bit, which --batched-ns does not "
                   "promise: use one of them\n"), err


def test_the_demo_imports_no_example():
    """Importing dtensor_demo loads no module of examples/ and puts no examples/ folder on sys.path."""
    probe = ("import sys, dtensor_demo; print('train_gpt' in sys.modules, "
             "any(p.rstrip('/').endswith('examples') for p in sys.path))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout


def test_training_checks_bound_drift_and_one_ulp():
    """bound_ratio is the ranks' error over REALIZED_FACTOR x the one process's + n u scale (1 exactly at the
    bound, NaN never passes, a zero bound holds only a zero error); loss_drift is relative to the second run;
    one_ulp_up moves entry 0 alone, toward +inf, by one fp32 ulp (a Parameter too)."""
    assert muon_tools.UNIT_ROUNDOFF == torch.finfo(torch.float32).eps / 2 and muon_tools.REALIZED_FACTOR == 4
    one_err, n, scale = 2.0**-20, 2**10, 2.0**4
    bound = 4 * one_err + n * 2.0**-24 * scale  # 2**-18 + 2**-10
    assert muon_tools.bound_ratio(bound, one_err, n, scale) == 1.0
    assert muon_tools.bound_ratio(math.nextafter(bound, math.inf), one_err, n, scale) > 1
    assert muon_tools.bound_ratio(bound / 2, one_err, n, scale) == 0.5 and muon_tools.bound_ratio(bound, one_err, 0, 0.0) == 2 ** 8 + 1
    assert not muon_tools.bound_ratio(math.nan, one_err, n, scale) <= 1
    assert muon_tools.bound_ratio(0.0, 0.0, n, 0.0) == 0.0 and muon_tools.bound_ratio(2.0**-60, 0.0, n, 0.0) == math.inf

    assert muon_tools.loss_drift([[1.0, 3.0], [4.0, 8.0]], [[1.0, 4.0], [8.0, 8.0]]) == 0.5  # |4 - 8| / 8, step 2
    assert muon_tools.loss_drift([[8.0]], [[4.0]]) == 1.0

    w = nn.Parameter(torch.tensor([[-1.0, 2.0], [3.0, 4.0]]))
    muon_tools.one_ulp_up(w)
    assert w.requires_grad and torch.equal(w.detach(), torch.tensor([[-1.0 + 2.0**-24, 2.0], [3.0, 4.0]]))
    muon_tools.one_ulp_up(w.data[1])  # a row: its own entry 0
    assert w[1, 0].item() == 3.0 + 2.0**-22 and w[0, 0].item() == -1.0 + 2.0**-24
