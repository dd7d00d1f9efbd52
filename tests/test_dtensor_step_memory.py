"""What DTensorMuon's step holds at once, group by group (exchange_bytes): its elementwise stages chunk by chunk (bit
for bit the lesson's on the whole shard), and one step of benchmarks/at_scale.py's model on 2 ranks holding at most
two of its bf16 matrices beside the state (tests/step_memory.py counts them; notes/measured/dtensor_groups_2core.md
has the arithmetic and the RSS at 268 M).
"""

import pytest
import torch

import os
import sys

from conftest import ROOT
import distributed_muon_cpu
import muon_tools

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from distmuon.dtensor.optimizer import CHUNK, CHUNKS, apply_update_, bf16_update, packed, unpacked  # noqa: E402
from step_memory import StepMemoryRun, at_scale_rank  # noqa: E402

D = 1024  # at_scale.py's blocks d x 4d and 4d x d: one matrix in bf16 is 1/16 of a rank's float32 parameters on 2
SIZES = [1, 1000, CHUNK, 3 * CHUNK + 37, CHUNKS * CHUNK + 5]  # the last: chunks of 2 CHUNK


@pytest.fixture(autouse=True)
def one_thread():
    """As every rank runs (bf16 and elementwise bits may depend on how the threads cut a tensor)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_update_chunk_by_chunk_is_the_lessons_on_the_whole_shard(numel, dtype, nesterov):
    g = torch.Generator().manual_seed(numel)
    grad, buffer = (torch.randn(numel, generator=g).to(dtype) for _ in range(2))
    group = dict(momentum=0.95, nesterov=nesterov)
    whole_buffer, chunked_buffer = buffer.clone(), buffer.clone()
    whole = distributed_muon_cpu.muon_update(whole_buffer, grad, group)
    chunked = bf16_update(chunked_buffer, grad, group)
    assert chunked.dtype == torch.bfloat16 and torch.equal(chunked, whole)
    assert torch.equal(chunked_buffer, whole_buffer) and not torch.equal(chunked_buffer, buffer)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("blocks", [False, True])
def test_the_update_applied_chunk_by_chunk_is_the_lessons_on_the_whole_shard(numel, dtype, blocks):
    g = torch.Generator().manual_seed(numel + 1)
    param, ortho = torch.randn(numel, generator=g).to(dtype), torch.randn(numel, generator=g).bfloat16()
    group = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn=None)
    cols = 7
    # runs of rows of two block heights across the chunk's ends (3b's runs): each adjusted for its own shape
    runs = [(a, min(a + 3 * 128 * cols, numel), 128 if a % 2 else 64)
            for a in range(0, numel, 3 * 128 * cols)] if blocks else None
    whole, chunked = param.clone(), param.clone()
    distributed_muon_cpu.apply_muon_update_(whole, ortho, group, (numel // cols or 1, cols), runs)
    apply_update_(chunked, ortho, group, (numel // cols or 1, cols), runs)
    assert torch.equal(chunked, whole) and not torch.equal(chunked, param)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96), (37, 1031), (1031, 37), (1, 50), (50, 1)])
@pytest.mark.parametrize("coefficients, steps", [(distributed_muon_cpu.NS_COEFFICIENTS, 5),
                                                 (distributed_muon_cpu.NS_COEFFICIENTS, 0), ("polar_express", 8)])
def test_newton_schulz_over_its_input_is_the_lessons_in_two_matrices(seed, shape, coefficients, steps):
    """exchange.newton_schulz_overwriting: the lesson's newton_schulz bit for bit (hence torch's), its result in the
    storage of its input or of the one matrix it makes (odd and even iteration counts, tall and wide)."""
    from distmuon.checks import ns_coefficients_of
    from distmuon.dtensor.exchange import newton_schulz_overwriting

    coefficients = ns_coefficients_of(coefficients, steps)
    matrix = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2.0**-3).bfloat16()
    expected = distributed_muon_cpu.newton_schulz(matrix, steps, coefficients, distributed_muon_cpu.NS_EPS)
    given = matrix.clone()
    got = newton_schulz_overwriting(given, steps, coefficients, distributed_muon_cpu.NS_EPS)
    assert torch.equal(got, expected) and got.stride() == expected.stride()
    in_input = got.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
    assert in_input == (steps % 2 == 0) and not torch.equal(given, matrix)  # even: back in the input, which it wrote


# The most a grouped step holds by design, in bf16 matrices (d x 4d), groups of one matrix. Without Newton-Schulz:
# FSDP2's Shard(0) pieces are row blocks, views of the owner's matrix M: M and half of it (this rank's own update
# while it is written into M, then the part received); TP's Shard(1) pieces are column blocks of M, each a strided
# view copied once, into the send buffer (the other half) or, after the wait, into this rank's update (its own
# half): M and half of it too. With Newton-Schulz, its floor: M, which it writes over, one more matrix, and the Gram
# matrix or its polynomial beside the next (each d x d, a quarter of M).
BY_DESIGN = {(2, 1, False): 1.5, (1, 2, False): 1.5, (2, 1, True): 2.5, (1, 2, True): 2.5}


@pytest.mark.parametrize("dp, tp, ns", list(BY_DESIGN))
def test_a_grouped_step_holds_what_its_design_says(dp, tp, ns):
    """Every buffer the step makes, alive at once: at most BY_DESIGN and what Gloo may still hold just after a wait
    returned (a send buffer, half a matrix; under load, part of another: 0.75 allowed); the RSS (glibc handing freed
    buffers back at once) at most 1.25 matrices more than BY_DESIGN (that, the chunks' temporaries, the process's
    own). One matrix is 1/16 of a rank's float32 parameters here, so 1.5 is 9.4 %. Before: 2.5 (2 x 1) and 3.5
    (1 x 2) counted, 3.4 and 3.9 in RSS (a group's bf16 updates and exchange buffers kept into the next group's,
    nesterov's float32 temporary and the mixed-dtype add_'s float32 copy); then 2.0 on 1 x 2 (both column blocks
    copied out of M, then the send buffer made from one of them). With Newton-Schulz the RSS may hold 0.75 more (the
    bf16 matmuls' own workspace, unseen by the count: RSS 1.5 to 1.7 over it, measured); before: 3.5 counted, 5.0 in
    RSS (the lesson's newton_schulz keeps its input beside both iterates), now 2.5 and 4.1 to 4.2."""
    matrix = 4 * D * D * 2
    ranks = muon_tools.spawn_ranks(StepMemoryRun(dp=dp, tp=tp, d=D, exchange_bytes=2**20, without_ns=not ns),
                                   at_scale_rank)
    for r in ranks:
        assert r["params"] == 16 * matrix and r["moved"] == r["count"]  # every parameter stepped
        assert r["peak"] <= (BY_DESIGN[dp, tp, ns] + 0.75) * matrix, (r["rank"], r["peak"] / matrix, r["at_peak"])
        assert r["rss_peak"] <= (BY_DESIGN[dp, tp, ns] + 1.25 + 0.75 * ns) * matrix, (r["rank"], r["rss_peak"] / matrix)
    assert max(r["peak"] for r in ranks) >= BY_DESIGN[dp, tp, ns] * matrix  # what the design holds: the count sees it
    # construction: every rank describes the same 16 parameters, so one all_gather_object of a digest, a few bytes
    assert all(r["gathered"] == ranks[0]["gathered"] and len(r["gathered"]) == 1 and r["gathered"][0] < 200
               for r in ranks), [r["gathered"] for r in ranks]


def test_what_a_rank_sends_at_construction_grows_with_its_parameters_not_with_the_world():
    """The swap of descriptions' message (DescriptionSwap) where the ranks' Copies differ: each mesh's ranks once, not once per parameter
    (16,384 ranks, 500 parameters: under 0.3 MB, where the Copies as describe() makes them, a tuple of ranks each,
    pickle to tens of MB); packed then unpacked, the same Copies."""
    import pickle

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from distmuon.dtensor.plan import Copy

    world = 2**14
    copies = [Copy(f"{i}.w", i % 2, (4096, 1024), tuple(range(world)), (world // 8, 8),
                   (_StridedShard(0, split_factor=8), Shard(i % 2)), False, ("dp", "tp")) for i in range(500)]
    copies.append(Copy("bias", 1, (7,), (), (), (), False))
    message = packed(copies)
    assert unpacked(*message) == copies
    assert len(pickle.dumps(message)) < 300_000 and len(pickle.dumps(copies)) > 100 * len(pickle.dumps(message))
