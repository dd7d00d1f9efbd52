"""Muon against AdamW on examples/train_gpt.py's task: a learning-rate sweep for each, the same
token budget, validation-loss curves, and how many steps each needs to reach the same loss.

    python benchmarks/gpt_lr_sweep.py                         # 4 lrs x 2 optimizers, 200 steps, DP=2: ~5 min on 2 cores
    python benchmarks/gpt_lr_sweep.py --muon-lrs 0.01 0.03 --adamw-lrs 0.001 0.003 --steps 400 --json s.json --figure s.png

Both optimizers get the same model, batches, steps and constant learning rate (Muon uses
adjust_lr_fn "match_rms_adamw", so one lr means the same update size for both; its
embeddings, norms and biases take AdamW at that lr). The target is the best AdamW run's final
validation loss; "steps to target" is the first evaluation at or below it. The runs use
DP=2 x TP=1, which trains exactly as one process does (tests/test_gpt.py), on both cores.
"""

import argparse
import sys

from gpt_bench import mt, pyplot, tg
from gpt_bench import main as benchmark_main


def steps_to(val, target):
    """The first evaluated step whose validation loss is <= target (None if never)."""
    return next((step for step, loss in val if loss <= target), None)


def sweep(lrs, steps, dp, tp, every, val_windows, print_fn=print):
    """lrs: {optimizer: [learning rates]}."""
    configs = [tg.TrainConfig(dp=dp, tp=tp, optimizer=o, strategy="owner" if o == "muon" else "gather", lr=lr,
                              steps=steps, log_every=every, val_windows=val_windows, progress=False)
               for o in tg.OPTIMIZER_NAMES for lr in lrs[o]]
    print_fn(tg.header(configs[0]).splitlines()[0].split(";")[0] + f"; {steps} steps; validation: "
             f"{val_windows} windows every {every} steps")
    runs = []
    for cfg, results in tg.train_many(configs):
        summary = tg.summarize(cfg, results)
        runs.append(dict(optimizer=cfg.optimizer, lr=cfg.lr, val=summary["val"], losses=summary["losses"],
                         final_val=summary["val"][-1][1], ms_step=summary["ms"]["step"]))
    best = {o: min((r for r in runs if r["optimizer"] == o), key=lambda r: r["final_val"]) for o in tg.OPTIMIZER_NAMES}
    target = best["adamw"]["final_val"]
    for r in runs:
        r["steps_to_target"] = steps_to(r["val"], target)
    rows = [[r["optimizer"], f"{r['lr']:g}", f"{r['final_val']:.3f}", str(r["steps_to_target"] or "-"),
             "best" if r is best[r["optimizer"]] else ""] for r in runs]
    print_fn("\n" + mt.format_table(["optimizer", "lr", f"val loss @ {steps}", "steps to AdamW's best", ""],
                                    rows, ["<", ">", ">", ">", "<"]))
    muon_steps = best["muon"]["steps_to_target"]
    ratio = best["adamw"]["steps_to_target"] / muon_steps if muon_steps else None
    print_fn(f"\nTarget: AdamW's best final validation loss {target:.3f} (lr {best['adamw']['lr']:g}). Best Muon "
             f"(lr {best['muon']['lr']:g}) reaches it at step {muon_steps}, AdamW at step "
             f"{best['adamw']['steps_to_target']}: " + (f"{ratio:.2f}x fewer steps" if ratio else "never"))
    print_fn(f"Best Muon's final validation loss: {best['muon']['final_val']:.3f}; median step: Muon "
             f"{best['muon']['ms_step']:.0f} ms, AdamW {best['adamw']['ms_step']:.0f} ms (DP={dp} x TP={tp}, CPU)")
    return dict(runs=runs, target=target, steps_ratio=ratio, best={o: (b["lr"]) for o, b in best.items()})


def plot(result, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {"muon": "tab:blue", "adamw": "tab:orange"}
    for r in result["runs"]:
        best = result["best"][r["optimizer"]] == r["lr"]
        steps, losses = zip(*r["val"])
        ax.plot(steps, losses, color=colors[r["optimizer"]], alpha=1.0 if best else 0.35, lw=2 if best else 1,
                label=f"{'Muon' if r['optimizer'] == 'muon' else 'AdamW'} lr {r['lr']:g}")
    ax.axhline(result["target"], color="gray", ls=":", lw=1, label="AdamW's best final loss")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title("GPT on the standard library's sources: Muon vs AdamW, same tokens")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[0.003, 0.01, 0.03, 0.1])
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[0.0003, 0.001, 0.003, 0.01])
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10, help="steps between validation losses")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    return benchmark_main(p, lambda a: sweep(dict(muon=a.muon_lrs, adamw=a.adamw_lrs), a.steps, a.dp, a.tp, a.every,
                                             a.val_windows), plot, argv)


if __name__ == "__main__":
    sys.exit(main())
