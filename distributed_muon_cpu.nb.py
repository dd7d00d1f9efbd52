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
# # Distributed Muon on 8 CPU processes
#
# Muon orthogonalizes the momentum of every 2-D weight with Newton–Schulz, which needs the
# **whole matrix**. Distributed training never has it in one place: ZeRO-1 splits a flat buffer
# of weights across the data-parallel (DP) ranks, and tensor parallelism (TP) splits each weight
# across the TP ranks. `distributed_muon_cpu.py` puts each matrix back together, orthogonalizes
# it, and gives every rank exactly its piece:
#
#     DP gather  →  TP gather  →  Newton–Schulz  →  TP shard  →  DP shard
#
# This notebook runs that script on 8 CPU processes (DP=4 × TP=2) and plots what it measured.
# The same ideas, chapter by chapter, are in `notes/`; the code, section by section (§1 … §9), is
# in the script. Run the cells top to bottom.
#
# *In Colab:* clone the repository, `%cd` into it, then open or run this notebook from there.

# %% [markdown]
# ## 0. The environment
#
# The script needs `torch` ≥ 2.9 (the first release with `torch.optim.Muon`, the reference it is
# checked against) and this notebook needs `matplotlib`. Colab has both; anything missing is
# installed from `requirements.txt`.

# %%
import importlib.util
import json
import os
import subprocess
import sys

if not os.path.exists("distributed_muon_cpu.py"):
    raise FileNotFoundError("run this notebook from the repository folder (the one with distributed_muon_cpu.py)")


def torch_is_recent():
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return hasattr(torch.optim, "Muon")


if not torch_is_recent() or importlib.util.find_spec("matplotlib") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", "requirements.txt"], check=True)

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPU cores")

# %% [markdown]
# ## 1. Why the script runs in a subprocess
#
# The script starts one process per rank with Python's `multiprocessing`. Started from inside a
# notebook kernel, those processes must re-import the notebook's `__main__`, which a kernel does
# not have, and the launch fails or hangs. So the notebook starts the script as a separate
# Python process (`sys.executable`: the same interpreter as this kernel, not whatever `python`
# is on the PATH) and streams its output here. A non-zero exit raises, so a failed run fails
# this cell instead of passing silently.


# %%
def run_script(*args):
    """Run distributed_muon_cpu.py with `args`, print its output as it comes, raise if it fails."""
    cmd = [sys.executable, "-u", "distributed_muon_cpu.py", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="")
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


os.makedirs("runs", exist_ok=True)
run_script("--dp", "4", "--tp", "2", "--explain", "--json", "runs/notebook_4x2.json")
with open("runs/notebook_4x2.json") as f:
    run = json.load(f)

# %% [markdown]
# ## 2. The grid
#
# World = DP × TP ranks, `rank = dp_rank · TP + tp_rank` (script §2). A row of the table above is
# a TP group: contiguous ranks, as the GPUs of one node, because TP traffic is the most frequent.
# A column is a DP group: the ranks holding the same TP piece of every weight, each fed different
# data. The groups are slices of `torch.arange(world).view(DP, TP)`.
#
# ## 3. The parameters
#
# A small transformer (script §3): column-parallel matrices split on dim 0 (`qkv`, `fc1`),
# row-parallel ones split on dim 1 (`proj`, `fc2`), a router not split by TP, tall and wide shapes,
# and non-matrix parameters (embedding, head, norms, biases, a 0-dim scalar) that go to AdamW, as
# in practice. Each DP rank draws its own gradients as multiples of 2⁻¹⁰, so their float32 sum is
# exact in any order.
#
# ## 4. The virtual buffer
#
# `--explain` printed the map above (script §4): each param group is one flat virtual buffer, cut
# into buckets, each padded to a multiple of DP and split into DP equal shards. A parameter's
# range may straddle shards: each DP rank owns its `local_range` of it, possibly empty, and keeps
# optimizer state for that range only. These are the buckets of this run:

# %%
for b in run["buckets"]:
    print(f"buffer {b['buffer_idx']} bucket {b['bucket_idx']}: {len(b['names']):2d} parameters, "
          f"{b['used']:>7,} elements + {b['numel'] - b['used']} padding")

# %% [markdown]
# ## 5. The step
#
# Per bucket (script §5): gradient reduce-scatter over DP (fp32) → momentum on the local shard →
# **DP gather** (bf16, one all-gather per bucket) → **TP gather** (per matrix, along its
# `tp_split_dim`) → Newton–Schulz on the full matrix → **TP shard** → **DP shard** (slices, no
# communication) → weight decay and update on the local range → parameter all-gather over DP.
#
# ## 6. Verification
#
# The parent process runs PyTorch's own `torch.optim.Muon` and `torch.optim.AdamW` on one device,
# fed the summed gradients, and compares every rank's piece of every parameter with `torch.equal`
# (script §7). The plot puts the difference next to how far each weight moved, so that 0 is seen
# against the size of the change.

# %%
checks = run["checks"]
names = [c["name"] for c in checks]
fig, ax = plt.subplots(figsize=(11, 4))
ax.bar(range(len(checks)), [c["max_abs_update"] for c in checks], color="tab:blue", label="max |update| (3 steps)")
diffs = [c["max_abs_diff"] for c in checks]
ax.scatter([i for i, d in enumerate(diffs) if d > 0], [d for d in diffs if d > 0], color="red", zorder=3,
           label="max |Δ| vs torch (where not 0)")
ax.set_yscale("log")
ax.set_xticks(range(len(checks)), names, rotation=75, fontsize=7)
n_same = sum(c["identical"] for c in checks)
ax.set_title(f"max |Δ| against torch.optim.Muon / AdamW: {n_same}/{len(checks)} parameters bit-identical "
             f"(Δ = 0 is not drawn on a log axis)")
ax.legend(loc="lower left", framealpha=1)
plt.tight_layout()
plt.show()
assert n_same == len(checks), "some parameter differs from torch"

# %% [markdown]
# ## 7. Accounting
#
# Every collective goes through one place in the script (§2) that records the bytes each rank
# sends and receives, counted as a ring algorithm moves them (Gloo records no sizes, and Gloo's
# reduce-scatter is a full all-reduce that moves more). Newton–Schulz FLOPs are counted per call.
# The redundancy factor is the sum over ranks divided by one device doing each matrix once.

# %%
phases = list(run["bytes_per_step"])
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
for rank in range(len(run["ledgers"])):
    left.bar([i + rank * 0.1 for i in range(len(phases))],
             [run["bytes_per_step"][p]["sent"][rank] / 1024 for p in phases], width=0.1, label=f"rank {rank}")
left.set_xticks([i + 0.35 for i in range(len(phases))], phases)
left.set_ylabel("KiB sent per step")
left.set_title("Bytes per phase, per rank")
left.legend(fontsize=7, ncol=2)
flops = run["ns_flops"]
right.bar(range(len(flops["per_rank"])), [f / 1e9 for f in flops["per_rank"]], color="tab:orange")
right.axhline(flops["single_device"] / 1e9, color="black", linestyle="--", label="one device, each matrix once")
right.set_xlabel("rank")
right.set_ylabel("GFLOP per step")
right.set_title(f"Newton–Schulz FLOPs per rank: redundancy {flops['redundancy']:.2f} (DP × TP = 8 at most)")
right.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Every TP peer orthogonalizes the same full matrix, and so does every DP rank whose shard touches
# it: the redundancy is TP × (the number of DP shards a matrix touches). The grid changes how the
# cost is split between DP and TP traffic and how much work is repeated. The next cell runs every
# grid of 8 ranks (about half a minute on 2 cores).

# %%
grids = [(8, 1), (4, 2), (2, 4), (1, 8)]
sweep = {}
for dp, tp in grids:
    out = subprocess.run([sys.executable, "distributed_muon_cpu.py", "--dp", str(dp), "--tp", str(tp),
                          "--json", f"runs/notebook_{dp}x{tp}.json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stdout + out.stderr)
    print(out.stdout.strip().splitlines()[-1], f"(DP={dp} x TP={tp})")
    with open(f"runs/notebook_{dp}x{tp}.json") as f:
        sweep[(dp, tp)] = json.load(f)

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
# ## 8. One owner per matrix: the strategies
#
# The gather flow repeats Newton–Schulz on every rank that touches a matrix. Two strategies give
# each matrix one owner instead (script §6, `notes/08-strategies.md`):
#
# - **owner**: ZeRO-1 unchanged; every rank's momentum piece goes straight to the matrix's owner
#   (one all-to-all for all matrices), the owner orthogonalizes, and a second all-to-all returns
#   each rank its piece (**gather at owner** / **scatter from owner**);
# - **comm-free**: ZeRO-1 shards the matrices *whole* across DP; the gradient is reduced at the
#   owner's DP row, which keeps the full momentum and broadcasts the updated matrix. Only the TP
#   pieces still travel, inside the owner's row.
#
# `--compare` runs gather, owner, comm-free and the AdamW ZeRO-1 baseline on the same grid, checks
# each against torch, and prints one table (about 15 s on 2 cores).

# %%
run_script("--compare", "--steps", "5", "--json", "runs/notebook_compare.json")
with open("runs/notebook_compare.json") as f:
    compared = json.load(f)["runs"]

# %%
strategies = list(compared)
all_phases = list(dict.fromkeys(p for r in compared.values() for p in r["bytes_per_step"]))
labels = ["AdamW ZeRO-1" if s == "adamw" else s for s in strategies]
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
# evenly (`--layers 8` balances it). The step times are from Gloo on a shared CPU, where a
# reduce-scatter costs as much as an all-reduce: comm-free, which replaces the matrices'
# reduce-scatter with all-to-alls, looks better here than its bytes alone say.
#
# ## 9. Main, and where to go next
#
# `python distributed_muon_cpu.py --help` lists the options (script §9): the grid (`--dp`, `--tp`),
# steps, seed, bucket size, the Muon hyperparameters, `--strategy`, `--compare`, `--model`,
# `--layers`, `--explain` and `--json`. Bad input stops
# before anything is spawned, with one line and exit code 2; a failing rank ends the run with its
# error. On GPUs, the same algorithm runs under `torchrun` with NCCL:
# `torchrun --standalone --nproc-per-node 8 distributed_muon.py --dp 4 --tp 2`.
# The chapters in `notes/` explain each idea with its measured figures.
