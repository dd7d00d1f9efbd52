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

Its demo is a command of its own, dtensor_demo.py (`python dtensor_demo.py`: 8 Gloo ranks, a 4 x 2 mesh,
PASS/FAIL; its docstring has the launch recipes, torchrun's among them). This package is the optimizer alone,
part of the library: it has no command, and imports nothing that runs it.

The optimizer alone, in your own training script (every rank, after init_process_group; the README's
"DTensorMuon in your FSDP2 x TP training loop" is a whole one, checkpoints included, run by a test):

    from distmuon import DTensorMuon
    opt = DTensorMuon([dict(params=matrices, algorithm="muon"),      # [(name, param)], DTensor or not
                       dict(params=others, algorithm="adamw")],
                      expert_stacks={"layers.0.moe.w1"}, lr=0.02)
    loss.backward(); opt.step()

A real training with it: examples/train_gpt_dtensor.py (the GPT of examples/, fully_shard x
parallelize_module, --verify against one process, --save / --resume across meshes).

Under torchrun each process is one rank of the same demo (dtensor_demo.py, section 9): NCCL and
cuda:LOCAL_RANK where a GPU exists (the defaults), Gloo and the CPU with
--backend gloo --device cpu; the world size must be --dp x --tp. Rank 0 gathers
every rank's results, runs torch's reference on its own device (bitwise
agreement needs the same kind of device: cuBLAS's bf16 sums are not the CPU's;
see the lesson's notes/06-gpus.md), compares on the CPU and prints the same
report and PASS/FAIL. Only the Gloo/CPU form was run here: this machine has no
GPU, so NCCL and CUDA were NOT run, and nothing here shows that they work.

Reading order (each section opens with what it does and why), one file each:
    1. What is reused from the lesson: the math, the parameter checks, the owners, the exchanges (all of them)
    2. Placements: where each element lives (one range per tensor dim), what replaces dist_meta (placements.py)
    3. The plan: matrices, their holders and owners, the transfers (plan.py)
       3b. Rows of a laid-out matrix: fused blocks and QK-clip, on any local piece (rows.py)
       3c. Newton-Schulz on TP pieces, without gathering the matrix, tp_newton_schulz="gram" (plan.py)
    4. The configuration: automatic from placements, or your own callables (config.py)
    5. The optimizer (optimizer.py: DTensorMuon, a torch.optim.Optimizer) and its strategy, the lesson's owner
       strategy on placements (exchange.py)
    6. Checkpoints through torch.distributed.checkpoint, across meshes (checkpoint.py)
What runs it lives beside it, in dtensor_demo.py, and continues the numbering (`python dtensor_demo.py`
runs it):
    7. The demo model (FSDP2 x TP x a MoE expert stack), a run, and its verification
       (exact gradients bit for bit; a real training run replayed bit for bit, and within fp32 bounds)
    8. Accounting, beside the lesson's strategies; FSDP2's and TP's own bytes, measured
    9. Main: the command line (spawned Gloo ranks, or one rank per torchrun process)
"""

from distmuon.dtensor.checkpoint import checkpoint_state, load_checkpoint, save_checkpoint
from distmuon.dtensor.config import DistributedConfig
from distmuon.dtensor.optimizer import DTensorMuon
from distmuon.dtensor.placements import like_param, local_indices, local_of

__all__ = ["DTensorMuon", "DistributedConfig", "checkpoint_state", "save_checkpoint", "load_checkpoint", "local_of",
           "like_param", "local_indices"]
