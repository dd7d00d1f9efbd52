"""Parameters without a gradient: skipped where no rank has one, zeros where some ranks lack it.

torch.optim.Muon and AdamW skip a parameter whose .grad is None (no weight decay, no
momentum or moment update, no step count). The reference here is fed exactly that: the
sum over the DP ranks that have a gradient, or None where none has one.
"""

import pytest

from conftest import BUCKET, layout_metas, suite_config
from distmuon import owners
import muon_tools

# (name, DP rank or -1 for every rank, step); the run has 3 steps (mid-run and the last step apart) and
# resumes from a state_dict after step 2.
MISSING = (
    # a frozen embedding: no gradient anywhere, ever, so no state and no change
    ("embed.weight", -1, 1), ("embed.weight", -1, 2), ("embed.weight", -1, 3),
    ("layers.0.mlp.fc1.weight", -1, 2),  # a Muon matrix skipped mid-run: its momentum waits
    ("layers.1.mlp.fc2.weight", -1, 3),  # ... and at the last step
    ("layers.1.norm1.weight", -1, 1),  # an AdamW vector whose state starts at step 2
    ("layers.0.attn.qkv.weight", 0, 1), ("layers.0.attn.qkv.weight", 0, 3),  # some ranks only: TP-split Muon
    ("layers.1.router.weight", 1, 2),  # some ranks only: a TP-replicated Muon matrix
    ("lm_head.weight", 1, 2),  # some ranks only: AdamW
)
# every strategy and the baseline on the uneven 3 x 2 grid, and the exchanges of the owner strategies elsewhere
RUNS = [(dict(strategy=s), 3, 2) for s in owners.STRATEGIES] + [(dict(baseline=True), 3, 2),
                                                             (dict(strategy="owner"), 8, 1),
                                                             (dict(strategy="comm-free"), 2, 4)]
AT = dict(steps=3, bucket_size=BUCKET)  # 3 steps: MISSING's steps 2 and 3 apart
GRID_RUNS = [suite_config(dp=dp, tp=tp, missing_grads=m, **AT, **run) for run, dp, tp in RUNS for m in (MISSING, ())]


@pytest.mark.parametrize("run,dp,tp", RUNS)
def test_missing_gradients_match_torch(run_grid, run, dp, tp):
    result = run_grid(dp, tp, missing_grads=MISSING, **AT, **run)
    checks = {c["name"]: c for c in result["checks"]}
    assert [n for n, c in checks.items() if not c["identical"]] == [] and result["passed"]
    assert checks["embed.weight"]["max_abs_update"] == 0  # frozen: torch left it alone, and so did we
    assert all(c["max_abs_update"] > 0 for n, c in checks.items() if n != "embed.weight")
    # The frozen embedding has no state anywhere: the same state as without missing gradients,
    # less embed.weight's AdamW moments (2 x 4 bytes an element) and step count (4 bytes).
    metas = layout_metas(dp, tp, BUCKET, **run)
    embed = [metas[rank // tp]["embed.weight"].local_numel for rank in range(dp * tp)]
    full = run_grid(dp, tp, **AT, **run)
    assert result["state_bytes"] == [s - (8 * n + 4 if n else 0) for s, n in zip(full["state_bytes"], embed)]


def test_a_missing_gradient_outside_the_run_is_refused():
    cfg = muon_tools.RunConfig(missing_grads=(("embed.weight", 4, 1),))  # DP is 4: ranks 0..3
    with pytest.raises(ValueError, match=r"missing gradient \(embed.weight, DP rank 4, step 1\)"):
        muon_tools.validate(cfg, muon_tools.demo_specs(cfg))
