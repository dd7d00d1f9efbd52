# ---
# jupyter:
#   jupytext:
#     formats: ipynb,.nb.py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Distributed Muon: grids, strategies and a real GPT
#
# The second notebook of `distributed_muon_cpu.py`. The first, `distributed_muon_cpu.ipynb`, follows
# the script section by section and runs the flow in one process; this one runs the script as a
# user would: every grid of 8 ranks, the strategies side by side, a tensor-parallel GPT trained
# with the optimizer on real text, and a mixture-of-experts GPT under expert parallelism. Every run is
# checked against torch.optim.Muon / AdamW.

# %% [markdown]
# ## 0. Setup
#
# As in the first notebook: in Colab, set `%env DISTRIBUTED_MUON_REPOSITORY=<url>` first.

# %%
import json
import os
import subprocess
import sys

if not os.path.exists("distributed_muon_cpu.py"):  # Colab: clone the repository (once), work in the clone
    if not os.path.exists("distributed-muon"):
        url = os.environ.get("DISTRIBUTED_MUON_REPOSITORY")
        if not url:
            raise SystemExit("Set %env DISTRIBUTED_MUON_REPOSITORY=<this repository's git URL> first, "
                             "or upload the repository's files beside this notebook.")
        subprocess.run(["git", "clone", "--depth", "1", url, "distributed-muon"], check=True)
    os.chdir("distributed-muon")
import muon_tools  # noqa: E402

muon_tools.notebook_requirements()
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

os.makedirs("runs", exist_ok=True)
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPU cores")  # what made the outputs below

# %% [markdown]
# ## 1. Grids: the bytes and the repeated work of each DP × TP
#
# In the gather flow every TP peer orthogonalizes the same full matrix, and so does every DP rank
# whose shard touches it: the redundancy is TP × (the number of DP shards a matrix touches,
# FLOP-weighted). The grid changes how the cost is split between DP and TP traffic and how much
# work is repeated. The next cell runs every grid of 8 ranks, one step each.

# %%
grids = [(8, 1), (4, 2), (2, 4), (1, 8)]
sweep = {}  # bytes and FLOPs are the same every step: one step per grid serves
for dp, tp in grids:
    muon_tools.run_program("distributed_muon_cpu.py", "--dp", str(dp), "--tp", str(tp), "--steps", "1",
                   "--json", f"runs/notebook_{dp}x{tp}.json")
    with open(f"runs/notebook_{dp}x{tp}.json") as f:
        sweep[(dp, tp)] = json.load(f)
phases = list(sweep[(4, 2)]["bytes_per_step"])

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
labels = [f"{dp}×{tp}" for dp, tp in grids]
bottom = [0.0] * len(grids)
for p in phases:
    heights = [max(sweep[g]["bytes_per_step"][p]["sent"]) / 1024 for g in grids]
    left.bar(labels, heights, bottom=bottom, label=p)
    bottom = [b + h for b, h in zip(bottom, heights)]
left.set_xlabel("DP × TP")
left.set_ylabel("KiB sent per step (most loaded rank)")
left.set_title("Bytes by phase across grids")
left.legend(fontsize=8)
right.bar(labels, [sweep[g]["ns_flops"]["redundancy"] for g in grids], color="tab:orange")
right.axhline(8, color="black", linestyle="--", label="DP × TP")
right.set_xlabel("DP × TP")
right.set_ylabel("redundancy")
right.set_title("Newton–Schulz redundancy across grids")
right.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 2. The strategies side by side
#
# `benchmarks/compare.py` runs gather, owner, comm-free and the AdamW ZeRO-1 baseline on the same
# grid, checks each against torch, and prints one table.

# %%
muon_tools.run_program("benchmarks/compare.py", "--steps", "2", "--json", "runs/notebook_compare.json")
with open("runs/notebook_compare.json") as f:
    compared = json.load(f)["runs"]

# %%
strategies = list(compared)
all_phases = list(dict.fromkeys(p for r in compared.values() for p in r["bytes_per_step"]))
labels = ["AdamW ZeRO-1" if s == "baseline" else s for s in strategies]
fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 5))
bottom = [0.0] * len(strategies)
for p in all_phases:
    heights = [sum(compared[s]["bytes_per_step"].get(p, {"sent": [0]})["sent"]) / 2**20 for s in strategies]
    left.bar(labels, heights, bottom=bottom, label=p)
    bottom = [b + h for b, h in zip(bottom, heights)]
left.set_ylabel("MiB sent per step, all ranks")
left.set_title("Bytes by phase")
left.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.08))
muon = [s for s in strategies if compared[s]["ns_flops"]["single_device"]]
for i, s in enumerate(muon):
    per_rank = compared[s]["ns_flops"]["per_rank"]
    middle.bar([r + i * 0.25 for r in range(len(per_rank))], [f / 1e9 for f in per_rank], width=0.25,
               label=f"{s}: redundancy {compared[s]['ns_flops']['redundancy']:.2f}")
middle.set_xlabel("rank")
middle.set_ylabel("GFLOP per step")
middle.set_title("Newton–Schulz FLOPs per rank")
middle.set_ylim(0, 1.4 * max(max(compared[s]["ns_flops"]["per_rank"]) for s in muon) / 1e9)  # room for the legend
middle.legend(fontsize=8)
right.bar(labels, [compared[s]["timings"]["step_ms_median"] for s in strategies], color="tab:green")
right.set_ylabel("ms (median step, slowest rank)")
right.set_title("Step time on this machine (Gloo)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Owner and comm-free orthogonalize each matrix once (redundancy 1.00). With the default two
# layers there are 10 matrices for 8 ranks, four of them the largest, so the work cannot be spread
# evenly (`--layers 8` balances it). The step times are from Gloo on a shared CPU;
# `benchmarks/gloo_collectives.py` measures each collective for the same bytes.

# %% [markdown]
# ## 3. Train for real: a tensor-parallel GPT on real text
#
# Everything above fed the optimizer synthetic gradients. `examples/train_gpt.py` trains a small
# GPT (`examples/gpt.py`) on the Python standard library's own source files (bytes as tokens, no
# download: every Python has them), made tensor-parallel the Megatron way: column-parallel QKV
# and MLP-in, row-parallel attention-out and MLP-out, and the two conjugate functions *f* and *g*
# that all-reduce over the TP group. Its hidden matrices go to the same `OwnerMuon` as above, its
# embeddings, norms and biases to AdamW. Below: 20 steps on DP=2 x TP=2.

# %%
muon_tools.run_program("examples/train_gpt.py", "--dp", "2", "--tp", "2", "--steps", "20", "--log-every", "5",
            "--json", "runs/gpt_muon.json")
with open("runs/gpt_muon.json") as f:
    run = json.load(f)
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(range(1, len(run["losses"]) + 1), run["losses"], alpha=0.5, label="train (mean over DP ranks)")
ax.plot(*zip(*run["val"]), "o-", label="validation")
ax.set_xlabel("step")
ax.set_ylabel("loss (nats per byte)")
ax.set_title("Muon (hidden matrices) + AdamW, DP=2 x TP=2")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Muon against AdamW on this task, each at the best of four learning rates with the same tokens,
# is a longer measurement (`python benchmarks/gpt_lr_sweep.py`, about 4 minutes on 2 cores): there
# Muon reached AdamW's best validation loss in 3.3x fewer steps (`notes/11-training.md`).

# %% [markdown]
# Is the distributed training the training one process would do? `--verify` trains the same GPT in
# this process with `torch.optim.Muon` and `torch.optim.AdamW` on the same micro-batches, and
# compares three ways: the ranks' own gradients replayed through torch's optimizers (bit for bit:
# the optimizer is exact), each step's loss and gradients at the ranks' weights (bit for bit too:
# the ranks' TP all-reduces add their partial sums in rank order, and this process adds TP's pieces
# in the same order), and the two free-running trainings. `notes/11-training.md` explains why.

# %%
muon_tools.run_program("examples/train_gpt.py", "--dp", "2", "--tp", "2", "--steps", "3", "--verify")

# %% [markdown]
# ## 4. Experts: a mixture-of-experts GPT under expert parallelism
#
# `examples/train_gpt_moe.py` trains the same GPT with each block's MLP replaced by routed experts
# (`examples/gpt_moe.py`): a router sends each token to its top-2 of E experts, one `all_to_all_single`
# with uneven splits carries it to the rank holding that expert (expert parallelism, EP, over a mesh
# dimension of its own, borrowed from DP), and one more brings the result back. Attention is TP,
# everything is FSDP2, and `DTensorMuon` orthogonalizes each expert of the 3-D stacks as its own matrix,
# once in the world. Below: DP 2 (both of them EP ranks) × TP 2 with 3 experts, so one EP rank holds two
# and the other one. `--verify` checks the run as the FSDP2 GPT's (the replay bit for bit) and every
# routing decision against one process. The picture is the run's ledger: what MoE adds to the optimizer.

# %%
from IPython.display import Image  # noqa: E402

muon_tools.run_program("examples/train_gpt_moe.py", "--dp", "2", "--ep", "2", "--tp", "2", "--experts", "3", "--steps",
                       "6",
               "--log-every", "3", "--layers", "2", "--d-model", "32", "--expert-hidden", "64", "--context", "64",
               "--batch", "8", "--verify", "--figure", "runs/notebook_moe.png")
Image("runs/notebook_moe.png")

# %% [markdown]
# Left: the experts are most of the Newton–Schulz work, and an expert is orthogonalized by a rank that
# holds it, so the EP rank with two experts does twice the other's. Middle: the expert matrices' share
# of the optimizer's exchange: an expert's owner sends its orthogonalized update to the other ranks that
# hold it (here its TP replica; with more DP ranks than EP ranks, FSDP2 also cuts each expert, and the
# owner first gathers its pieces). Right: without a capacity cut, the EP rank with more experts takes
# more rows. `notes/13-moe.md` has the default run on 8 ranks and what each figure means.

# %% [markdown]
# Where to go next: `benchmarks/` measures the strategies (`compare.py`), the grids and bucket sizes
# (`sweep.py`), Gloo's collectives, overlap and batched Newton–Schulz; `notes/README.md` orders the
# chapters that explain each idea with its measured figures. On GPUs the same algorithm runs under
# `torchrun` with NCCL: `torchrun --standalone --nproc-per-node 8 distributed_muon.py --dp 4 --tp 2`.
