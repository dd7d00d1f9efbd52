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
# The notebook imports the lesson, `distributed_muon_cpu.py` (§1–§5), `muon_owners.py` (§6, as
# `mo`) and `muon_large_runs.py` (§7, as `mlr`), and its tooling, `muon_tools.py`, from the folder it
# runs in. In Colab, first set the repository's git URL (`%env DISTRIBUTED_MUON_REPOSITORY=<url>`):
# this cell clones it and works in the clone. What is missing (torch ≥ 2.9, which has
# `torch.optim.Muon`, the reference; matplotlib) comes from `requirements.txt`.

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
import muon_tools as mt  # noqa: E402  (the report, the launcher, the command line, this setup)

mt.notebook_requirements()
import distributed_muon_cpu as dm  # noqa: E402
import muon_large_runs as mlr  # noqa: E402
import muon_owners as mo  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPU cores")

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
plan = mt.plan_optimizer(mt.RunConfig(dp=3, tp=2))
print(mt.format_buffer_map(plan.layout))

# %% [markdown]
# ## 5. The step: the gather strategy
#
# `DistributedMuon.step` takes the buckets one at a time: the gradient reduce-scatter, momentum and
# AdamW on this rank's parts, the orthogonalization, the parameter all-gather. The orthogonalization
# is the gather flow, `gather_newton_schulz_shard`:
# DP gather → TP gather → Newton–Schulz → TP shard → DP shard.
#
# Here it runs in this process, on the first bucket of the 4 × 2 grid: `plan_optimizer` builds what
# each of the eight ranks builds (its `dist_meta`), each rank's update shard is cut with the script's
# own slices, and each arrow is the script's own function. The two collectives are joins that a
# process group does: the DP gather concatenates the DP shards in DP rank order (what `all_gather`
# returns), and the TP gather joins the TP pieces with `join_tp_pieces`, as `tp_gather` does.

# %%
dp, tp = 4, 2
plans = [mt.plan_optimizer(mt.RunConfig(dp=dp, tp=tp), rank) for rank in range(dp * tp)]  # rank = d * TP + t
bucket = plans[0].layout.buckets[0]
meta = {(d, t): plans[d * tp + t].dist_metas for d in range(dp) for t in range(tp)}  # {name: DistMeta}
gen = torch.Generator().manual_seed(0)
update = {n: torch.randn(plans[0].layout.global_shapes[n], generator=gen).bfloat16() for n in bucket.names}
# Each rank's update shard of the bucket: its TP piece of each matrix, then its DP part of that piece.
shard = {(d, t): dm.shard_of_bucket({n: dm.dp_shard(dm.tp_shard(update[n], meta[d, t][n].tp_split_dim, t, tp),
                                                    meta[d, t][n]) for n in bucket.names},
                                    [meta[d, t][n] for n in bucket.names], bucket.numel // dp, torch.bfloat16, "cpu")
         for d in range(dp) for t in range(tp)}
print(f"bucket {bucket.names}: {bucket.numel:,} elements; each rank's update shard: {tuple(shard[0, 0].shape)}\n")

# The DP gather: each TP column's ranks join their shards, and every one of them holds the whole bucket.
whole_bucket = {t: torch.cat([shard[d, t] for d in range(dp)]) for t in range(tp)}
print(f"DP gather: {dp} shards of {tuple(shard[0, 0].shape)} -> the bucket, {tuple(whole_bucket[0].shape)}")
parts = {}  # (d, t, name) -> that rank's part of the orthogonalized matrix
for name in bucket.names:
    for t in range(tp):
        m = meta[0, t][name]
        tp_local = dm.matrix_in_bucket(whole_bucket[t], m)
        peers = [dm.matrix_in_bucket(whole_bucket[u], meta[0, u][name]) for u in range(tp)]
        full = dm.join_tp_pieces(peers if m.tp_split_dim >= 0 else [tp_local], m.tp_split_dim)  # TP gather
        ortho = dm.newton_schulz(full)  # Newton-Schulz
        tp_piece = dm.tp_shard(ortho, m.tp_split_dim, t, tp)  # TP shard
        for d in range(dp):
            parts[d, t, name] = dm.dp_shard(tp_piece, meta[d, t][name])  # DP shard
        if t == 0:
            split = "not split" if m.tp_split_dim < 0 else f"split on dim {m.tp_split_dim}"
            print(f"{name} ({split}), TP rank 0: TP-local {tuple(tp_local.shape)} -> TP gather {tuple(full.shape)}"
                  f" -> Newton-Schulz {tuple(ortho.shape)} -> TP shard {tuple(tp_piece.shape)} -> DP shard, "
                  "elements on DP 0-3: " + " ".join(str(parts[d, t, name].numel()) for d in range(dp)))

# Put every rank's part back together and compare with torch's Newton-Schulz on the whole matrix.
for name in bucket.names:
    split = meta[0, 0][name].tp_split_dim
    tp_locals = [torch.cat([parts[d, t, name] for d in range(dp)]).view(meta[0, t][name].shape) for t in range(tp)]
    whole = dm.join_tp_pieces(tp_locals, split)
    theirs = torch.optim._muon._zeropower_via_newtonschulz(update[name], dm.NS_COEFFICIENTS, dm.NS_STEPS, dm.NS_EPS)
    print(f"{name}: every rank's part put together, torch.equal with Newton-Schulz on the whole matrix: "
          f"{torch.equal(whole, theirs)}")

# %% [markdown]
# ## 6. Orthogonalize each matrix once: the owner and comm-free strategies
#
# The gather flow repeats Newton–Schulz on every rank that touches a matrix. `OwnerMuon` gives each
# matrix one owner, chosen by longest-processing-time over Newton–Schulz FLOPs; `CommFreeMuon` also
# keeps each matrix whole on its owner's DP row. Both are section 5's optimizer with stages
# replaced, every other stage reused; with `overlap=K` (`--overlap K`) they also pipeline the
# step bucket by bucket, so that Newton–Schulz runs while later buckets' collectives are in
# flight (`muon_owners.py`, the lesson's section 6 in a file of its own, draws the schedule).
# With 8 layers, 40 matrices spread evenly over 8 ranks:

# %%
plan = mt.plan_optimizer(mt.RunConfig(dp=8, tp=1, layers=8, strategy="owner"))
per_rank, balance = mo.load_balance(plan.ns_flops, plan.owners, 8)
rows = [[r, sum(o == r for o in plan.owners.values()), f"{per_rank[r] / 1e9:.3f}"] for r in range(8)]
print(mt.format_table(["rank", "matrices owned", "Newton-Schulz GFLOP"], rows, [">", ">", ">"]))
print(f"max / mean = {balance:.2f}\n")
print("class OwnerMuon(DistributedMuon):\n    " + mo.OwnerMuon.__doc__.strip())

# %% [markdown]
# ## 7. What large runs add: blocks, Polar Express, QK-clip, Newton-Schulz on TP pieces
#
# `torch.optim.Muon` runs one fixed polynomial five times on each whole matrix and does nothing after
# the update. Large runs do four things more, each a constructor keyword and a flag of the script
# (the default keeps torch's behaviour); two of them change what travels between ranks (chapter 11
# of `notes/` draws what moves). Here, the math of each, in this process, with the functions of
# `muon_large_runs.py` (§7, imported as `mlr`).
#
# **Per-iteration coefficients.** `ns_coefficients="polar_express"` (`--ns-coefficients
# polar_express`) gives each iteration its own (a, b, c) (Polar Express, arXiv 2505.16932): the
# same matmuls, so the same FLOPs and bytes, and the singular values of a matrix whose spectrum
# spans three decades, as a gradient's does, land closer to 1 in five iterations:

# %%
gen = torch.Generator().manual_seed(2)
left, _ = torch.linalg.qr(torch.randn(512, 128, generator=gen))
right, _ = torch.linalg.qr(torch.randn(128, 128, generator=gen))
spread = left @ torch.diag(torch.logspace(0, -3, 128)) @ right.T  # singular values 1 down to 0.001
for name in dm.NS_COEFFICIENT_CHOICES:
    sv = torch.linalg.svdvals(dm.newton_schulz(spread, coefficients=name).float())
    first = dm.ns_coefficients_of(name, dm.NS_STEPS)[0]
    print(f"{name:<14} first (a, b, c) = ({first[0]:.3f}, {first[1]:.3f}, {first[2]:.3f}): "
          f"singular values after {dm.NS_STEPS} iterations {sv.min():.3f} to {sv.max():.3f}")

# %% [markdown]
# **Fused blocks.** A fused QKV weight laid out head by head (q, k, v of head 0, then of head 1, …)
# orthogonalized whole is not what Q, K and V would get as three parameters. `RowLayout` names the
# rows; `ns_blocks="blocks"` (`--ns-blocks blocks`) orthogonalizes Q, K and V each alone, `"heads"`
# each head's q, k and v alone. Each block is exactly `newton_schulz` of those rows as a separate
# matrix, so `torch.optim.Muon` on the blocks as separate parameters gives the same bits. Under TP
# (split on dim 0, by heads) each TP rank holds whole heads: half of Q's rows here, so the Q block
# still needs the TP gather, and the blocks add no bytes to it.

# %%
heads, head_dim, d_model = 4, 16, 64
layout = mlr.RowLayout(sizes=(head_dim,) * 3, periods=heads, names=("q", "k", "v"))
fused = torch.randn(layout.rows, d_model, generator=gen)
blocks = layout.blocks()  # row indices of Q, K and V across the heads
as_blocks, as_whole = mlr.newton_schulz_blocks(fused, blocks), dm.newton_schulz(fused)
for name, rows in zip(layout.names, blocks):
    alone = dm.newton_schulz(fused[rows])
    runs = " ".join(f"{rows[i]}-{rows[i + head_dim - 1]}" for i in range(0, len(rows), head_dim))
    print(f"{name}: rows {runs}; torch.equal with its block alone: "
          f"{torch.equal(as_blocks[rows], alone)}; max |whole - blocks| {(as_whole[rows].float() - alone.float()).abs().max():.3f}")
print(f"per head: {len(layout.blocks(per_head=True))} blocks of {head_dim} rows; "
      f"each TP rank of 2 holds {layout.tp_piece(2).periods} heads, {layout.tp_piece(2).rows} rows")

# %% [markdown]
# **QK-clip.** After the step, every head whose largest pre-softmax logit S exceeded τ has its rows
# of W_q and of W_k each multiplied by √(τ / S) (Kimi K2, arXiv 2507.20534), so its logits shrink by
# τ / S: that head's largest logit on the same input becomes τ. A head that no rank computed (-inf)
# or that stayed under τ keeps its rows. Under DP the maxima of one head come from every DP rank's
# batch, so `optimizer.clip_qk_(max_logits)` reduces them first: on the lesson's grid, 4 bytes per
# head of this TP rank, over its DP group (chapter 11 has the other layouts):
#
# ```
#   DP 0, TP t: [a0 a1] ─┐
#   DP 1, TP t: [b0 b1] ─┤
#   DP 2, TP t: [c0 c1] ─┼─ all-reduce MAX over DP ─► S_h ─► every DP rank: rows of head h × √min(1, τ/S_h)
#   DP 3, TP t: [d0 d1] ─┘
# ```

# %%
tau = 3.0
w_q, w_k = (torch.randn(heads * head_dim, d_model, generator=gen, dtype=torch.float64) / 8 for _ in range(2))
tokens = torch.randn(8, d_model, generator=gen, dtype=torch.float64)
w_q[:head_dim] *= 4  # heads 0 and 1: logits that grew
w_q[head_dim:2 * head_dim] *= 2


def max_logits(w_q, w_k):  # per head: max over token pairs of q.k / sqrt(head_dim)
    q, k = (tokens @ w_q.T).view(8, heads, head_dim), (tokens @ w_k.T).view(8, heads, head_dim)
    return torch.einsum("ihd,jhd->hij", q, k).amax(dim=(1, 2)) / head_dim**0.5


before = max_logits(w_q, w_k)
scales = mlr.qk_clip_scales(before, tau)
for h, s in enumerate(scales):
    rows = slice(h * head_dim, (h + 1) * head_dim)
    w_q[rows] *= s
    w_k[rows] *= s
after = max_logits(w_q, w_k)
for h in range(heads):
    print(f"head {h}: max logit {before[h]:7.3f}, multiplier {scales[h]:.4f} -> {after[h]:7.3f}")

# %% [markdown]
# **Newton–Schulz on TP pieces.** A matrix that TP splits along its long side, columns X = [X₁ X₂],
# has X·Xᵀ = X₁·X₁ᵀ + X₂·X₂ᵀ: with `tp_newton_schulz="gram"` (`--tp-newton-schulz gram`) each TP
# rank computes its piece's small Gram matrix, one all-reduce sums them, and each rank updates its
# own columns, every iteration:
#
# ```
#   TP 0: X₁ ─ X₁·X₁ᵀ ─┐                                   ┌─ X₁ ← a·X₁ + (b·A + c·A·A)·X₁
#                      ├─ all-reduce SUM: A (m × m, fp32) ─┤
#   TP 1: X₂ ─ X₂·X₂ᵀ ─┘                                   └─ X₂ ← a·X₂ + (b·A + c·A·A)·X₂
# ```
#
# That is `mlr.newton_schulz_tp` (the "distributed" TP mode of NVIDIA's Emerging-Optimizers, which
# Megatron-core uses). Below, the same arithmetic with the all-reduce done as a sum in this process:
# each piece's product in float32, summed, rounded to bf16 once, as torch's one bf16 matmul rounds its
# float32 accumulation once. The identity is exact in real numbers; in float32 the sum runs in another
# order than torch's, so now and then a near-tie rounds to the other bf16 neighbour, and the later
# iterations carry it on: close to torch's bits, usually not equal to them.

# %%
wide = torch.randn(64, 1024, generator=gen)
pieces = wide.chunk(2, dim=1)  # the two TP ranks' columns
whole_gram, pieces_gram = wide @ wide.T, sum(p @ p.T for p in pieces)
print(f"float32 Gram: max |whole - sum over pieces| {(whole_gram - pieces_gram).abs().max():.2g} "
      f"(entries up to {whole_gram.abs().max():.0f})")


def newton_schulz_of_pieces(pieces):
    xs = [p.bfloat16() for p in pieces]
    norm = sum(x.float().square().sum() for x in xs).sqrt().to(torch.bfloat16)  # one all-reduced float
    xs = [x / norm for x in xs]
    for a, b, c in dm.ns_coefficients_of(dm.NS_COEFFICIENTS, dm.NS_STEPS):
        gram = sum(x.float() @ x.float().mT for x in xs).bfloat16()  # the all-reduce: every rank gets the sum
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        xs = [torch.addmm(x, poly, x, beta=a) for x in xs]  # each rank its own columns
    return torch.cat(xs, dim=1)


equal, worst = 0, 0
for _ in range(8):
    wide = torch.randn(64, 1024, generator=gen)
    ours = newton_schulz_of_pieces(wide.chunk(2, dim=1))
    theirs = torch.optim._muon._zeropower_via_newtonschulz(wide, dm.NS_COEFFICIENTS, dm.NS_STEPS, dm.NS_EPS)
    top = theirs.float().abs().max()
    spacing = torch.finfo(torch.bfloat16).eps * 2 ** top.log2().floor()  # between bf16 numbers just below `top`
    equal += torch.equal(ours, theirs)
    worst = max(worst, int((ours.float() - theirs.float()).abs().max() / spacing))
print(f"Newton-Schulz from 2 pieces against torch's on the whole, 8 matrices of 64x1024: torch.equal on {equal} "
      f"of 8; max |d| {worst} bf16 steps at the largest entries")

# %% [markdown]
# ## 8. A run, and its verification against torch.optim.Muon / torch.optim.AdamW
#
# Now 8 ranks, DP=4 × TP=2, started by the script as one process per rank; the notebook runs the
# script as a process of its own (`mt.run_program`) and fails the cell if it fails. After the steps,
# the launcher runs `torch.optim.Muon` and `torch.optim.AdamW` on one device, fed the summed
# gradients, and compares every rank's piece with `torch.equal`.

# %%
os.makedirs("runs", exist_ok=True)
mt.run_program("distributed_muon_cpu.py", "--dp", "4", "--tp", "2", "--explain", "--json", "runs/notebook_4x2.json")
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
# ## 9. Accounting
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
# ## 10. Main: the launcher and the command line
#
# The launcher behind every run above checks the arguments and plans the layout before any rank
# starts, starts one process per rank and watches them: bad input stops with one line and exit code
# 2, a rank that fails, dies or stops responding ends the run with one line naming it, and Ctrl-C
# stops every rank. Its options:

# %%
mt.run_program("distributed_muon_cpu.py", "--help")

# %% [markdown]
# ## 11. Training checks: a real training against one process
#
# A real training splits fp32 sums over ranks. Where the ranks' association is known, the one-process
# reference performs the same sums: the GPT of `examples/` on Gloo adds TP's partial sums in rank
# order, and its reference computes TP's pieces apart and adds them in that order, so every comparison
# is bit for bit. Where it is not (FSDP2 in `dtensor_demo.py --train`; NCCL's own order with TP > 2),
# what is checked instead: the optimizer's replay bit for bit, and each step's gradients against float64
# within a bound measured on the step itself: `REALIZED_FACTOR` x the one process's own error, plus one
# reordered reduction (`mt.bound_ratio`, at most 1 passes). Both on one sum of 4096 terms per entry,
# added in one pass (one process) or as two halves then added (two TP ranks):

# %%
torch.manual_seed(0)
terms = torch.randn(4096, 64)
exact = terms.double().sum(0)
one_process = terms.sum(0)
halves = terms.view(2, 2048, 64).sum(1)
two_ranks = halves[0] + halves[1]
e_one = (one_process.double() - exact).abs().max().item()
e_ranks = (two_ranks.double() - exact).abs().max().item()
print(f"error against float64: one process {e_one:.2e}, two ranks {e_ranks:.2e}; "
      f"bound_ratio {mt.bound_ratio(e_ranks, e_one, 2, exact.abs().max().item()):.3f} (<= 1 passes)")
print("one pass and two halves, bits equal:", torch.equal(one_process, two_ranks))
print("two halves added either way round (any two-term sum), bits equal:", torch.equal(two_ranks, halves[1] + halves[0]))

# %% [markdown]
# Next, `distributed_muon_runs.ipynb` runs the script more: every grid of 8 ranks, the strategies
# side by side, and a real tensor-parallel GPT trained with the optimizer. `notes/README.md` orders
# the chapters that explain each idea with its measured figures.
