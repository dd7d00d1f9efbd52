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
# it, and gives every rank exactly its part:
#
#     DP gather  →  TP gather  →  Newton–Schulz  →  TP shard  →  DP shard
#
# This notebook follows the script section by section, with the script's own code: the pieces
# that run in one process run here, in cells; the 8-rank run is launched as a subprocess. The same
# ideas, chapter by chapter, with measured figures, are in `notes/`. Run the cells top to bottom.

# %% [markdown]
# ## 0. Setup
#
# The notebook imports the script, so it needs `distributed_muon_cpu.py` beside it. In Colab it is
# not there: set `DISTRIBUTED_MUON_REPOSITORY` to the repository's git URL (e.g. a first cell with
# `%env DISTRIBUTED_MUON_REPOSITORY=<url>`) and this cell clones it into the current folder and
# moves into the clone. The script needs `torch` ≥ 2.9, the first release with `torch.optim.Muon`,
# the reference everything is checked against; what is missing is installed from `requirements.txt`.

# %%
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap

REPOSITORY_URL = os.environ.get("DISTRIBUTED_MUON_REPOSITORY", "")
CLONE = "distributed-muon"
if not os.path.exists("distributed_muon_cpu.py"):
    # A kernel restarted after a clone starts again in the folder that holds the clone.
    if not os.path.exists(os.path.join(CLONE, "distributed_muon_cpu.py")):
        if not REPOSITORY_URL:
            raise FileNotFoundError("distributed_muon_cpu.py is not beside this notebook: set "
                                    "DISTRIBUTED_MUON_REPOSITORY to the repository's git URL, or upload "
                                    "distributed_muon_cpu.py beside the notebook.")
        subprocess.run(["git", "clone", "--depth", "1", REPOSITORY_URL, CLONE], check=True)
        print(f"cloned {REPOSITORY_URL} into {os.path.abspath(CLONE)}")
    os.chdir(CLONE)
    print(f"working in {os.getcwd()}")


def torch_version():
    """The version of the torch this kernel imports, or None; and whether it has torch.optim.Muon."""
    if importlib.util.find_spec("torch") is None:
        return None, False
    import torch

    return torch.__version__, hasattr(torch.optim, "Muon")


version, has_muon = torch_version()
if not has_muon or importlib.util.find_spec("matplotlib") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", "requirements.txt"], check=True)
    if not has_muon:  # a torch already imported stays loaded until the kernel restarts
        raise RuntimeError(f"torch {version} has no torch.optim.Muon, which needs torch >= 2.9: a newer torch "
                           "was installed from requirements.txt; restart the kernel and run the notebook again.")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import distributed_muon_cpu as dm  # noqa: E402
import muon_tools as mt  # noqa: E402  (the report, the launcher and the command line)

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (torch.optim.Muon: yes), "
      f"{os.cpu_count()} CPU cores")

# %% [markdown]
# ## 1. Newton-Schulz, momentum and the learning-rate adjustment
#
# `dm.newton_schulz` casts the matrix to bf16, transposes it if it is tall, scales it by its
# Frobenius norm and runs five quintic iterations: the same operations as `torch.optim.Muon`, in
# the same order, so the same bits, which `torch.equal` checks against torch's own function. The
# result is close to the nearest semi-orthogonal matrix: its singular values land near 1.

# %%
torch.set_num_threads(1)  # as every rank does: bf16 matmul bits can depend on the thread count
matrix = torch.randn(384, 128, generator=torch.Generator().manual_seed(0))
ours = dm.newton_schulz(matrix)
theirs = torch.optim._muon._zeropower_via_newtonschulz(matrix, dm.NS_COEFFICIENTS, dm.NS_STEPS, dm.NS_EPS)
singular, singular_in = torch.linalg.svdvals(ours.float()), torch.linalg.svdvals(matrix)
print(f"torch.equal with torch's Newton-Schulz: {torch.equal(ours, theirs)}")
print(f"singular values of the result: {singular.min():.3f} to {singular.max():.3f} "
      f"(of the input: {singular_in.min():.1f} to {singular_in.max():.1f})")

# %% [markdown]
# The momentum (torch's `lerp`, with Nesterov) and AdamW are elementwise: a rank that holds a part
# of a matrix gets the same bits for that part as one device holding all of it, which is what lets
# ZeRO-1 keep a part of the state per rank. The learning rate of each matrix is scaled by its full
# (TP-gathered) shape, `sqrt(max(1, rows / cols))` by default.

# %%
gen = torch.Generator().manual_seed(1)
grad, buf = torch.randn(384 * 128, generator=gen), torch.randn(384 * 128, generator=gen)
whole = dm.muon_momentum_(buf.clone(), grad, 0.95, True)
halves = torch.cat([dm.muon_momentum_(b, g, 0.95, True) for b, g in zip(buf.clone().chunk(2), grad.chunk(2))])
print(f"momentum on two halves equals momentum on the whole: {torch.equal(whole, halves)}")
for shape in [(384, 128), (128, 128), (128, 512)]:
    print(f"learning rate 0.02 of a {shape[0]}x{shape[1]} matrix: {dm.adjusted_lr(0.02, 'original', shape):.4f}")

# %% [markdown]
# ## 2. The grid and its collectives
#
# World = DP × TP ranks, `rank = dp_rank · TP + tp_rank`. A row is a TP group: contiguous ranks,
# as the GPUs of one node, because TP traffic is the most frequent. A column is a DP group: the
# ranks holding the same TP piece of every weight, each fed different data.

# %%
print(mt.format_grid(4, 2))
grid = dm.plan_grid(4, 2, rank=5)
print(f"\nrank 5: DP rank {grid.dp.rank} of DP group {grid.dp.ranks}, "
      f"TP rank {grid.tp.rank} of TP group {grid.tp.ranks}")

# %% [markdown]
# ## 3. The parameters and their gradients
#
# A small transformer: column-parallel matrices split on dim 0 (`qkv`, `fc1`), row-parallel ones
# on dim 1 (`proj`, `fc2`), a router that TP does not split, and non-matrix parameters (embedding,
# head, norms, biases, a 0-dim scalar) that go to AdamW, as in practice. Each DP rank draws its own
# gradients as multiples of 2⁻¹⁰, so their float32 sum is exact in any order.

# %%
rows = [[s.name, "x".join(map(str, s.global_shape)) or "scalar", "-" if s.tp_split_dim < 0 else s.tp_split_dim,
         s.group] for s in dm.transformer_specs()]
print(mt.format_table(["parameter", "global shape", "TP split dim", "param group"], rows, ["<", ">", ">", "<"]))

# %% [markdown]
# ## 4. The virtual buffer
#
# Each param group is one flat virtual buffer of TP pieces, cut into buckets, each padded to a
# multiple of DP and split into DP equal shards. A parameter may straddle shards: each DP rank
# keeps optimizer state for its part only. `plan_optimizer` builds the optimizer rank 0 builds in a
# run, without process groups, so this is the layout the ranks use, here on an uneven 3 × 2 grid:

# %%
plan = dm.plan_optimizer(dm.RunConfig(dp=3, tp=2))
print(mt.format_buffer_map(plan.layout))

# %% [markdown]
# ## 5. The step: the gather strategy
#
# `DistributedMuon.step` runs four stages (`_stages`): the gradient reduce-scatter, momentum and
# AdamW on this rank's parts, the orthogonalization, and the parameter all-gather. The
# orthogonalization is the gather flow, one bucket at a time, in `gather_newton_schulz_shard`:
# DP gather → TP gather → Newton–Schulz → TP shard → DP shard.

# %%
print(inspect.getsource(dm.DistributedMuon._stages))
print(inspect.getsource(dm.gather_newton_schulz_shard))

# %% [markdown]
# ## 6. Orthogonalize each matrix once: the owner and comm-free strategies
#
# The gather flow repeats Newton–Schulz on every rank that touches a matrix. `OwnerMuon` gives each
# matrix one owner, chosen by longest-processing-time over Newton–Schulz FLOPs; `CommFreeMuon` also
# keeps each matrix whole on its owner's DP row. Both are section 5's optimizer with stages
# replaced, every other stage reused; with `overlap=K` (`--overlap K`) they also pipeline the
# step bucket by bucket, so that Newton–Schulz runs while later buckets' collectives are in
# flight (the script's section 6 draws the schedule). With 8 layers, 40 matrices spread evenly
# over 8 ranks:

# %%
plan = dm.plan_optimizer(dm.RunConfig(dp=8, tp=1, layers=8, strategy="owner"))
per_rank, balance = dm.load_balance(plan.ns_flops, plan.owners, 8)
rows = [[r, sum(o == r for o in plan.owners.values()), f"{per_rank[r] / 1e9:.3f}"] for r in range(8)]
print(mt.format_table(["rank", "matrices owned", "Newton-Schulz GFLOP"], rows, [">", ">", ">"]))
print(f"max / mean = {balance:.2f}\n")
print("class OwnerMuon(DistributedMuon):\n" + textwrap.indent(inspect.getdoc(dm.OwnerMuon), "    "))

# %% [markdown]
# ## 7. A run, and its verification against torch.optim.Muon / torch.optim.AdamW
#
# Now 8 ranks, DP=4 × TP=2, started by the script as one process per rank. Spawned from this kernel,
# each would re-import the kernel's `__main__`, which a notebook does not have, so the notebook runs
# the script as a separate process with this kernel's interpreter, streams its output, and fails
# the cell if it fails. After the steps, the launcher runs `torch.optim.Muon` and `torch.optim.AdamW`
# on one device, fed the summed gradients, and compares every rank's piece with `torch.equal`.


# %%
def run_program(program, *args):
    """Run `program` (a script of this repository) with `args`, print its output as it comes, raise if it fails."""
    cmd = [sys.executable, "-u", program, *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="")
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


os.makedirs("runs", exist_ok=True)
run_program("distributed_muon_cpu.py", "--dp", "4", "--tp", "2", "--explain", "--json",
            "runs/notebook_4x2.json")
with open("runs/notebook_4x2.json") as f:
    run = json.load(f)

# %% [markdown]
# The difference against torch, next to how far each weight moved, so that 0 is seen against the
# size of the change:

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
# ## 8. Accounting
#
# Every collective goes through one place in the script (section 2) that records the bytes each
# rank sends and receives, counted as a ring algorithm moves them (Gloo records no sizes; its own
# reduce-scatter is a full all-reduce, so on Gloo the script's is an all-to-all and a local sum,
# which moves exactly the ring's bytes). Newton–Schulz FLOPs are counted per call.
# The redundancy is their sum over ranks divided by one device doing each matrix once.

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
# it: the redundancy is TP × (the number of DP shards a matrix touches, FLOP-weighted). The grid
# changes how the cost is split between DP and TP traffic and how much work is repeated. The next
# cell runs the other grids of 8 ranks (about half a minute on 2 cores); 4 × 2 is the run above.

# %%
grids = [(8, 1), (4, 2), (2, 4), (1, 8)]
sweep = {(4, 2): run}  # bytes and FLOPs are the same every step: the 4 x 2 run above serves
for dp, tp in grids[:1] + grids[2:]:
    # one step each
    out = subprocess.run([sys.executable, "distributed_muon_cpu.py", "--dp", str(dp), "--tp", str(tp), "--steps", "1",
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
# The strategies side by side: `benchmarks/compare.py` runs gather, owner, comm-free and the AdamW
# ZeRO-1 baseline on the same grid, checks each against torch, and prints one table (about 20 s).

# %%
run_program("benchmarks/compare.py", "--steps", "2", "--json", "runs/notebook_compare.json")
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
# ## 9. Main: the launcher and the command line
#
# The launcher behind every run above checks the arguments and plans the layout before any rank
# starts, starts one process per rank and watches them: bad input stops with one line and exit code
# 2, a rank that fails, dies or stops responding ends the run with one line naming it, and Ctrl-C
# stops every rank. Its options:

# %%
run_program("distributed_muon_cpu.py", "--help")

# %% [markdown]
# ## 10. Train for real: a tensor-parallel GPT on real text
#
# Everything above fed the optimizer synthetic gradients. `examples/train_gpt.py` trains a small
# GPT (`examples/gpt.py`) on the Python standard library's own source files (bytes as tokens, no
# download: every Python has them), made tensor-parallel the Megatron way: column-parallel QKV
# and MLP-in, row-parallel attention-out and MLP-out, and the two conjugate functions *f* and *g*
# that all-reduce over the TP group. Its hidden matrices go to the same `OwnerMuon` as above, its
# embeddings, norms and biases to AdamW. Below: 20 steps on DP=2 x TP=2.

# %%
run_program("examples/train_gpt.py", "--dp", "2", "--tp", "2", "--steps", "20", "--log-every", "5",
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
# Muon reached AdamW's best validation loss in 3.3x fewer steps (`notes/09-training.md`).

# %% [markdown]
# Is the distributed training the training one process would do? `--verify` trains the same GPT in
# this process with `torch.optim.Muon` and `torch.optim.AdamW` on the same micro-batches, and
# compares three ways: the ranks' own gradients replayed through torch's optimizers (bit for bit:
# the optimizer is exact), each step's loss and gradients at the ranks' weights (TP adds partial
# sums in another order, so they agree to the last bits of float32, within a stated bound), and the
# two free-running trainings. `notes/09-training.md` explains the bounds.

# %%
run_program("examples/train_gpt.py", "--dp", "2", "--tp", "2", "--steps", "3", "--verify")

# %% [markdown]
# Where to go next: `benchmarks/` measures the strategies (`compare.py`), the grids and bucket sizes
# (`sweep.py`), Gloo's collectives, overlap and batched Newton–Schulz; `notes/README.md` orders the
# chapters that explain each idea with its measured figures. On GPUs the same algorithm runs under
# `torchrun` with NCCL: `torchrun --standalone --nproc-per-node 8 distributed_muon.py --dp 4 --tp 2`.
