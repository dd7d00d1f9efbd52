"""Eight ranks split four ways, 8x1, 4x2, 2x4, 1x8 (DP x TP): step time and bytes per step of
examples/train_gpt.py, Muon (owner strategy) and AdamW ZeRO-1, on the same model and batches.

    python benchmarks/gpt_splits.py                        # 12 steps per run
    python benchmarks/gpt_splits.py --steps 20 --json splits.json --figure splits.png

The model has 8 heads so that TP = 8 keeps one head per rank. Times are medians from step 3
(slowest rank); bytes are ring counts per rank (max over ranks), split into TP's activation
all-reduces (f and g) and the optimizer's collectives.
"""

import sys

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

from gpt_bench import pyplot  # noqa: E402
import muon_tools  # noqa: E402
from examples import train_gpt  # noqa: E402
from gpt_bench import main as benchmark_main  # noqa: E402

SPLITS = ((8, 1), (4, 2), (2, 4), (1, 8))
OPTIMIZERS = ("muon", "adamw")  # Muon against its baseline (NorMuon's place: gpt_lr_sweep.py --normuon-lrs)


def measure(steps, heads, print_fn=print):
    splits = [[train_gpt.TrainConfig(dp=dp, tp=tp, steps=steps, heads=heads, progress=False, optimizer=o,
                              strategy="owner" if o == "muon" else "gather") for o in OPTIMIZERS]
              for dp, tp in SPLITS]
    for cfg in (cfg for configs in splits for cfg in configs):  # all of them before the first rank starts
        train_gpt.validate(cfg)
    print_fn(train_gpt.header(train_gpt.TrainConfig(heads=heads)).splitlines()[0].split(";")[0] + f"; {steps} steps per run")
    rows = []
    for (dp, tp), configs in zip(SPLITS, splits):
        for cfg, results in train_gpt.train_many(configs):
            s = train_gpt.summarize(cfg, results)
            rows.append(dict(dp=dp, tp=tp, optimizer=cfg.optimizer, step_ms=s["ms"]["step"],
                             compute_ms=s["ms"]["forward"] + s["ms"]["backward"], optimizer_ms=s["ms"]["optimizer"],
                             tp_bytes=sum(max(s["bytes_per_step"][p]["sent"]) for p in train_gpt.TP_PHASES),
                             optimizer_bytes=s["optimizer_bytes_sent_max_rank"]))
    return rows


def report(rows, print_fn=print):
    table = [[f"{r['dp']}x{r['tp']}", "Muon" if r["optimizer"] == "muon" else "AdamW", f"{r['step_ms']:.0f}",
              f"{r['compute_ms']:.0f}", f"{r['optimizer_ms']:.0f}", muon_tools.human_bytes(r["tp_bytes"]),
              muon_tools.human_bytes(r["optimizer_bytes"]), muon_tools.human_bytes(r["tp_bytes"] + r["optimizer_bytes"])]
             for r in rows]
    print_fn("\n" + muon_tools.format_table(["DP x TP", "optimizer", "step ms", "fwd+bwd ms", "optimizer ms",
                                     "TP bytes/rank", "optimizer bytes/rank", "total bytes/rank"],
                                    table, ["<", "<"] + [">"] * 6))
    for o in OPTIMIZERS:
        best = min((r for r in rows if r["optimizer"] == o), key=lambda r: r["step_ms"])
        print_fn(f"Fastest for {'Muon' if o == 'muon' else 'AdamW'}: {best['dp']}x{best['tp']} "
                 f"({best['step_ms']:.0f} ms per step)")


def plot(rows, path):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    names = [f"{dp}x{tp}" for dp, tp in SPLITS]
    x = range(len(names))
    for i, (o, color) in enumerate((("muon", "tab:blue"), ("adamw", "tab:orange"))):
        mine = [r for r in rows if r["optimizer"] == o]
        left.bar([v + (i - 0.5) * 0.38 for v in x], [r["step_ms"] for r in mine], 0.38, color=color,
                 label="Muon (owner)" if o == "muon" else "AdamW ZeRO-1")
    left.set_xticks(list(x), names)
    left.set_xlabel("DP x TP (8 ranks)")
    left.set_ylabel("ms per step (median)")
    left.legend(fontsize=8)
    muon = [r for r in rows if r["optimizer"] == "muon"]
    mib = 2.0**20
    right.bar(names, [r["tp_bytes"] / mib for r in muon], color="tab:green", label="TP all-reduces (f, g)")
    right.bar(names, [r["optimizer_bytes"] / mib for r in muon], bottom=[r["tp_bytes"] / mib for r in muon],
              color="tab:blue", label="optimizer (Muon, owner)")
    right.set_xlabel("DP x TP (8 ranks)")
    right.set_ylabel("MiB sent per rank per step")
    right.legend(fontsize=8)
    fig.tight_layout()
    muon_tools.save_figure(fig, path, dpi=110)


def main(argv=None):
    p = muon_tools.OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--heads", type=int, default=8)

    def measure_and_report(a):
        rows = measure(a.steps, a.heads)
        report(rows)
        return rows

    return benchmark_main(p, measure_and_report, plot, argv)


if __name__ == "__main__":
    sys.exit(main())
