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
# This notebook reads the script along, section by section: each section prints the script's own
# source of what it runs (`muon_tools.show_source`, with the file's line numbers), then runs it. Section 4
# runs the flow itself, `gather_newton_schulz_shard`, on the eight ranks of a DP 4 × TP 2 grid, each a
# thread of this notebook's process with real Gloo process groups; section 6 starts the eight
# processes of `python distributed_muon_cpu.py`. The same ideas, chapter by chapter, with measured
# figures, are in `notes/`. Run the cells top to bottom.

# %% [markdown]
# ## 0. Setup
#
# The notebook imports the lesson, `distributed_muon_cpu.py` (§1–§6), `distmuon/owners.py` (§7, as
# `mo`) and `distmuon/large_runs.py` (§8, as `mlr`), and the runner, `muon_tools.py` (as `mt`), from the folder
# it runs in. In Colab, first set the repository's git URL (`%env DISTRIBUTED_MUON_REPOSITORY=<url>`):
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
import muon_tools  # noqa: E402  (the reference, the launcher, the report, this notebook's helpers)

muon_tools.notebook_requirements()
import distributed_muon_cpu  # noqa: E402
from distmuon import checks  # noqa: E402
from distmuon import large_runs  # noqa: E402
from distmuon import owners  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tools import figures  # noqa: E402  (the two pictures of sections 3 and 4, as notes/03-flow.md shows them)

torch.set_num_threads(1)  # as every rank does: bf16 matmul bits can depend on the thread count
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPU cores")

# %% [markdown]
# ## 1. Muon on one device
#
# `muon_step_` is `torch.optim.Muon`'s step of one matrix: the momentum, Newton–Schulz of the whole
# matrix, the weight decay and the update with a learning rate adjusted to the matrix's shape. The rest
# of the script distributes it. Here it steps a matrix beside `torch.optim.Muon`, bit for bit:

# %%
muon_tools.show_source(distributed_muon_cpu.muon_step_)
w = torch.randn(96, 32, generator=torch.Generator().manual_seed(3))
ours, theirs = w.clone(), torch.nn.Parameter(w.clone())
group = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, eps=distributed_muon_cpu.NS_EPS,
             ns_coefficients=distributed_muon_cpu.NS_COEFFICIENTS, adjust_lr_fn=None)
torch_muon, buffer = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1), torch.zeros(96, 32)
for step in range(3):
    grad = torch.randn(96, 32, generator=torch.Generator().manual_seed(10 + step))
    distributed_muon_cpu.muon_step_(ours, grad, buffer, group)
    theirs.grad = grad
    torch_muon.step()
print(f"three steps, torch.equal with torch.optim.Muon's: {torch.equal(ours, theirs.detach())}")

# %% [markdown]
# `newton_schulz` casts the matrix to bf16, transposes it if it is tall, scales it by its Frobenius
# norm and runs five quintic iterations: the same operations as `torch.optim.Muon`, in the same
# order, so the same bits, which `torch.equal` checks against torch's own function. The result is
# close to the nearest semi-orthogonal matrix: its singular values land near 1.

# %%
muon_tools.show_source(distributed_muon_cpu.newton_schulz)

# %%
matrix = torch.randn(384, 128, generator=torch.Generator().manual_seed(0))
ours = distributed_muon_cpu.newton_schulz(matrix)
theirs = torch.optim._muon._zeropower_via_newtonschulz(matrix, distributed_muon_cpu.NS_COEFFICIENTS,
                                                       distributed_muon_cpu.NS_STEPS, distributed_muon_cpu.NS_EPS)
singular, singular_in = torch.linalg.svdvals(ours.float()), torch.linalg.svdvals(matrix)
print(f"torch.equal with torch's Newton-Schulz: {torch.equal(ours, theirs)}")
print(f"singular values of the result: {singular.min():.3f} to {singular.max():.3f} "
      f"(of the input: {singular_in.min():.1f} to {singular_in.max():.1f})")

# %% [markdown]
# The momentum (torch's `lerp`, with Nesterov) is elementwise: a rank that holds a part of a matrix
# gets the same bits for that part as one device holding all of it, which is what lets ZeRO-1 keep a
# part of the state per rank (AdamW likewise). The learning rate of each matrix is scaled by its
# full (TP-gathered) shape, `sqrt(max(1, rows / cols))` by default.

# %%
muon_tools.show_source(distributed_muon_cpu.muon_momentum_)
gen = torch.Generator().manual_seed(1)
grad, buf = torch.randn(384 * 128, generator=gen), torch.randn(384 * 128, generator=gen)
whole = distributed_muon_cpu.muon_momentum_(buf.clone(), grad, 0.95, True)
halves = torch.cat([distributed_muon_cpu.muon_momentum_(b, g, 0.95, True) for b, g in zip(buf.clone().chunk(2), grad.chunk(2))])
print(f"momentum on two halves equals momentum on the whole: {torch.equal(whole, halves)}")
for shape in [(384, 128), (128, 128), (128, 512)]:
    print(f"learning rate 0.02 of a {shape[0]}x{shape[1]} matrix: {distributed_muon_cpu.adjusted_lr(0.02, 'original', shape):.4f}")

# %% [markdown]
# ## 2. The grid and its collectives
#
# World = DP × TP ranks, `rank = dp_rank · TP + tp_rank`. A row is a TP group: contiguous ranks,
# as the GPUs of one node, because TP traffic is the most frequent. A column is a DP group: the
# ranks holding the same TP piece of every weight, each fed different data. `plan_grid` is what a
# rank sees without process groups; `make_grid` adds them. Every byte between ranks then goes
# through a function like `all_gather`, which counts it in the rank's `Ledger`.

# %%
muon_tools.show_source(distributed_muon_cpu.plan_grid, distributed_muon_cpu.all_gather)
print(muon_tools.format_grid(4, 2))
grid = distributed_muon_cpu.plan_grid(4, 2, rank=5)
print(f"\nrank 5: DP rank {grid.dp.rank} of DP group {grid.dp.ranks}, "
      f"TP rank {grid.tp.rank} of TP group {grid.tp.ranks}")

# %% [markdown]
# ## 3. The virtual buffer
#
# Each param group is one flat virtual buffer of TP pieces, cut into buckets, each padded to a
# multiple of DP and split into DP equal shards. A parameter may straddle shards: each DP rank
# keeps optimizer state for its part only, and its `DistMeta` says where that part lies: a pure
# function of shapes, DP and the bucket size. `muon_tools.plan_optimizer` builds the optimizer rank 0 builds
# in a run, without process groups, so this is the layout the ranks use, here on an uneven 3 × 2 grid:

# %%
muon_tools.show_source(distributed_muon_cpu.build_dist_metas)
plan = muon_tools.plan_optimizer(muon_tools.RunConfig(dp=3, tp=2))
print(muon_tools.format_buffer_map(plan.layout))

# %% [markdown]
# The same, drawn for a smaller run (DP 2 × TP 2, the demo at d = 16, one layer, buckets of 1,024 elements:
# `figures.RUN`): the Muon group's buckets, each parameter's TP piece a segment, and the DP shard boundaries.
# `qkv.weight` straddles the two shards of its bucket: each DP rank keeps state for its part only.

# %%
fig = plt.figure(figsize=(11, 2.2))
figures.draw_virtual_buffer(figures.layout_of(), fig)
plt.show()

# %% [markdown]
# ## 4. The gather flow
#
# `gather_newton_schulz_shard` is the flow for one bucket: DP gather → TP gather → Newton–Schulz →
# TP shard → DP shard. Here it runs on every rank of the DP 4 × TP 2 grid at once: each rank is a
# thread of this process, and each axis of its grid a real Gloo process group (`muon_tools.on_thread_ranks`),
# so `all_gather` moves real bytes between them. Each rank starts from its DP shard of the first
# bucket's update, cut with the script's own slices (`tp_shard`, then `dp_shard`, then
# `shard_of_bucket`), and calls the function the ranks of section 6 call.

# %%
muon_tools.show_source(distributed_muon_cpu.gather_newton_schulz_shard)

# %%
dp, tp = 4, 2
plan = muon_tools.plan_optimizer(muon_tools.RunConfig(dp=dp, tp=tp))  # the layout every rank plans alike
bucket, group = plan.layout.buckets[0], plan.param_groups[0]
gen = torch.Generator().manual_seed(0)
update = {n: torch.randn(plan.layout.global_shapes[n], generator=gen).bfloat16() for n in bucket.names}


def flow(grid):
    """One rank: its DP shard of the bucket's update, then the gather flow, counted in its own ledger."""
    metas = [plan.layout.metas[grid.dp.rank][n] for n in bucket.names]
    parts = {m.name: distributed_muon_cpu.dp_shard(distributed_muon_cpu.tp_shard(update[m.name], m.tp_split_dim, grid.tp.rank, tp), m)
             for m in metas}
    shard = distributed_muon_cpu.shard_of_bucket(parts, metas, bucket.numel // dp, torch.bfloat16, "cpu")
    ledger = distributed_muon_cpu.Ledger()
    ortho = distributed_muon_cpu.gather_newton_schulz_shard(shard, [m for m in metas if m.local_numel], group, grid, ledger)
    return dict(shard=shard, ortho=ortho, ledger=ledger)


ranks = muon_tools.on_thread_ranks(dp, tp, flow)
print(f"bucket (0, 0): {', '.join(bucket.names)}; {bucket.numel:,} elements, each rank's shard "
      f"{bucket.numel // dp:,}\n")
rows = []
for r, out in enumerate(ranks):
    received = {p: sum(c["received"] for c in out["ledger"].comm if c["phase"] == p) for p in ("DP gather", "TP gather")}
    ns = [f"{c['name'].split('.')[-2]} {'x'.join(map(str, c['shape']))}" for c in out["ledger"].compute]
    rows.append([r, tuple(out["shard"].shape), muon_tools.human_bytes(received["DP gather"]),
                 muon_tools.human_bytes(received["TP gather"]), ", ".join(ns),
                 " ".join(str(p.numel()) for p in out["ortho"].values())])
print(muon_tools.format_table(["rank", "update shard", "DP gather in", "TP gather in", "Newton-Schulz on", "parts out"],
                      rows, [">", ">", ">", ">", "<", "<"]))

# %% [markdown]
# What each arrow leaves on each rank, drawn: the flow's own functions run on the four thread ranks of the
# smaller run above, on a bucket whose every element carries its index, and each panel colours the elements of
# the full matrices that a rank holds after an arrow (darker once orthogonalized). Rank 2 (DP 1, TP 0) starts
# with a sliver of `qkv`, half of `proj`'s columns and all of the router; the DP gather gives it both TP pieces'
# worth of its TP rank's matrices; the TP gather, the full matrices its shard touches; then the two slices.

# %%
bucket_drawn, holdings = figures.flow_holdings()
fig = plt.figure(figsize=(12, 6.8))
figures.draw_flow(bucket_drawn, holdings, fig)
plt.show()

# %% [markdown]
# Every rank's parts of each matrix, put back together (DP parts in DP rank order, then TP pieces
# along the split dim), against torch's own Newton–Schulz of the whole matrix:

# %%
for name in bucket.names:
    meta = {(d, t): plan.layout.metas[d][name] for d in range(dp) for t in range(tp)}
    tp_locals = [torch.cat([ranks[d * tp + t]["ortho"].get(name, torch.empty(0, dtype=torch.bfloat16))
                            for d in range(dp)]).view(meta[0, t].shape) for t in range(tp)]
    ours = distributed_muon_cpu.join_tp_pieces(tp_locals, meta[0, 0].tp_split_dim)
    theirs = torch.optim._muon._zeropower_via_newtonschulz(update[name], distributed_muon_cpu.NS_COEFFICIENTS,
                                                           distributed_muon_cpu.NS_STEPS, distributed_muon_cpu.NS_EPS)
    split = "not split" if meta[0, 0].tp_split_dim < 0 else f"split on dim {meta[0, 0].tp_split_dim}"
    print(f"{name} ({split}, {'x'.join(map(str, ours.shape))}): every rank's part put together, torch.equal "
          f"with torch's Newton-Schulz on the whole matrix: {torch.equal(ours, theirs)}")

# %% [markdown]
# ## 5. The step: DistributedMuon, with the gather strategy plugged in
#
# `DistributedMuon.step` takes the buckets one at a time through four stages: the gradient
# reduce-scatter over DP, momentum (and AdamW) on this rank's parts, stage 3 (the strategy's: here the
# gather flow above) with the weight update on the parts, and the parameter all-gather that gives every
# DP rank its whole TP pieces again. The strategy is plugged into the optimizer, `Gather()` here (the end of
# section 4): `step` hands it the stages, which it runs in turn (`stages_in_turn`), and asks it for stage 3.
# Each stage is a method; the ledger names each collective's phase, as the report of section 6 prints them.

# %%
muon_tools.show_source(distributed_muon_cpu.DistributedMuon.step, distributed_muon_cpu.DistributedMuon.stages_in_turn,
                       distributed_muon_cpu.Gather.orthogonalize)
print("phases of one step, in order:", " -> ".join(muon_tools.PHASES_OF["gather"]))

# %% [markdown]
# ## 6. Run it
#
# Now the eight processes. `python distributed_muon_cpu.py` hands its command line to the runner,
# which checks the flags, prints the plan and starts DP × TP processes (a torchrun for one machine),
# each running `run_rank`, below: it joins the Gloo world, builds the grid, its pieces of the demo
# model and the optimizer, steps it with its own DP rank's gradients (the runner adds a checkpoint round
# trip halfway, after a step), and sends everything to rank 0, which runs `torch.optim.Muon` and
# `torch.optim.AdamW` on one device, fed the summed gradients, and compares every rank's piece (`torch.equal`).

# %%
muon_tools.show_source(distributed_muon_cpu.run_steps, distributed_muon_cpu.run_rank)

# %% [markdown]
# The notebook runs the script as a process of its own (`muon_tools.run_program`), and fails the cell if
# the run fails; `--explain` adds the virtual buffer's map, `--json` writes what the report shows:

# %%
os.makedirs("runs", exist_ok=True)
muon_tools.run_program("distributed_muon_cpu.py", "--dp", "4", "--tp", "2", "--explain", "--json",
                       "runs/notebook_4x2.json")
with open("runs/notebook_4x2.json") as f:
    run = json.load(f)

# %% [markdown]
# The difference against torch, next to how far each weight moved, so that 0 is seen against the
# size of the change:

# %%
compared = run["checks"]
names = [c["name"] for c in compared]
fig, ax = plt.subplots(figsize=(11, 4))
ax.bar(range(len(compared)), [c["max_abs_update"] for c in compared], color="tab:blue", label="max |update| (3 steps)")
diffs = [c["max_abs_diff"] for c in compared]
ax.scatter([i for i, d in enumerate(diffs) if d > 0], [d for d in diffs if d > 0], color="red", zorder=3,
           label="max |Δ| vs torch (where not 0)")
ax.set_yscale("log")
ax.set_xticks(range(len(compared)), names, rotation=75, fontsize=7)
n_same = sum(c["identical"] for c in compared)
ax.set_title(f"max |Δ| against torch.optim.Muon / AdamW: {n_same}/{len(compared)} parameters bit-identical "
             f"(Δ = 0 is not drawn on a log axis)")
ax.legend(loc="lower left", framealpha=1)
plt.tight_layout()
plt.show()
assert n_same == len(compared), "some parameter differs from torch"

# %% [markdown]
# What the run moved and computed, from every rank's ledger: the bytes of each phase (counted as
# a ring moves them; Gloo records no sizes), and the Newton–Schulz FLOPs of each rank beside one
# device doing each matrix once. Their ratio, the redundancy, is what section 7 removes.

# %%
phases = list(run["bytes_per_step"])
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
for rank in range(len(run["ledgers"])):
    left.bar([i + rank * 0.1 for i in range(len(phases))],
             [run["bytes_per_step"][p]["sent"][rank] / 1024 for p in phases], width=0.1, label=f"rank {rank}")
left.set_xticks([i + 0.35 for i in range(len(phases))], phases, fontsize=8)
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
# ## 7. Orthogonalize each matrix once: the owner and comm-free strategies
#
# The gather flow repeats Newton–Schulz on every rank that touches a matrix. `OwnerMuon` gives each
# matrix one owner, chosen by longest-processing-time over Newton–Schulz FLOPs; `CommFreeMuon` also
# keeps each matrix whole on its owner's DP row. Both are section 5's optimizer with another strategy as
# its part (`Owner()`, `CommFree()`): stage 3 replaced, every other stage the optimizer's own
# (`distmuon/owners.py`, the lesson's section 7 in a file of its own, draws their data paths and the
# overlapped step). The assignment, and what it gives with 8 layers:
# 40 matrices spread evenly over 8 ranks.

# %%
muon_tools.show_source(owners.assign_owners)
plan = muon_tools.plan_optimizer(muon_tools.RunConfig(dp=8, tp=1, layers=8, strategy="owner"))
per_rank, balance = owners.load_balance(plan.strategy.ns_flops, plan.owners, 8)
rows = [[r, sum(o == r for o in plan.owners.values()), f"{per_rank[r] / 1e9:.3f}"] for r in range(8)]
print(muon_tools.format_table(["rank", "matrices owned", "Newton-Schulz GFLOP"], rows, [">", ">", ">"]))
print(f"max / mean = {balance:.2f}")

# %% [markdown]
# ## 8. What large runs add: blocks, Polar Express, QK-clip, Newton-Schulz on TP pieces
#
# `torch.optim.Muon` runs one fixed polynomial five times on each whole matrix and does nothing after
# the update. Large runs do four things more, each an option of the optimizers (`ns_coefficients`,
# and a `distmuon.large_runs.LargeRuns`) and a flag of the script; the default keeps torch's behaviour.
# Chapter 9 of `notes/` draws what each moves between ranks. Here, each one's own code, run.
#
# **Per-iteration coefficients.** `ns_coefficients="polar_express"` (`--ns-coefficients
# polar_express`) gives each iteration its own (a, b, c) (Polar Express, arXiv 2505.16932): the
# same matmuls, so the same FLOPs and bytes, and the singular values of a matrix whose spectrum
# spans three decades, as a gradient's does, land closer to 1 in five iterations:

# %%
muon_tools.show_source(checks.ns_coefficients_of)
gen = torch.Generator().manual_seed(2)
left, _ = torch.linalg.qr(torch.randn(512, 128, generator=gen))
right, _ = torch.linalg.qr(torch.randn(128, 128, generator=gen))
spread = left @ torch.diag(torch.logspace(0, -3, 128)) @ right.T  # singular values 1 down to 0.001
for name in checks.NS_COEFFICIENT_CHOICES:
    sv = torch.linalg.svdvals(distributed_muon_cpu.newton_schulz(spread, coefficients=name).float())
    first = checks.ns_coefficients_of(name, distributed_muon_cpu.NS_STEPS)[0]
    print(f"{name:<14} first (a, b, c) = ({first[0]:.3f}, {first[1]:.3f}, {first[2]:.3f}): "
          f"singular values after {distributed_muon_cpu.NS_STEPS} iterations {sv.min():.3f} to {sv.max():.3f}")

# %% [markdown]
# **Fused blocks.** A fused QKV weight laid out head by head (q, k, v of head 0, then of head 1, …)
# orthogonalized whole is not what Q, K and V would get as three parameters. `RowLayout` names the
# rows; `ns_blocks="blocks"` (`--ns-blocks blocks`) orthogonalizes Q, K and V each alone, `"heads"`
# each head's q, k and v alone. Each block is exactly `newton_schulz` of those rows as a separate
# matrix, so `torch.optim.Muon` on the blocks as separate parameters gives the same bits. Under TP
# (split on dim 0, by heads) each TP rank holds whole heads.

# %%
muon_tools.show_source(large_runs.newton_schulz_blocks)
heads, head_dim, d_model = 4, 16, 64
layout = large_runs.RowLayout(sizes=(head_dim,) * 3, periods=heads, names=("q", "k", "v"))
fused = torch.randn(layout.rows, d_model, generator=gen)
blocks = layout.blocks()  # row indices of Q, K and V across the heads
as_blocks, as_whole = large_runs.newton_schulz_blocks(fused, blocks), distributed_muon_cpu.newton_schulz(fused)
for name, rows in zip(layout.names, blocks):
    alone = distributed_muon_cpu.newton_schulz(fused[rows])
    runs = " ".join(f"{rows[i]}-{rows[i + head_dim - 1]}" for i in range(0, len(rows), head_dim))
    print(f"{name}: rows {runs}; torch.equal with its block alone: "
          f"{torch.equal(as_blocks[rows], alone)}; max |whole - blocks| {(as_whole[rows].float() - alone.float()).abs().max():.3f}")
print(f"per head: {len(layout.blocks(per_head=True))} blocks of {head_dim} rows; "
      f"each TP rank of 2 holds {layout.tp_piece(2).periods} heads, {layout.tp_piece(2).rows} rows")

# %% [markdown]
# **QK-clip.** After the step, every head whose largest pre-softmax logit S exceeded τ has its rows
# of W_q and of W_k each multiplied by √(τ / S) (Kimi K2, arXiv 2507.20534), so its logits shrink by
# τ / S: that head's largest logit on the same input becomes τ (under GQA, where query heads share a key,
# each query head's rows take τ / S and the shared key is left alone). A head's maxima come from every
# rank that computed it (its TP rank, on every DP rank's batch), so `optimizer.clip_qk_(max_logits)`
# brings them together first: one MAX all-reduce over every rank of one float32 per head (−∞ where the
# rank computed none) and, last, the rank that refused its input, if any:
#
# ```
#   DP 0, TP 0: [a0 a1 −∞ −∞ | 0] ─┐
#   DP 0, TP 1: [−∞ −∞ a2 a3 | 0] ─┤
#   DP 1, TP 0: [b0 b1 −∞ −∞ | 0] ─┼─ all-reduce MAX ─► S_h ─► every rank: its rows of head h × √min(1, τ/S_h)
#   DP 1, TP 1: [−∞ −∞ b2 b3 | 0] ─┘
# ```

# %%
muon_tools.show_source(large_runs.qk_clip_scales)
tau = 3.0
w_q, w_k = (torch.randn(heads * head_dim, d_model, generator=gen, dtype=torch.float64) / 8 for _ in range(2))
tokens = torch.randn(8, d_model, generator=gen, dtype=torch.float64)
w_q[:head_dim] *= 4  # heads 0 and 1: logits that grew
w_q[head_dim:2 * head_dim] *= 2


def max_logits(w_q, w_k):  # per head: max over token pairs of q.k / sqrt(head_dim)
    q, k = (tokens @ w_q.T).view(8, heads, head_dim), (tokens @ w_k.T).view(8, heads, head_dim)
    return torch.einsum("ihd,jhd->hij", q, k).amax(dim=(1, 2)) / head_dim**0.5


before = max_logits(w_q, w_k)
scales = large_runs.qk_clip_scales(before, tau)
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
# That is `large_runs.newton_schulz_tp`, run here on the two ranks of a TP 2 grid (threads, real Gloo
# groups, as in section 4). The identity is exact in real numbers; in float32 the sum runs in
# another order than torch's one matmul, so now and then a near-tie rounds to the other bf16
# neighbour, and the later iterations carry it on: close to torch's bits, usually not equal to them.

# %%
muon_tools.show_source(large_runs.newton_schulz_tp)
equal, worst = 0, 0
for _ in range(8):
    wide = torch.randn(64, 1024, generator=gen)
    pieces = muon_tools.on_thread_ranks(1, 2, lambda g: large_runs.newton_schulz_tp(
        wide.chunk(2, dim=1)[g.tp.rank], wide.shape, g.tp, distributed_muon_cpu.Ledger()))
    ours = torch.cat(pieces, dim=1)
    theirs = torch.optim._muon._zeropower_via_newtonschulz(wide, distributed_muon_cpu.NS_COEFFICIENTS, distributed_muon_cpu.NS_STEPS,
                                                           distributed_muon_cpu.NS_EPS)
    top = theirs.float().abs().max()
    spacing = torch.finfo(torch.bfloat16).eps * 2 ** top.log2().floor()  # between bf16 numbers just below `top`
    equal += torch.equal(ours, theirs)
    worst = max(worst, int((ours.float() - theirs.float()).abs().max() / spacing))
print(f"Newton-Schulz on 2 TP pieces against torch's on the whole, 8 matrices of 64x1024: torch.equal on {equal} "
      f"of 8; max |d| {worst} bf16 steps at the largest entries")

# %% [markdown]
# Next, `distributed_muon_runs.ipynb` runs the script more: every grid of 8 ranks, the strategies
# side by side, and a real tensor-parallel GPT trained with the optimizer. `notes/README.md` orders
# the chapters that explain each idea with its measured figures; `python distributed_muon_cpu.py
# --help` lists every flag, and `notes/running.md` what a run prints, line by line.
