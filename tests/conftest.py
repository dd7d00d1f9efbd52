"""Shared fixtures for the test suite.

Tolerance policy
----------------
Every comparison in this suite but one is bit-exact (torch.equal), with no tolerance:
  * nothing but the gradient is reduced across ranks, and the gradients are
    multiples of 2**-10 whose float32 sum is exact in any order (script, section 6);
  * momentum, AdamW and the parameter update are elementwise, so a shard gets the
    same bits as the whole tensor;
  * Newton-Schulz runs on the same full bf16 matrix as torch's, with the thread
    count pinned to 1 everywhere (bf16 matmul bits can depend on it), one matrix
    at a time through torch's own 2-D calls, by every strategy.
One comparison is not exact, by construction: --batched-ns stacks same-shape matrices into
bf16 baddbmm, which rounds some near-ties unlike torch's addmm; it is held to a bound derived
in the script (batched_ns_tolerance) and tested in test_math.py and test_strategies.py.
Real trainings: tests/test_gpt.py (the policy of muon_tools.py's section 12, which
examples/train_gpt.py applies) is bit for bit on Gloo for any DP x TP: the DP reduce-scatter and
the TP all-reduces add in rank order, and the one-process reference adds TP's pieces in that order;
only its check of the bound path (the same run verified as NCCL would be, TP > 2) holds each step's
gradients within 4 x the one process's own fp32 error against float64 plus n u of the largest entry,
the free-running drift reported beside a one-ulp chaos floor. tests/test_dtensor.py and
tests/test_train_gpt_dtensor.py run real FSDP2 x TP trainings, and tests/test_moe.py a routed MoE GPT's
under expert parallel x FSDP2 x TP, whose reductions (FSDP2's, DTensor's, the experts' all-to-all) add
in torch's own order: checked by dtensor_demo.py's section 7 with that bound (the replay bit for bit at
every step, each step's gradients and loss against float64 within the bound, the free-running drift
reported beside the chaos floor; for the MoE, every routing decision against the one process's own at
the ranks' weights: identical, or a near-tie the router probabilities' difference explains).
tests/test_dtensor_snippet.py replays the practitioner's loop of notes/10 (clipped, accumulated,
resumed) bit for bit; only its gradient norm, summed shard by shard, is held to a bound (n u) against
one process's.
If another test ever needs a tolerance, the reason must be written beside it.

Every reference is PyTorch's own torch.optim.Muon / torch.optim.AdamW (or its
Newton-Schulz), never this project's code compared with itself.
"""

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import distributed_muon_cpu as dm  # noqa: E402
import muon_large_runs as mlr  # noqa: E402,F401  (the tests import it from here)
import muon_owners as mo  # noqa: E402,F401  (the tests import it from here)
import muon_tools as mt  # noqa: E402

SCRIPT = os.path.join(ROOT, "distributed_muon_cpu.py")


# The grids every strategy is checked on, and the run each test asks for: 3 steps (so the run
# resumes from a state_dict after step 2) and buckets small enough for several Muon buckets
# on every grid, TP = 8 included.
GRIDS = [(1, 1), (8, 1), (4, 2), (2, 4), (1, 8), (3, 2)]
STEPS = 3
BUCKET = 16_384  # elements


def grid_run(run_grid, dp, tp, **config):
    """The session's run of this grid and configuration, at STEPS steps and BUCKET-element buckets."""
    return run_grid(dp, tp, steps=STEPS, bucket_size=BUCKET, **config)


@pytest.fixture(autouse=True)
def reap_runs():
    """After every test: end what its real runs (test_interrupts.Run, in their own sessions) left alive, should the
    test have failed before it ended them: a run of 2000 steps once went on for 40 minutes beside the suite."""
    yield
    runs = getattr(sys.modules.get("test_interrupts"), "STARTED", [])
    for run in runs:
        run.kill_all()
    runs.clear()


@pytest.fixture(scope="session")
def run_grid():
    """run_grid(dp, tp, **config) -> results of mt.run, each configuration spawned once per session."""
    cache = {}

    def run(dp, tp, **overrides):
        cfg = mt.RunConfig(dp=dp, tp=tp, **overrides)
        if cfg not in cache:
            cache[cfg] = mt.run(cfg, print_fn=lambda *a, **k: None)
        return cache[cfg]

    return run


@pytest.fixture(scope="session")
def single_process_group():
    """A world of one Gloo rank inside the test process, for the optimizer's API."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{mt.free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield dm.make_grid(1, 1, 0)
    dist.destroy_process_group()


def layout_metas(dp, tp, bucket_size, **config):
    """Every DP rank's dist_meta for the demo model, from the layout the run's optimizer plans."""
    cfg = mt.RunConfig(dp=dp, tp=tp, bucket_size=bucket_size, **config)
    return mt.plan_optimizer(cfg).layout.metas


def presence_bytes(n_params, world):
    """Bytes each rank sends (and receives) to agree which parameters have a gradient and whether every rank
    can step: a ring all-reduce of one byte per parameter and one more, padded to a multiple of the world size."""
    padded = -(-(n_params + 1) // world) * world
    return 2 * (world - 1) * (padded // world)
