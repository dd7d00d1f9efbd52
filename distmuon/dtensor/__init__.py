"""Distributed Muon for DTensor parameters: FSDP2 x tensor parallel on a 2-D DeviceMesh, MoE expert stacks.

The lesson script, distributed_muon_cpu.py, describes where every piece of every
matrix lives with its own bookkeeping: a grid of process groups, a virtual
buffer cut into buckets, and one `dist_meta` per parameter and rank. PyTorch's
own parallelism already carries that information on every parameter: with
FSDP2 (`fully_shard`) and DTensor tensor parallelism (`parallelize_module`) a
parameter IS a DTensor, and its device mesh and placements say exactly which
rank holds which elements. This package is the lesson's owner strategy rebuilt
on that description:

    local shards --momentum / AdamW (elementwise, on the shard)--> update shards (bf16)
    update shards --gather at owner (ONE all_to_all_single)------> full matrix, on its owner only
    full matrix   --Newton-Schulz (torch's 2-D ops)--------------> orthogonal matrix
    orthogonal    --scatter from owner (ONE all_to_all_single)---> every holder's shard of it

Each Muon matrix is orthogonalized exactly once, by an owner chosen among the
ranks that hold it, balanced by Newton-Schulz FLOPs (the lesson's
longest-processing-time assignment, restricted to each matrix's holders).
Everything is checked, bit for bit (torch.equal), against PyTorch's
single-device torch.optim.Muon and torch.optim.AdamW fed the same total
gradient; with --batched-ns the Muon matrices are held to the lesson's derived
bound instead (the runner's batched_ns_tolerance), everything else still bit for bit.

The optimizer in your own training script (every rank, after init_process_group; notes/10-dtensor.md, "Use it in
your FSDP2 x TP training loop", has whole ones, checkpoints included, each run by a test):

    from distmuon import DTensorMuon
    opt = DTensorMuon([dict(params=matrices, algorithm="muon"),      # [(name, param)], DTensor or not
                       dict(params=others, algorithm="adamw")],
                      expert_stacks={"layers.0.moe.w1"}, lr=0.02)
    loss.backward(); opt.step()

This package is the optimizer alone: it has no command and imports nothing that runs it. Its demo is
`python dtensor_demo.py` (8 Gloo ranks, a 4 x 2 mesh, PASS/FAIL; under torchrun, one rank a process); a real
training, examples/train_gpt_dtensor.py.

Reading order (each section opens with what it does and why), one file each:
    1. What is reused from the lesson: the math, the parameter checks, the owners, the exchanges (all of them)
    2. Placements: where each element lives (one range per tensor dim), what replaces dist_meta (placements.py)
    3. The plan: matrices, their holders and owners, the transfers (plan.py)
       3b. Rows of a laid-out matrix: fused blocks and QK-clip, on any local piece (rows.py)
       3c. Newton-Schulz on TP pieces, without gathering the matrix, tp_newton_schulz="gram" (plan.py; its step:
           rows.py)
    4. The configuration: automatic from placements, or your own callables (config.py; your own callables'
       strategy: explicit.py)
    5. The optimizer (optimizer.py: DTensorMuon, a torch.optim.Optimizer) and its parts: its strategy, the lesson's
       owner strategy on placements (exchange.py), and NorMuon's rows beside it (normuon.py)
    6. Checkpoints through torch.distributed.checkpoint, across meshes (checkpoint.py)
"""

from distmuon.dtensor.checkpoint import checkpoint_state, load_checkpoint, save_checkpoint
from distmuon.dtensor.config import DistributedConfig
from distmuon.dtensor.optimizer import DTensorMuon
from distmuon.dtensor.placements import like_param, local_indices, local_of

__all__ = ["DTensorMuon", "DistributedConfig", "checkpoint_state", "save_checkpoint", "load_checkpoint", "local_of",
           "like_param", "local_indices"]
