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
Real trainings: tests/test_gpt.py (the policy of muon_tools/training_checks.py, which
examples/train_gpt.py applies) is bit for bit on Gloo for any DP x TP: the DP reduce-scatter and
the TP all-reduces add in rank order, and the one-process reference adds TP's pieces in that order;
only its check of the bound path (the same run verified as NCCL would be, TP > 2) holds each step's
gradients within 4 x the one process's own fp32 error against float64 plus n u of the largest entry,
the free-running drift reported beside a one-ulp chaos floor. tests/test_dtensor.py and
tests/test_train_gpt_dtensor.py run real FSDP2 x TP trainings, and tests/test_moe.py a routed MoE GPT's
under expert parallel x FSDP2 x TP, whose reductions (FSDP2's, DTensor's, the experts' all-to-all) add
in torch's own order: checked by dtensor_verify.py with that bound (the replay bit for bit at
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

from dataclasses import dataclass
import datetime
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# The shell scripts the tests run (benchmarks/*.sh) start $PYTHON: this interpreter, not whichever `python` PATH has
os.environ["PYTHON"] = sys.executable

import distributed_muon_cpu  # noqa: E402
from distmuon import checks  # noqa: E402,F401  (the tests import it from here)
from distmuon import large_runs  # noqa: E402,F401  (the tests import it from here)
from distmuon import owners  # noqa: E402,F401  (the tests import it from here)
import muon_tools  # noqa: E402

SCRIPT = os.path.join(ROOT, "distributed_muon_cpu.py")


# The grids every strategy is checked on, and the run each test asks for: 2 steps (the run resumes
# from a state_dict after step 1: lost state, a restarted momentum or step count, would show at step 2)
# and buckets small enough for several Muon buckets on every grid, TP = 8 included.
GRIDS = [(1, 1), (8, 1), (4, 2), (2, 4), (1, 8), (3, 2)]
STEPS = 2
BUCKET = 4_096  # elements
# The suite's demo transformer is narrower than the command's (d = 64, not 128): the same matrices in kind
# (tall, square and wide; whole heads on every TP rank up to TP = 8) at an eighth of Newton-Schulz's FLOPs, which
# are most of every run here (bf16 matmuls run at about 1.7 GFLOP/s on a CPU without bf16 units). The command's
# own width runs in test_cli.py, test_interrupts.py and the notebooks.
SUITE_D_MODEL = 64


def suite_config(**config):
    """muon_tools.RunConfig(**config), SUITE_D_MODEL wide unless config says otherwise (for --model transformer)."""
    if config.get("model", muon_tools.RunConfig.model) == "transformer":
        config.setdefault("d_model", SUITE_D_MODEL)
    return muon_tools.RunConfig(**config)


def suite_specs(**config):
    """The parameters of the suite's demo model (suite_config(**config)'s)."""
    return muon_tools.demo_specs(suite_config(**config))


def grid_config(dp, tp, **config):
    """The configuration grid_run(run_grid, dp, tp, **config) asks for: for a module's GRID_RUNS."""
    return suite_config(dp=dp, tp=tp, steps=STEPS, bucket_size=BUCKET, **config)


def grid_run(run_grid, dp, tp, **config):
    """The session's run of this grid and configuration, at STEPS steps and BUCKET-element buckets."""
    return run_grid(dp, tp, steps=STEPS, bucket_size=BUCKET, **config)


@pytest.fixture(autouse=True)
def reap_runs():
    """After every test: end what its real runs (test_interrupts.Run, in their own sessions) left alive, should the
    test have failed before it ended them, so that a long run does not go on beside the suite."""
    yield
    runs = getattr(sys.modules.get("test_interrupts"), "STARTED", [])
    for run in runs:
        run.kill_all()
    runs.clear()


@dataclass(frozen=True)
class Together:
    """Several runs of one world size in one spawn: what spawn_ranks needs (dp x tp ranks, a timeout)."""

    dp: int
    tp: int
    timeout_s: float
    runs: tuple


def run_together_rank(rank, together, device):
    """Each run's steps on this rank, in order, on its grid (the world's groups, built once per grid)."""
    grids = {}
    for cfg in together.runs:
        if (cfg.dp, cfg.tp) not in grids:
            grids[cfg.dp, cfg.tp] = distributed_muon_cpu.make_grid(cfg.dp, cfg.tp, rank)
    return [muon_tools.run_demo_steps(cfg, grids[cfg.dp, cfg.tp], device) for cfg in together.runs]


def run_together(cfgs, body=run_together_rank):
    """{cfg: what muon_tools.run(cfg) returns} for runs of one world size, spawned once: each run's ranks do what
    muon_tools.run's do (the lesson's run_steps), and this process checks each against torch as run_rank's rank 0
    would (muon_tools.verify), sharing torch's reference between runs that have the same one (muon_tools.reference_params).
    Spawning the ranks (each imports torch) cost more than the steps of most runs here. body: what each rank
    runs, run_together_rank's signature (one that registers a strategy first, for a strategy a test defines)."""
    together = Together(dp=cfgs[0].dp * cfgs[0].tp, tp=1, timeout_s=max(c.timeout_s for c in cfgs), runs=tuple(cfgs))
    for cfg in cfgs:
        muon_tools.validate(cfg, muon_tools.demo_specs(cfg))
    t0 = time.perf_counter()
    ranks = muon_tools.spawn_ranks(together, body)
    seconds = (time.perf_counter() - t0) / len(cfgs)  # the ranks' time, shared out: a figure no test reads
    out = {}
    for i, cfg in enumerate(cfgs):
        checks, reference_s = muon_tools.verify(cfg, [r[i] for r in ranks])
        out[cfg] = muon_tools.report(cfg, muon_tools.plan_optimizer(cfg), [r[i] for r in ranks], checks, seconds,
                                     reference_s,
                             print_fn=lambda *a, **k: None)
    return out


def planned_runs():
    """Every configuration the collected test modules name in GRID_RUNS (the runs they ask run_grid for), in order."""
    planned = {}
    for name, module in sorted(sys.modules.items()):
        if name.startswith("test_"):
            planned.update(dict.fromkeys(getattr(module, "GRID_RUNS", ())))
    return list(planned)


@pytest.fixture(scope="session")
def run_grid():
    """run_grid(dp, tp, **config) -> what muon_tools.run returns for suite_config(dp=dp, tp=tp, **config), each run once per
    session. A configuration some collected module names in GRID_RUNS runs at the first request of any of its
    world size, with every other such configuration of that size, in one spawn (run_together); any other in a
    spawn of its own (muon_tools.run)."""
    cache = {}

    def run(dp, tp, **overrides):
        cfg = suite_config(dp=dp, tp=tp, **overrides)
        if cfg not in cache:
            planned = [c for c in planned_runs() if c not in cache and c.dp * c.tp == dp * tp]
            if cfg in planned:
                cache.update(run_together(planned))
            else:
                cache[cfg] = muon_tools.run(cfg, print_fn=lambda *a, **k: None)
        return cache[cfg]

    return run


@pytest.fixture(scope="session")
def single_process_group():
    """A world of one Gloo rank inside the test process, for the optimizer's API."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{muon_tools.free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield distributed_muon_cpu.make_grid(1, 1, 0)
    dist.destroy_process_group()


def layout_metas(dp, tp, bucket_size, **config):
    """Every DP rank's dist_meta for the demo model, from the layout the run's optimizer plans."""
    cfg = suite_config(dp=dp, tp=tp, bucket_size=bucket_size, **config)
    return muon_tools.plan_optimizer(cfg).layout.metas


def presence_bytes(n_params, world):
    """Bytes each rank sends (and receives) to agree which parameters have a gradient and whether every rank
    can step: a ring all-reduce of one byte per parameter and one more, padded to a multiple of the world size."""
    padded = -(-(n_params + 1) // world) * world
    return 2 * (world - 1) * (padded // world)
