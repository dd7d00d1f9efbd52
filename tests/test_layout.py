"""Section 3 of the script: the virtual buffer and dist_meta."""

import math
import random

import pytest

import distributed_muon_cpu
import muon_tools


def plan(numels, dp, bucket_size, groups=1):
    """Split numbered 1-D parameters into `groups` buffers and plan them as the optimizer does."""
    names = [f"p{i}" for i in range(len(numels))]
    buffers = [[n for j, n in enumerate(names) if j % groups == g] for g in range(groups)]
    shapes = {n: (k,) for n, k in zip(names, numels)}
    return distributed_muon_cpu.plan_layout([b for b in buffers if b], shapes, {n: -1 for n in names}, dp, 1,
                                            bucket_size)


def layout(numels, dp, bucket_size, groups=1):
    """(buckets, bucket ranges, every DP rank's metas, {name: numel}) of plan()."""
    planned = plan(numels, dp, bucket_size, groups)
    return planned.buckets, planned.bucket_ranges, planned.metas, {n: s[0] for n, s in planned.shapes.items()}


def check_invariants(numels, dp, bucket_size, groups):
    buckets, ranges, metas, numel_of = layout(numels, dp, bucket_size, groups)
    assert sorted(n for b in buckets for n in b.names) == sorted(numel_of)  # every parameter in one bucket
    for b in buckets:
        assert b.numel % dp == 0 and 0 <= b.numel - b.used < dp  # padded to DP, by less than DP
        assert b.used == sum(numel_of[n] for n in b.names)
        assert b.used <= bucket_size or len(b.names) == 1  # only a lone oversized parameter exceeds it
        cursor = 0
        for n in b.names:  # parameters tile the bucket in order, without gaps
            assert ranges[n] == (cursor, cursor + numel_of[n])
            cursor += numel_of[n]
        owner = [None] * b.numel  # every element of every parameter owned by exactly one DP rank
        for r in range(dp):
            lo, hi = b.shard_range(r, dp)
            for n in b.names:
                m = metas[r][n]
                assert (m.buffer_idx, m.bucket_idx) == (b.buffer_idx, b.bucket_idx)
                assert m.bucket_range[0] <= m.local_range[0] <= m.local_range[1] <= m.bucket_range[1]
                assert lo <= m.local_range[0] or m.local_numel == 0
                assert m.local_range[1] <= hi or m.local_numel == 0
                assert m.param_slice.stop - m.param_slice.start == m.local_numel
                if m.local_numel:  # the same range, inside this rank's shard
                    assert 0 <= m.shard_slice.start < m.shard_slice.stop <= hi - lo
                    assert m.shard_slice.start + lo == m.local_range[0]
                for i in range(*m.local_range):
                    assert owner[i] is None
                    owner[i] = r
        assert all(owner[i] is not None for i in range(b.used))
    # buckets of one buffer are numbered 0, 1, ...
    for g in {b.buffer_idx for b in buckets}:
        numbers = [b.bucket_idx for b in buckets if b.buffer_idx == g]
        assert numbers == list(range(len(numbers)))


@pytest.mark.parametrize("seed", range(40))
def test_invariants_over_random_layouts(seed):
    rng = random.Random(seed)
    numels = [rng.choice([1, 2, 3, 7, 64, 100, 127, 1000, 4096, 12345]) for _ in range(rng.randint(1, 12))]
    check_invariants(numels, dp=rng.randint(1, 8), bucket_size=rng.choice([1, 5, 64, 1000, 5000, 10**6]),
                     groups=rng.randint(1, 3))


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_invariants_on_the_prior_art_shapes(dp):
    # The Moonshot PoC's unit-test shapes (100,100), (124,324), (456,124), (676,876), (128,128).
    numels = [100 * 100, 124 * 324, 456 * 124, 676 * 876, 128 * 128]
    for bucket_size in (1, 20_000, 100_000, 10**7):
        check_invariants(numels, dp, bucket_size, groups=2)


def test_a_layout_worked_by_hand():
    # sizes 10, 7, 5 in one bucket on DP 4: used 22, padded to 24, shards of 6
    #   p0 [0,10): DP0 [0,6) DP1 [6,10)   p1 [10,17): DP1 [10,12) DP2 [12,17)   p2 [17,22): DP2 [17,18) DP3 [18,22)
    buckets, ranges, metas, _ = layout([10, 7, 5], dp=4, bucket_size=100)
    assert [(b.used, b.numel) for b in buckets] == [(22, 24)]
    assert ranges == {"p0": (0, 10), "p1": (10, 17), "p2": (17, 22)}
    local = {(r, n): metas[r][n].local_range for r in range(4) for n in ("p0", "p1", "p2")}
    assert local == {(0, "p0"): (0, 6), (0, "p1"): (10, 10), (0, "p2"): (17, 17),
                     (1, "p0"): (6, 10), (1, "p1"): (10, 12), (1, "p2"): (17, 17),
                     (2, "p0"): (10, 10), (2, "p1"): (12, 17), (2, "p2"): (17, 18),
                     (3, "p0"): (10, 10), (3, "p1"): (17, 17), (3, "p2"): (18, 22)}
    assert metas[2]["p1"].param_slice == slice(2, 7)


def test_bucket_size_closes_buckets_and_oversized_parameters_stand_alone():
    buckets, _, _, _ = layout([10, 7, 30, 5], dp=2, bucket_size=17)
    assert [b.names for b in buckets] == [("p0", "p1"), ("p2",), ("p3",)]
    assert [b.numel for b in buckets] == [18, 30, 6]


def test_transformer_tp_shapes():
    specs = {s.name: s for s in distributed_muon_cpu.transformer_specs()}
    d_model = distributed_muon_cpu.D_MODEL
    assert muon_tools.tp_local_shape(specs["layers.0.attn.qkv.weight"], 4) == (3 * d_model // 4, d_model)
    assert muon_tools.tp_local_shape(specs["layers.0.mlp.fc2.weight"], 4) == (distributed_muon_cpu.D_MODEL, distributed_muon_cpu.D_MODEL)
    assert muon_tools.tp_local_shape(specs["layers.0.router.weight"], 4) == (distributed_muon_cpu.N_EXPERTS, distributed_muon_cpu.D_MODEL)
    for s in specs.values():
        assert distributed_muon_cpu.global_shape_of(muon_tools.tp_local_shape(s, 2), s.tp_split_dim,
                                                    2) == s.global_shape
    assert math.prod(specs["logit_scale"].global_shape) == 1


def test_explain_map_names_owners_and_padding():
    text = muon_tools.format_buffer_map(plan([3, 2], dp=4, bucket_size=100))  # used 5, padded to 8, shards of 2
    lines = text.splitlines()
    assert lines[0] == "bucket (0, 0): 5 elements + 3 padding = 8; DP shard = 2 elements"
    assert lines[1].split()[-2:] == ["DP0[0:2]", "DP1[2:3]"]
    assert lines[2].split()[-2:] == ["DP1[0:1]", "DP2[1:2]"]
    assert lines[3].startswith("    (padding)") and lines[3].split()[-2:] == ["DP2", "DP3"]
