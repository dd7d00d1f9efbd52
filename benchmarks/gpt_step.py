"""Where a training step's time and bytes go: examples/train_gpt.py traced with torch.profiler for
every Muon strategy and for AdamW ZeRO-1, on the same grid, model and batches (like for like).

    python benchmarks/gpt_step.py                          # DP=4 x TP=2, 8 steps each
    python benchmarks/gpt_step.py --dp 2 --tp 2 --traces traces/ --json step.json --figure step.png

Each run writes Chrome traces (open them in ui.perfetto.dev) for steps 4-6 of every rank. The
time split is read back from the record_function labels: forward, backward, and inside the
optimizer step the lesson's phases (collectives by their ledger names, newton-schulz, state
update = momentum and AdamW); "other" is the rest of the optimizer step (copies into and out
of buckets, the grad-presence vote). Gloo's collectives are synchronous here, so a
collective's time includes waiting for the slowest peer. Bytes are the ledgers' ring counts.
"""

import os
import statistics
import sys
import tempfile

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

from gpt_bench import pyplot  # noqa: E402
from distmuon import owners  # noqa: E402
import muon_tools  # noqa: E402
from examples import train_gpt  # noqa: E402
from gpt_bench import main as benchmark_main  # noqa: E402
KINDS = owners.STRATEGIES + (muon_tools.BASELINE,)
LABELS = {**{s: f"Muon, {s}" for s in owners.STRATEGIES}, muon_tools.BASELINE: "AdamW ZeRO-1"}
EXCHANGES = ("DP gather", "TP gather", "gather at owner", "scatter from owner", "grad reduce at owner",
             "update broadcast from owner")
PARTS = ("forward", "backward", "grad reduce-scatter", "exchanges", "newton-schulz", "state update",
         "param all-gather", "other")


def split_of(time_split):
    """The PARTS of one rank's step, in ms, from time_split's labels."""
    t = {k: time_split.get(k, 0.0) for k in ("forward", "backward", "optimizer step", "grad reduce-scatter",
                                             "newton-schulz", "state update", "param all-gather")}
    t["exchanges"] = sum(time_split.get(k, 0.0) for k in EXCHANGES)
    inner = sum(t[k] for k in ("grad reduce-scatter", "exchanges", "newton-schulz", "state update",
                               "param all-gather"))
    t["other"] = max(t.pop("optimizer step") - inner, 0.0)
    return t


def measure(dp, tp, steps, traces, print_fn=print):
    configs = [train_gpt.TrainConfig(dp=dp, tp=tp, steps=steps,
                                     optimizer="adamw" if k == muon_tools.BASELINE else "muon",
                              strategy="gather" if k == muon_tools.BASELINE else k, progress=False,
                              profile=os.path.join(traces, k)) for k in KINDS]
    for cfg in configs:  # before the header: a refusal is one line
        train_gpt.validate(cfg)
    print_fn(train_gpt.header(configs[0]).splitlines()[0].split(";")[0] + f"; DP={dp} x TP={tp}, {steps} steps each")
    runs = {}
    for kind, (cfg, results) in zip(KINDS, train_gpt.train_many(configs)):
        summary = train_gpt.summarize(cfg, results)
        splits = [split_of(train_gpt.time_split(os.path.join(cfg.profile, f"rank{r['rank']}.json"))) for r in results]
        mean = {p: statistics.fmean(s[p] for s in splits) for p in PARTS}
        table = summary["bytes_per_step"]
        runs[kind] = dict(split_ms=mean, step_ms=summary["ms"]["step"], optimizer_ms=summary["ms"]["optimizer"],
                          tp_bytes=sum(max(table[p]["sent"]) for p in train_gpt.TP_PHASES),
                          optimizer_bytes=summary["optimizer_bytes_sent_max_rank"], traces=cfg.profile)
    return runs


def report(runs, print_fn=print):
    rows = []
    for kind, r in runs.items():
        s = r["split_ms"]
        optimizer = sum(s[p] for p in PARTS[2:])
        rows.append([LABELS[kind]] + [f"{s[p]:.0f}" for p in PARTS] + [f"{optimizer / sum(s.values()):.0%}"])
    print_fn("\nTime per step, ms (traced steps 4-6, mean over ranks):")
    print_fn(muon_tools.format_table(["run"] + list(PARTS) + ["optimizer share"], rows,
                                     ["<"] + [">"] * (len(PARTS) + 1)))
    base = runs[muon_tools.BASELINE]
    rows = [[LABELS[k], muon_tools.human_bytes(r["optimizer_bytes"]),
             f"{r['optimizer_bytes'] / base['optimizer_bytes']:.2f}",
             muon_tools.human_bytes(r["tp_bytes"]), f"{r['optimizer_ms']:.0f}", f"{r['optimizer_ms'] / base['optimizer_ms']:.2f}",
             f"{r['step_ms']:.0f}", f"{r['step_ms'] / base['step_ms']:.2f}"] for k, r in runs.items()]
    print_fn("\nLike for like: the same grid, model, batches and ZeRO-1 sharding (max over ranks; times are medians "
             "from step 3, slowest rank):")
    print_fn(muon_tools.format_table(["run", "optimizer bytes sent/rank", "x AdamW", "TP bytes/rank", "optimizer ms",
                              "x AdamW", "step ms", "x AdamW"], rows, ["<"] + [">"] * 7))


def plot(runs, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    colors = plt.get_cmap("tab10").colors
    names = [LABELS[k] for k in runs]
    left = [0.0] * len(runs)
    for i, part in enumerate(PARTS):
        widths = [r["split_ms"][part] for r in runs.values()]
        ax.barh(names, widths, left=left, color=colors[i], label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean over ranks)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    muon_tools.save_figure(fig, path, dpi=110)


def main(argv=None):
    p = muon_tools.OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--traces", metavar="DIR", help="keep the traces here (default: a temporary folder)")

    def measure_and_report(a):
        if a.traces:
            muon_tools.check_writable(a.traces, "--traces", folder=True)
        with tempfile.TemporaryDirectory(prefix="gpt-traces-") as scratch:
            runs = measure(a.dp, a.tp, a.steps, a.traces or scratch)
        report(runs)
        return runs

    return benchmark_main(p, measure_and_report, plot, argv)


if __name__ == "__main__":
    sys.exit(main())
