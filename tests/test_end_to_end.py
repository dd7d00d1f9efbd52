"""The whole flow on real Gloo ranks, against torch.optim.Muon / AdamW, and its accounting."""

import math

import pytest

from conftest import BUCKET, GRIDS, grid_config, grid_run, layout_metas, presence_bytes, run_together, suite_specs
import distributed_muon_cpu
import muon_tools

GRID_RUNS = [grid_config(dp, tp) for dp, tp in GRIDS + [(3, 2)]]


@pytest.mark.parametrize("dp,tp", GRIDS)
def test_bit_identical_to_torch(run_grid, dp, tp):
    result = grid_run(run_grid, dp, tp)
    specs = suite_specs()
    assert [c["name"] for c in result["checks"]] == [s.name for s in specs]
    not_identical = [c["name"] for c in result["checks"] if not c["identical"]]
    assert not_identical == []
    assert all(c["max_abs_diff"] == 0 for c in result["checks"])
    assert result["passed"]
    buffers = {b["buffer_idx"] for b in result["buckets"]}
    assert len(buffers) == 3  # Muon, AdamW, AdamW without weight decay
    assert sum(b["buffer_idx"] == 0 for b in result["buckets"]) > 1  # several Muon buckets


def test_uneven_grid_pads_and_straddles(run_grid):
    result = grid_run(run_grid, 3, 2)
    assert any(b["numel"] > b["used"] for b in result["buckets"])  # padding exists
    metas = layout_metas(3, 2, BUCKET)
    straddling = [n for n in metas[0] if sum(metas[r][n].local_numel > 0 for r in range(3)) > 1]
    assert straddling  # some parameter is split between DP ranks


def test_the_run_actually_changes_the_parameters():
    # Guards against a comparison that passes because nothing moved.
    cfg = muon_tools.RunConfig(dp=1, tp=1, steps=1)
    specs = distributed_muon_cpu.transformer_specs()
    before = distributed_muon_cpu.initial_params(specs, cfg.seed)
    after = muon_tools.reference_params(specs, cfg)
    assert all(not after[s.name].equal(before[s.name]) for s in specs)


def test_comparison_detects_a_single_flipped_bit():
    """check_against_torch, rank 0's check in the lesson's run_rank, on two TP ranks' pieces of torch's result."""
    specs = distributed_muon_cpu.transformer_specs()[:3]
    reference = distributed_muon_cpu.initial_params(specs, 0)
    start = {n: t - 1 for n, t in reference.items()}  # torch moved every entry by 1
    ranks = [dict(rank=r, params={s.name: distributed_muon_cpu.tp_shard(reference[s.name], s.tp_split_dim, r, 2).clone() for s in specs})
             for r in range(2)]
    assert all(c["identical"] and c["max_abs_diff"] == 0 and c["max_abs_update"] == 1
               for c in distributed_muon_cpu.check_against_torch(specs, ranks, reference, 2, start))
    flat = ranks[1]["params"]["layers.0.attn.qkv.weight"].view(-1)
    flat[5] = flat[5].nextafter(flat[5] + 1)  # one ulp
    rows = {c["name"]: c for c in distributed_muon_cpu.check_against_torch(specs, ranks, reference, 2, start)}
    assert not rows["layers.0.attn.qkv.weight"]["identical"] and rows["layers.0.attn.qkv.weight"]["max_abs_diff"] > 0
    assert rows["embed.weight"]["identical"]


# --- accounting --------------------------------------------------------------

def expected_per_rank(specs, dp, tp, buckets):
    """Bytes each rank sends per phase and its Newton-Schulz FLOPs, from sizes alone."""
    metas = layout_metas(dp, tp, BUCKET)
    spec = {s.name: s for s in specs}
    out = []
    for rank in range(dp * tp):
        dp_rank = rank // tp
        rs = sum((dp - 1) * (b["numel"] // dp) * 4 for b in buckets)
        dp_gather = sum((dp - 1) * (b["numel"] // dp) * 2 for b in buckets if b["buffer_idx"] == 0)
        touched = [n for n, m in metas[dp_rank].items() if spec[n].group == "muon" and m.local_numel]
        tp_gather = sum((tp - 1) * math.prod(metas[dp_rank][n].shape) * 2
                        for n in touched if spec[n].tp_split_dim >= 0)
        flops = sum(distributed_muon_cpu.newton_schulz_flops(spec[n].global_shape) for n in touched)
        out.append(({"grad presence": presence_bytes(len(specs), dp * tp), "grad reduce-scatter": rs,
                     "DP gather": dp_gather, "TP gather": tp_gather, "param all-gather": rs}, flops))
    return out


@pytest.mark.parametrize("dp,tp", GRIDS)
def test_bytes_and_flops_match_sizes(run_grid, dp, tp):
    result = grid_run(run_grid, dp, tp)
    specs = suite_specs()
    expected = expected_per_rank(specs, dp, tp, result["buckets"])
    assert result["bytes_same_every_step"]
    for phase, row in result["bytes_per_step"].items():
        assert row["sent"] == [e[0][phase] for e in expected], phase
        assert row["received"] == row["sent"]  # ring count: symmetric
    assert result["ns_flops"]["per_rank"] == [e[1] for e in expected]
    single = sum(distributed_muon_cpu.newton_schulz_flops(s.global_shape) for s in specs if s.group == "muon")
    assert result["ns_flops"]["single_device"] == single
    assert result["ns_flops"]["redundancy"] == pytest.approx(sum(e[1] for e in expected) / single, rel=1e-12)


def test_known_redundancies(run_grid):
    assert grid_run(run_grid, 1, 1)["ns_flops"]["redundancy"] == 1.0  # one device, each matrix once
    assert grid_run(run_grid, 1, 8)["ns_flops"]["redundancy"] == 8.0  # every TP rank does every matrix
    redundancy = grid_run(run_grid, 4, 2)["ns_flops"]["redundancy"]
    assert 2.0 < redundancy < 8.0  # TP x (DP shards a matrix touches): above TP, below DP x TP


def test_no_bytes_on_one_rank(run_grid):
    table = grid_run(run_grid, 1, 1)["bytes_per_step"]
    assert all(sum(row["sent"]) == 0 for row in table.values())
    assert sum(grid_run(run_grid, 8, 1)["bytes_per_step"]["TP gather"]["sent"]) == 0


def test_runs_spawned_together_are_what_the_commands_launcher_returns():
    """The suite spawns the runs of one world size together (conftest.run_together); the command's launcher,
    muon_tools.run, spawns each alone. Two runs in one spawn: the second is muon_tools.run's, clocks aside."""
    first, second = (grid_config(dp, tp, strategy=s) for dp, tp, s in ((2, 1, "gather"), (1, 2, "owner")))
    together = run_together([first, second])[second]
    alone = muon_tools.run(second, print_fn=lambda *a, **k: None)
    assert together.keys() == alone.keys() and together["passed"]
    assert {k: v for k, v in together.items() if k != "timings"} == {k: v for k, v in alone.items() if k != "timings"}
    assert len(together["timings"]["step_ms_slowest_rank"]) == len(alone["timings"]["step_ms_slowest_rank"]) == 2
