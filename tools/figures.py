"""Draw the lesson's two pictures from its own code: the virtual buffer of the Muon group, and what the gather flow's
arrows leave on each rank.

    python tools/figures.py                    # writes notes/figures/virtual_buffer.png and notes/figures/flow.png
    python tools/figures.py --out-dir DIR      # elsewhere (a folder it may create)

Both come from a small run's plan, DP 2 x TP 2, the demo transformer at d = 16 with one layer and buckets of 1,024
elements (RUN): small enough to see every element, and laid out so that the first Muon bucket holds three matrices,
a tall one split by rows that straddles the two DP shards, a square one split by columns, and a wide one TP does
not split. The flow's picture runs the lesson's own arrows (dp_gather, matrix_in_bucket, tp_gather, tp_shard,
dp_shard) on four thread ranks over real Gloo groups (muon_tools.on_thread_ranks), on a bucket whose every element
carries its own index, and reads back which elements of each full matrix every rank holds after each arrow.
The notebook (distributed_muon_cpu.nb.py, sections 3 and 4) draws the same two figures with these functions.
"""

import argparse
import os
import sys

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import torch  # noqa: E402

import distributed_muon_cpu  # noqa: E402
import muon_tools  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "notes", "figures")
RUN = muon_tools.RunConfig(dp=2, tp=2, d_model=16, layers=1, bucket_size=1024)
STAGES = ("its DP shard", "DP gather", "TP gather", "Newton-Schulz", "TP shard", "DP shard")
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan", "tab:gray")


def layout_of(cfg=RUN):
    """The layout every rank of cfg's run plans (the optimizer rank 0 builds: buckets and every DP rank's metas)."""
    return muon_tools.plan_optimizer(cfg).layout


def draw_virtual_buffer(layout, fig, buffer_idx=0):
    """The buckets of one param group's virtual buffer (the Muon group's: buffer 0), a row each at its own scale:
    a segment per TP-local parameter, the padding hatched, the DP shard boundaries and the rank that keeps each."""
    dp = layout.dp
    buckets = [b for b in layout.buckets if b.buffer_idx == buffer_idx]
    axes = fig.subplots(len(buckets), 1, squeeze=False)[:, 0]
    names = list(dict.fromkeys(n for b in buckets for n in b.names))
    for ax, b in zip(axes, buckets):
        for name in b.names:
            start, end = layout.bucket_ranges[name]
            ax.barh(0, end - start, left=start, height=0.6, color=COLOURS[names.index(name) % len(COLOURS)],
                    edgecolor="black", linewidth=0.5)
            short = name.split(".", 2)[-1] if name.startswith("layers.") else name
            ax.text((start + end) / 2, 0, f"{short}\n{'x'.join(map(str, layout.shapes[name]))} of "
                                          f"{'x'.join(map(str, layout.global_shapes[name]))}",
                    ha="center", va="center", fontsize=7, color="white")
        if b.numel > b.used:
            ax.barh(0, b.numel - b.used, left=b.used, height=0.6, color="white", hatch="///", edgecolor="gray")
        for r in range(dp):
            lo, hi = b.shard_range(r, dp)
            ax.axvline(lo, color="black", linewidth=1.5)
            ax.text((lo + hi) / 2, -0.45, f"DP rank {r}: [{lo}, {hi})", ha="center", va="top", fontsize=7)
        ax.axvline(b.numel, color="black", linewidth=1.5)
        ax.set_xlim(0, b.numel)
        ax.set_ylim(-0.8, 0.45)
        ax.set_yticks([0], [f"bucket ({b.buffer_idx}, {b.bucket_idx})"], fontsize=8)
        ax.set_xticks([])
    fig.suptitle(f"The virtual buffer of the Muon group, on every TP rank (its TP pieces, flattened one after "
                 f"another): DP = {dp} shards of each bucket", fontsize=9)


def flow_holdings(cfg=RUN, bucket_index=0):
    """[rank][stage] -> {matrix: bool mask over its FULL shape}: which elements each rank holds after each arrow of
    the gather flow, for the first Muon bucket (or bucket `bucket_index` of the Muon buffer). Every element of a
    full matrix carries its own index (float64: exact), cut as the optimizer cuts the update (tp_shard, dp_shard,
    shard_of_bucket); the lesson's arrows move the indices; Newton-Schulz, a computation on the full matrix,
    leaves the rank holding what the TP gather gave it."""
    layout = layout_of(cfg)
    bucket = [b for b in layout.buckets if b.buffer_idx == 0][bucket_index]
    shapes = {n: layout.global_shapes[n] for n in bucket.names}
    offset, ids = 0, {}
    for n in bucket.names:  # every element of every full matrix, numbered across the bucket's matrices
        ids[n] = torch.arange(offset, offset + torch.Size(shapes[n]).numel(), dtype=torch.float64).view(shapes[n])
        offset += ids[n].numel()
    where = {n: (sum(torch.Size(shapes[m]).numel() for m in bucket.names[:i]), shapes[n])
             for i, n in enumerate(bucket.names)}

    def masks(*tensors):
        held = {n: torch.zeros(shapes[n], dtype=torch.bool) for n in bucket.names}
        for t in tensors:
            for i in t.reshape(-1).long().tolist():
                n = next(n for n, (start, s) in where.items() if start <= i < start + torch.Size(s).numel())
                held[n].view(-1)[i - where[n][0]] = True
        return held

    def rank(grid):
        metas = [layout.metas[grid.dp.rank][n] for n in bucket.names]
        tp_pieces = {m.name: distributed_muon_cpu.tp_shard(ids[m.name], m.tp_split_dim, grid.tp.rank, grid.tp.size)
                     for m in metas}
        parts = {m.name: distributed_muon_cpu.dp_shard(tp_pieces[m.name], m) for m in metas}
        shard = distributed_muon_cpu.shard_of_bucket(parts, metas, bucket.numel // grid.dp.size, torch.float64, "cpu")
        ledger, touched = distributed_muon_cpu.Ledger(), [m for m in metas if m.local_numel]
        whole_bucket = distributed_muon_cpu.dp_gather(shard, grid.dp, ledger)
        tp_locals = [distributed_muon_cpu.matrix_in_bucket(whole_bucket, m) for m in metas]
        fulls = [distributed_muon_cpu.tp_gather(distributed_muon_cpu.matrix_in_bucket(whole_bucket, m), m.tp_split_dim,
                                                grid.tp, ledger) for m in touched]
        pieces = [distributed_muon_cpu.tp_shard(f, m.tp_split_dim, grid.tp.rank, grid.tp.size) for f,
                  m in zip(fulls, touched)]
        own = [distributed_muon_cpu.dp_shard(p, m) for p, m in zip(pieces, touched)]
        return [masks(*parts.values()), masks(*tp_locals), masks(*fulls), masks(*fulls), masks(*pieces), masks(*own)]

    return bucket, muon_tools.on_thread_ranks(cfg.dp, cfg.tp, rank)


def draw_flow(bucket, holdings, fig):
    """A row per rank, a column per stage: the bucket's full matrices side by side, each element coloured where
    the rank holds it (darker once orthogonalized), grey where it does not."""
    from matplotlib.colors import to_rgb

    names = list(bucket.names)
    shapes = {n: tuple(holdings[0][0][n].shape) for n in names}
    width = sum(s[1] for s in shapes.values()) + 2 * (len(names) - 1)
    height = max(s[0] for s in shapes.values())
    axes = fig.subplots(len(holdings), len(STAGES), squeeze=False)
    for r, stages in enumerate(holdings):
        for c, held in enumerate(stages):
            ax = axes[r][c]
            picture = torch.ones(height, width, 3)
            x = 0
            for i, n in enumerate(names):
                rows, cols = shapes[n]
                colour = torch.tensor(to_rgb(COLOURS[i % len(COLOURS)]))
                if c >= 3:  # Newton-Schulz and after: the orthogonalized matrix
                    colour = colour * 0.55
                block = torch.where(held[n].unsqueeze(-1), colour, torch.tensor([0.88, 0.88, 0.88]))
                picture[:rows, x:x + cols] = block
                x += cols + 2
            ax.imshow(picture.numpy(), interpolation="nearest", aspect="auto")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(("" if c == 0 else "-> ") + STAGES[c], fontsize=8)
            if c == 0:
                ax.set_ylabel(f"rank {r}", fontsize=8)
    labels = ", ".join(f"{n.split('.', 2)[-1]} {'x'.join(map(str, shapes[n]))}" for n in names)
    fig.suptitle(f"The gather flow, bucket ({bucket.buffer_idx}, {bucket.bucket_idx}): what each arrow leaves on each "
                 f"rank, left to right in each panel: {labels}", fontsize=9)


def main(argv=None):
    p = muon_tools.OneLineParser(description="Draw the lesson's virtual buffer and gather-flow figures into notes/figures.")
    p.add_argument("--out-dir", default=OUT_DIR, help="the folder to write them into (default %(default)s)")
    args = p.parse_args(argv)

    def work():
        muon_tools.check_writable(args.out_dir, "--out-dir", folder=True)
        from matplotlib import pyplot

        os.makedirs(args.out_dir, exist_ok=True)
        layout = layout_of()
        fig = pyplot.figure(figsize=(11, 2.2))
        draw_virtual_buffer(layout, fig)
        written = [os.path.join(args.out_dir, "virtual_buffer.png")]
        muon_tools.write_atomically(written[-1], lambda f: fig.savefig(f, format="png", dpi=110))
        bucket, holdings = flow_holdings()
        fig = pyplot.figure(figsize=(12, 1.5 * len(holdings) + 0.8))
        draw_flow(bucket, holdings, fig)
        written.append(os.path.join(args.out_dir, "flow.png"))
        muon_tools.write_atomically(written[-1], lambda f: fig.savefig(f, format="png", dpi=110))
        print("wrote " + " and ".join(os.path.relpath(w) for w in written))
        return 0

    return muon_tools.exit_code(work)


if __name__ == "__main__":
    sys.exit(main())
