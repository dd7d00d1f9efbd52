"""Muon against AdamW on examples/train_gpt.py's task, over seeds: a learning-rate grid for each,
constant and warm-up + cosine schedules, the same token budget, and how many steps Muon needs
to reach AdamW's best validation loss, as a spread over seeds; with --normuon-lrs, NorMuon
(arXiv 2510.05491) beside Muon, read the same way.

    python benchmarks/gpt_lr_sweep.py   # (5 + 6 lrs) x 2 schedules x 5 seeds = 110 runs of 200 steps
    python benchmarks/gpt_lr_sweep.py --muon-lrs 0.02 0.03 0.05 --adamw-lrs 0.001 0.002 0.003 --seeds 0 1 2 \\
        --schedules constant --json s.json --figure s.png
    python benchmarks/gpt_lr_sweep.py --from-json s.json --figure s.png   # report saved (even partial) runs again
    python benchmarks/gpt_lr_sweep.py --normuon-lrs 0.01 0.02 0.03 0.05 --muon-lrs 0.01 0.02 0.03 0.05 \
        --adamw-lrs 0.001 0.0014 0.002 --seeds 0 1 2   # NorMuon beside Muon: 66 runs

Both optimizers get the same model, batches, steps and learning-rate schedule (Muon uses
adjust_lr_fn "match_rms_adamw", so one lr means the same update size for both; its embeddings,
norms and biases take AdamW at that lr; NorMuon, the same groups and options, with its own beta2 and eps
at the authors' defaults). A seed sets the initial weights and the batches.

How the comparison is read, for each schedule:
  * each optimizer's lr is the one whose final validation loss, averaged over the seeds, is
    lowest ("tuned once"); it is bracketed when the grid has a worse lr on both sides;
  * at each seed, the target is that AdamW run's final validation loss, and "steps to AdamW's
    best loss" is the first evaluation at or below it, for Muon and for AdamW itself;
  * the spread over seeds is printed as min-median-max, and again with each seed's own best lr
    ("tuned per seed"), which is what a single-seed sweep reports;
  * with several schedules, also Muon's steps to AdamW's best final loss over all of them.
The runs use DP=2 x TP=1, which trains exactly as one process does (tests/test_gpt.py). --json is
rewritten after every (seed, schedule) group, so an interrupted sweep keeps what it finished.
"""

import argparse
import json
import statistics
import sys
from dataclasses import replace

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

from gpt_bench import pyplot  # noqa: E402
import muon_tools  # noqa: E402
from examples import train_gpt  # noqa: E402
from gpt_bench import main as benchmark_main  # noqa: E402

COLORS = {"muon": "tab:blue", "normuon": "tab:green", "adamw": "tab:orange"}
LABELS = {"muon": "Muon", "normuon": "NorMuon", "adamw": "AdamW"}
MATRIX_OPTIMIZERS = ("muon", "normuon")  # each read against AdamW's loss
ZOOM_TOP = 3.2  # nats per byte: the plot's top, about where the default runs are by step 20


def optimizers_in(runs):
    """The optimizers that runs trained, in train_gpt's order."""
    return [o for o in train_gpt.OPTIMIZER_NAMES if any(r["optimizer"] == o for r in runs)]


def steps_to(val, target):
    """The first evaluated step whose validation loss is <= target (None if never)."""
    return next((step for step, loss in val if loss <= target), None)


def spread(values):
    """'min-median-max' of numbers (None, never reached, counts as missing)."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    missing = len(values) - len(known)
    text = "-".join(f"{v:.3g}" for v in (min(known), statistics.median(known), max(known)))
    return text + (f" ({missing} never)" if missing else "")


def train(a, model=train_gpt.TrainConfig(), save=None, print_fn=print):
    """Every (schedule, seed, optimizer, lr) of the grid, the model's sizes taken from `model`;
    one spawn per (seed, schedule), save(what --json holds) after each; [run dicts]."""
    lrs = dict(muon=a.muon_lrs, normuon=a.normuon_lrs, adamw=a.adamw_lrs)
    base = replace(model, dp=a.dp, tp=a.tp, steps=a.steps, log_every=a.every, val_windows=a.val_windows,
                   progress=False)
    warmup = {"warmup-cosine": dict(warmup_steps=a.warmup_steps)}  # a constant schedule takes none (train_gpt.validate)
    # seed by seed: an interrupted sweep has both schedules at the seeds it finished
    groups = {(seed, schedule): [replace(base, optimizer=o, strategy="gather" if o == "adamw" else "owner", lr=lr,
                                         schedule=schedule, seed=seed, **warmup.get(schedule, {}))
                                 for o in train_gpt.OPTIMIZER_NAMES for lr in lrs[o]]
              for seed in a.seeds for schedule in a.schedules}
    for configs in groups.values():  # every configuration is checked before the first rank starts
        for cfg in configs:
            train_gpt.validate(replace(cfg, lr=model.lr))  # the rest of the run, at train_gpt's own lr
            try:
                train_gpt.validate(cfg)
            except ValueError as e:  # then the lr's refusal, in train_gpt's words, said of the sweep's flag
                raise ValueError(f"--{cfg.optimizer}-lrs {cfg.lr:g}: {e}") from None
    print_fn(train_gpt.header(base).splitlines()[0].split(";")[0] + f"; {a.steps} steps; validation: {a.val_windows} "
             f"windows every {a.every} steps; seeds {', '.join(map(str, a.seeds))}", flush=True)
    runs = []
    for (seed, schedule), configs in groups.items():
        for cfg, results in train_gpt.train_many(configs):
            summary = train_gpt.summarize(cfg, results)
            runs.append(dict(schedule=schedule, seed=seed, optimizer=cfg.optimizer, lr=cfg.lr,
                             val=summary["val"], final_val=summary["val"][-1][1], ms_step=summary["ms"]["step"]))
        print_fn(f"  done: {schedule}, seed {seed} ({len(configs)} runs)", flush=True)
        if save:
            save(dict(grid=grid_of(a), runs=runs))
    return runs


def grid_of(a):
    return dict(muon_lrs=a.muon_lrs, normuon_lrs=a.normuon_lrs, adamw_lrs=a.adamw_lrs, seeds=a.seeds,
                schedules=a.schedules, steps=a.steps,
                every=a.every, val_windows=a.val_windows, warmup_steps=a.warmup_steps, dp=a.dp, tp=a.tp)


def best_lr(runs, optimizer, seeds):
    """(lr with the lowest mean final loss over seeds, bracketed?) among the lrs run at every seed."""
    by_lr = {}
    for r in runs:
        if r["optimizer"] == optimizer:
            by_lr.setdefault(r["lr"], {})[r["seed"]] = r["final_val"]
    complete = sorted(lr for lr, at in by_lr.items() if set(at) >= set(seeds))
    best = min(complete, key=lambda lr: statistics.fmean(by_lr[lr][s] for s in seeds))
    return best, complete[0] < best < complete[-1]


def final_losses_table(runs, optimizers, seeds, best):
    """Every (optimizer, lr)'s final validation loss at each seed and their mean (over the seeds it ran), a row each,
    the lr of best ({optimizer: lr}) marked "best" (benchmarks/moe_optimizers.py prints it too)."""
    rows = []
    for o in optimizers:
        for lr in sorted({r["lr"] for r in runs if r["optimizer"] == o}):
            finals = {r["seed"]: r["final_val"] for r in runs if (r["optimizer"], r["lr"]) == (o, lr)}
            mean = statistics.fmean(finals.values())
            rows.append([o, f"{lr:g}"] + [f"{finals[s]:.3f}" if s in finals else "" for s in seeds]
                        + [f"{mean:.3f}", "best" if best[o] == lr else ""])
    return muon_tools.format_table(["optimizer", "lr"] + [f"seed {s}" for s in seeds] + ["mean", ""], rows,
                           ["<", ">"] + [">"] * (len(seeds) + 1) + ["<"])


def compare(runs, schedule):
    """What one schedule's runs say: the tuned lrs, and per seed the target and the steps to it (ratio: AdamW's
    steps over Muon's; ratios: over each matrix optimizer's)."""
    mine = [r for r in runs if r["schedule"] == schedule]
    seeds = sorted({r["seed"] for r in mine})
    run = {(r["optimizer"], r["lr"], r["seed"]): r for r in mine}
    present = optimizers_in(mine)
    tuned = {o: best_lr(mine, o, seeds) for o in present}
    per_seed = []
    for seed in seeds:
        own = {o: min((r for r in mine if r["optimizer"] == o and r["seed"] == seed), key=lambda r: r["final_val"])
               for o in present}
        for how, pick in (("once", {o: run[o, tuned[o][0], seed] for o in present}), ("per seed", own)):
            target = pick["adamw"]["final_val"]
            steps = {o: steps_to(pick[o]["val"], target) for o in present}
            ratios = {o: steps["adamw"] / steps[o] if steps[o] else None for o in present if o in MATRIX_OPTIMIZERS}
            per_seed.append(dict(seed=seed, tuned=how, target=target, lrs={o: pick[o]["lr"] for o in pick},
                                 steps=steps, final=({o: pick[o]["final_val"] for o in pick}),
                                 ratio=ratios.get("muon"), ratios=ratios))
    return dict(schedule=schedule, seeds=seeds, tuned={o: dict(lr=lr, bracketed=b) for o, (lr, b) in tuned.items()},
                per_seed=per_seed)


def report(result, print_fn=print):
    """The tables: every run's final loss, then the steps to AdamW's best, spread over seeds."""
    runs = result["runs"]
    schedules = list(dict.fromkeys(r["schedule"] for r in runs))
    present = optimizers_in(runs)
    matrices = [o for o in present if o in MATRIX_OPTIMIZERS]
    for schedule in dict.fromkeys(r["schedule"] for r in runs):
        c = compare(runs, schedule)
        seeds = c["seeds"]
        steps = result["grid"]["steps"]
        print_fn(f"\nSchedule: {schedule}; validation loss at step {steps} (nats per byte)")
        print_fn(final_losses_table([r for r in runs if r["schedule"] == schedule], present, seeds,
                                    {o: t["lr"] for o, t in c["tuned"].items()}))
        for o, t in c["tuned"].items():
            where = "bracketed (a worse lr on both sides)" if t["bracketed"] else "AT THE GRID'S EDGE (not bracketed)"
            print_fn(f"{LABELS[o]}'s best lr {t['lr']:g}: {where}")
        for o in matrices:
            m, rows = LABELS[o], []
            for how in ("once", "per seed"):
                picks = [p for p in c["per_seed"] if p["tuned"] == how]
                rows.append([how, " ".join(f"{p['lrs'][o]:g}/{p['lrs']['adamw']:g}" for p in picks),
                             spread([p["target"] for p in picks]), spread([p["steps"][o] for p in picks]),
                             spread([p["steps"]["adamw"] for p in picks]), spread([p["ratios"][o] for p in picks]),
                             spread([p["final"]["adamw"] - p["final"][o] for p in picks])])
            print_fn(f"Steps to AdamW's best loss{'' if o == 'muon' else ', ' + m}, over seeds "
                     f"{', '.join(map(str, seeds))} (min-median-max; evaluations every {result['grid']['every']} steps):")
            print_fn(muon_tools.format_table(["lr tuned", f"lrs {m}/AdamW per seed", "target loss", f"{m} steps",
                                              "AdamW steps",
                                      f"AdamW/{m} steps", f"AdamW - {m} loss @ {steps}"], rows,
                                     ["<", "<", ">", ">", ">", ">", ">"]))
        ms = {o: statistics.median(r["ms_step"] for r in runs
                                   if (r["schedule"], r["optimizer"], r["lr"]) == (schedule, o, c["tuned"][o]["lr"]))
              for o in present}
        print_fn("Median step at the tuned lrs, median over seeds: "
                 + ", ".join(f"{LABELS[o]} {ms[o]:.0f} ms" for o in present) + " ("
                 + ", ".join(f"{ms[o] / ms['adamw']:.2f}x" for o in matrices)
                 + f"; DP={result['grid']['dp']} x TP={result['grid']['tp']}, this CPU)")
    if len(schedules) > 1:
        for o in matrices:
            a = across_schedules(runs, o)
            print_fn(f"\nAgainst AdamW's best final loss over {' and '.join(schedules)} (per seed, each at its tuned "
                     f"lr; seeds {', '.join(map(str, a['seeds']))}): target {spread(a['target'])}; {LABELS[o]} reaches "
                     "it in " + "; ".join(f"{spread(a[k])} steps ({k})" for k in schedules))


def across_schedules(runs, optimizer="muon"):
    """Per seed, AdamW's best final loss over every schedule (each at its tuned lr) and the steps
    optimizer (Muon's or NorMuon's) needs to reach it under each schedule (at its tuned lr):
    {"target": [...], schedule: [...]}."""
    schedules = list(dict.fromkeys(r["schedule"] for r in runs))
    compared = {k: {p["seed"]: p for p in compare(runs, k)["per_seed"] if p["tuned"] == "once"} for k in schedules}
    seeds = sorted(set.intersection(*(set(c) for c in compared.values())))
    run = {(r["schedule"], r["optimizer"], r["lr"], r["seed"]): r for r in runs}
    out = {"target": [min(compared[k][s]["final"]["adamw"] for k in schedules) for s in seeds], "seeds": seeds}
    for k in schedules:
        out[k] = [steps_to(run[k, optimizer, compared[k][s]["lrs"][optimizer], s]["val"], target)
                  for s, target in zip(seeds, out["target"])]
    return out


def plot(result, path):
    """Per schedule: each optimizer at its tuned lr, the mean validation loss over seeds and its
    min-max band."""
    plt = pyplot()
    schedules = list(dict.fromkeys(r["schedule"] for r in result["runs"]))
    fig, axes = plt.subplots(1, len(schedules), figsize=(6 * len(schedules), 4.2), squeeze=False, sharey=True)
    for ax, schedule in zip(axes[0], schedules):
        c = compare(result["runs"], schedule)
        for o, t in c["tuned"].items():
            curves = [r["val"] for r in result["runs"]
                      if (r["schedule"], r["optimizer"], r["lr"]) == (schedule, o, t["lr"])]
            steps = [s for s, _ in curves[0]]
            losses = list(zip(*[[v for _, v in curve] for curve in curves]))  # per step, one per seed
            ax.plot(steps, [statistics.fmean(v) for v in losses], color=COLORS[o], lw=2,
                    label=f"{LABELS[o]} lr {t['lr']:g}, mean of {len(curves)} seeds")
            ax.fill_between(steps, [min(v) for v in losses], [max(v) for v in losses], color=COLORS[o], alpha=0.25,
                            label=f"{LABELS[o]}: min-max over seeds")
        once = [p["target"] for p in c["per_seed"] if p["tuned"] == "once"]
        ax.axhline(statistics.fmean(once), color="gray", ls=":", lw=1, label="AdamW's final loss (mean over seeds)")
        ax.set_title(f"{schedule} lr")
        ax.set_xlabel("step")
        low, high = ax.get_ylim()
        if low < ZOOM_TOP < high:  # the first steps' losses (from ln 256 = 5.5) would flatten the rest
            ax.set_ylim(top=ZOOM_TOP)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("validation loss (nats per byte)")
    fig.suptitle(f"GPT on the standard library's sources: {' vs '.join(LABELS[o] for o in optimizers_in(result['runs']))}, "
                 "same tokens, tuned lr per optimizer")
    fig.tight_layout()
    muon_tools.save_figure(fig, path, dpi=110)


TRAINING_FLAGS = ("muon_lrs", "normuon_lrs", "adamw_lrs", "seeds", "schedules", "warmup_steps", "val_windows", "steps",
                  "every",
                  "dp", "tp")  # what a sweep trains with; --from-json reports runs trained with their own


def given_flags(argv):
    """The options the command line names (abbreviated too): build_parser's, parsed with no defaults."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_known_args(argv)[0]))


def check(a, given):
    """Refuse (ValueError, one line) an option this run would not use."""
    unused = [flag for flag in TRAINING_FLAGS if flag in given] if a.from_json else \
        ["warmup_steps"] if "warmup_steps" in given and "warmup-cosine" not in a.schedules else []
    if unused:
        why = (f"--from-json reports the runs saved in {a.from_json}, as they were trained" if a.from_json else
               "only warmup-cosine warms up, and --schedules leaves it out")
        raise ValueError(f"{', '.join('--' + f.replace('_', '-') for f in unused)} would be ignored: {why}")


def measure(a, given=frozenset()):
    check(a, given)
    if a.from_json:
        with open(a.from_json) as f:
            result = json.load(f)
    else:
        result = dict(grid=grid_of(a), runs=train(a, save=lambda partial: muon_tools.write_json(a.json, partial)))
    report(result)
    return result


def build_parser():
    p = muon_tools.OneLineParser(description=__doc__.splitlines()[0])
    # Finer grids (steps of about 1.5x) around the bests of earlier, coarser sweeps (notes/measured/
    # from_code_comments.md).
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.03, 0.05, 0.07])
    p.add_argument("--normuon-lrs", type=float, nargs="+", default=[],
                   help="NorMuon's grid, run beside Muon's (default: none, no NorMuon runs)")
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[0.0007, 0.001, 0.0014, 0.002, 0.003, 0.004])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--schedules", nargs="+", choices=train_gpt.SCHEDULES, default=list(train_gpt.SCHEDULES))
    p.add_argument("--warmup-steps", type=int, default=10, help="warmup-cosine's (default %(default)s)")
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10, help="steps between validation losses")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--from-json", metavar="PATH", help="report the runs saved by an earlier --json (no training)")
    return p


def main(argv=None):
    # the flags given are read once the command line is checked (with --help it never is: given_flags's parser,
    # without defaults, could not print it)
    return benchmark_main(build_parser(), lambda a: measure(a, given=given_flags(argv)), plot, argv,
                          inputs=lambda a: {"--from-json's runs": a.from_json})


if __name__ == "__main__":
    sys.exit(main())
