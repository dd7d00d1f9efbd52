"""Muon against AdamW on the routed MoE GPT of examples/train_gpt_moe.py: each --optimizer of it (muon: Muon on every
matrix, each expert its own; adamw-experts: AdamW on the expert stacks, Muon on the other matrices; adamw: AdamW on
every parameter) over a small lr grid at several seeds, each at the lr whose validation loss, averaged over the seeds,
is lowest.

    python benchmarks/moe_optimizers.py        # 3 optimizers x 4 lrs x 5 seeds = 60 runs of 100 steps, one command
    python benchmarks/moe_optimizers.py --optimizers muon adamw-experts --muon-lrs 0.01 0.02 \\
        --adamw-experts-lrs 0.002 0.005 --seeds 0 1 --steps 30 --json m.json --figure m.png

Every run has the same model, batches and steps (a seed sets the initial weights and the batches) and a constant lr.
muon and adamw sweep one lr for all their param groups: Muon's adjust_lr_fn "match_rms_adamw" makes one lr the same
update size for Muon and AdamW (train_gpt.hyperparameters, as in benchmarks/gpt_lr_sweep.py). adamw-experts sweeps
the expert stacks' AdamW lr alone (train_gpt_moe.py --experts-lr), every other group at muon's best lr: so it differs
from muon in the experts' optimizer and lr only, not in the lr of the matrices they share (muon's best lr sits 10 x
above AdamW's here, and one lr for all would hold back the Muon matrices). The routers, embeddings, norms and biases
take AdamW in all three. The ranks are spawned Gloo ranks, DP 2 (EP 2) x TP 1 by default: one spawn per seed trains
muon's and adamw's grids, one after another (train_gpt_moe.train_many); once muon's best lr is known, one spawn per
seed trains adamw-experts'.

How it is read:
  * each optimizer's lr (adamw-experts': the experts') is the one of its grid whose final validation loss, averaged
    over the seeds, is lowest (gpt_lr_sweep.best_lr); it is bracketed when the grid has a worse lr on both sides, else
    AT THE GRID'S EDGE;
  * at that lr: the mean over seeds, the sample standard deviation, the range and every seed's loss;
  * the difference from Muon's loss seed by seed (the same initial weights and batches: paired), and whether the
    ranges over seeds of two optimizers overlap. Nothing more is concluded.
--json is rewritten after every seed, so an interrupted sweep keeps what it finished.
"""

import math
import statistics
import sys
import time
from dataclasses import replace

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

from gpt_bench import pyplot  # noqa: E402
import muon_tools  # noqa: E402
from gpt_bench import main as benchmark_main  # noqa: E402
from gpt_lr_sweep import best_lr, final_losses_table  # noqa: E402

from examples import train_gpt_moe  # noqa: E402

# Grids around each optimizer's best lr at 100 steps, found by a first sweep at seed 0 (notes/13-moe.md), in steps
# of about 1.5 x so that the best is bracketed; adamw-experts': the expert stacks' lr.
LRS = {"muon": (0.01, 0.015, 0.02, 0.03), "adamw-experts": (0.001, 0.0015, 0.002, 0.003),
       "adamw": (0.001, 0.0015, 0.002, 0.003)}
FIRST = ("muon", "adamw")  # swept first; adamw-experts then takes muon's best lr for its other groups
SIZES = ("dp", "ep", "tp", "experts", "expert_hidden", "d_model", "layers", "heads", "batch", "context",
         "val_windows")  # train_gpt_moe.Config's, as flags of their own name
COLORS = {"muon": "tab:blue", "adamw-experts": "tab:green", "adamw": "tab:orange"}


def lr_flag(optimizer):
    return f"--{optimizer}-lrs"


def given_lrs(a, optimizer):
    """The lrs its flag gave (None: not given)."""
    return getattr(a, lr_flag(optimizer)[2:].replace("-", "_"))


def lrs_of(a):
    """{optimizer: its lr grid} of the optimizers run: its flag's values, or LRS's."""
    return {o: given_lrs(a, o) or list(LRS[o]) for o in a.optimizers}


def check(a):
    """Refuse (ValueError, one line) what the sweep could not use as given: an lr grid of an optimizer it does not run
    (ignored), an lr <= 0, and a seed, lr or optimizer given twice (a mean that counts a run twice)."""
    for o in train_gpt_moe.OPTIMIZERS:
        given = given_lrs(a, o)
        if given is not None and o not in a.optimizers:
            raise ValueError(f"{lr_flag(o)} would be ignored: --optimizers leaves {o} out")
        bad = [lr for lr in given or () if not (lr > 0 and math.isfinite(lr))]
        if bad:
            raise ValueError(f"{lr_flag(o)} must be > 0 and finite (got {bad[0]})")
    for flag, values in [("--optimizers", a.optimizers), ("--seeds", a.seeds)] + \
            [(lr_flag(o), lrs) for o, lrs in lrs_of(a).items()]:
        if len(set(values)) < len(values):
            what = {"--optimizers": "optimizer", "--seeds": "seed"}.get(flag, "lr")
            raise ValueError(f"{flag} {' '.join(map(str, values))}: each {what} once")
    if "adamw-experts" in a.optimizers and "muon" not in a.optimizers:
        raise ValueError("--optimizers adamw-experts trains its other groups at muon's best lr: give muon too")


def configs_of(a, seed, optimizers, muon_lr=None):
    """Every (optimizer, lr) of the grid at one seed, as train_gpt_moe.Configs (no progress lines); adamw-experts':
    its grid the experts' lr (--experts-lr), every other group at muon_lr."""
    base = train_gpt_moe.Config(steps=a.steps, log_every=a.every, seed=seed, progress=False,
                      **{name: getattr(a, name) for name in SIZES})
    return [replace(base, optimizer=o, lr=lr) if o != "adamw-experts" else
            replace(base, optimizer=o, lr=muon_lr, experts_lr=lr) for o in optimizers for lr in lrs_of(a)[o]]


def grid_of(a):
    return dict(optimizers=a.optimizers, lrs=lrs_of(a), seeds=a.seeds, steps=a.steps, every=a.every,
                **{name: getattr(a, name) for name in SIZES})


def train(a, save=None, print_fn=print):
    """Every (seed, optimizer, lr): muon's and adamw's, one spawn per seed; then adamw-experts', at muon's best lr
    (over every seed), one spawn per seed; save(what --json holds) after each spawn. [run dicts]: "lr" the one swept
    (adamw-experts': the experts'), "other_lr" the lr of the other groups."""
    first = [o for o in a.optimizers if o in FIRST]
    later = [o for o in a.optimizers if o not in FIRST]
    for seed in a.seeds:  # every configuration is checked before the first rank starts (any lr of muon's for later's)
        for cfg in configs_of(a, seed, first) + configs_of(a, seed, later, lrs_of(a).get("muon", [None])[0]):
            train_gpt_moe.validate(cfg)
    shown = configs_of(a, a.seeds[0], a.optimizers[:1], lrs_of(a).get("muon", [None])[0])[0]
    print_fn(train_gpt_moe.header(shown).split("; DTensorMuon")[0] + f"; {a.steps} steps of {shown.batch} x {shown.context} "
             f"tokens; validation: {a.val_windows} windows every {a.every} steps; seeds "
             f"{', '.join(map(str, a.seeds))}", flush=True)
    runs = []
    for stage, optimizers in enumerate((first, later)):
        muon_lr = best_lr(runs, "muon", a.seeds)[0] if stage and optimizers else None
        for seed in a.seeds if optimizers else ():
            configs, t0 = configs_of(a, seed, optimizers, muon_lr), time.perf_counter()
            for cfg, results in zip(configs, train_gpt_moe.train_many(configs, cfg.dp * cfg.tp)):
                val = next(r for r in results if r["rank"] == 0)["val"]
                runs.append(dict(seed=seed, optimizer=cfg.optimizer, lr=cfg.experts_lr or cfg.lr, other_lr=cfg.lr,
                                 val=val, final_val=val[-1][1]))
            print_fn(f"  done: {', '.join(optimizers)}, seed {seed} ({len(configs)} runs, "
                     f"{time.perf_counter() - t0:.0f} s)" + (f"; the other groups at muon's best lr {muon_lr:g}"
                                                             if muon_lr else ""), flush=True)
            if save:
                save(dict(grid=grid_of(a), runs=runs))
    return runs


def compare(runs, optimizers):
    """Each optimizer at its best lr (gpt_lr_sweep.best_lr: the lowest mean over the seeds): the lr, whether the grid
    brackets it, each seed's final loss, their mean, sample standard deviation and range; its difference from
    Muon's seed by seed; for every two optimizers, whether their ranges over seeds overlap."""
    seeds = sorted({r["seed"] for r in runs})
    run = {(r["optimizer"], r["lr"], r["seed"]): r for r in runs}
    out = {}
    for o in optimizers:
        lr, bracketed = best_lr(runs, o, seeds)
        finals = [run[o, lr, s]["final_val"] for s in seeds]
        out[o] = dict(lr=lr, bracketed=bracketed, finals=finals, mean=statistics.fmean(finals),
                      sd=statistics.stdev(finals) if len(finals) > 1 else 0.0, low=min(finals), high=max(finals))
    if "muon" in out:
        for o, c in out.items():
            c["minus_muon"] = [x - y for x, y in zip(c["finals"], out["muon"]["finals"])]
    overlaps = {f"{o} / {p}": out[o]["low"] <= out[p]["high"] and out[p]["low"] <= out[o]["high"]
                for i, o in enumerate(optimizers) for p in optimizers[i + 1:]}
    return dict(seeds=seeds, best=out, ranges_overlap=overlaps)


def report(result, print_fn=print):
    """The tables: every run's final validation loss, then each optimizer at its best lr over the seeds."""
    runs, grid = result["runs"], result["grid"]
    optimizers = [o for o in grid["optimizers"] if any(r["optimizer"] == o for r in runs)]
    c = compare(runs, optimizers)
    seeds, best = c["seeds"], c["best"]
    print_fn(f"\nValidation loss at step {grid['steps']} (nats per byte), every run:")
    print_fn(final_losses_table(runs, optimizers, seeds, {o: b["lr"] for o, b in best.items()}))
    rows = [[o, f"{b['lr']:g}", "yes" if b["bracketed"] else "NO (grid's edge)",
             f"{b['mean']:.3f} ± {b['sd']:.3f}", f"{b['low']:.3f}-{b['high']:.3f}",
             " ".join(f"{x:.3f}" for x in b["finals"])] for o, b in best.items()]
    print_fn(f"\nEach optimizer at its best lr (the lowest mean over seeds {', '.join(map(str, seeds))}; ± the sample "
             f"standard deviation over seeds):")
    print_fn(muon_tools.format_table(["optimizer", "best lr", "bracketed", "val mean ± sd", "min-max",
                              f"seeds {' '.join(map(str, seeds))}"], rows, ["<", ">", "<", ">", ">", "<"]))
    for o, b in best.items():
        other = {r["other_lr"] for r in runs if r["optimizer"] == o and r["lr"] == b["lr"]}
        print_fn(f"  {o}: {train_gpt_moe.OPTIMIZERS[o]}" + (f"; lr: the expert stacks' (AdamW), every other group's "
                                                   f"{' '.join(f'{x:g}' for x in sorted(other))}"
                                                   if o == "adamw-experts" else ""))
    if "muon" in best:
        for o, b in best.items():
            if o != "muon":
                d = b["minus_muon"]
                print_fn(f"{o} minus muon, seed by seed (the same initial weights and batches): "
                         f"{' '.join(f'{x:+.3f}' for x in d)} (mean {statistics.fmean(d):+.3f}); higher than Muon's "
                         f"at {sum(x > 0 for x in d)} of {len(d)} seeds")
    for pair, overlap in c["ranges_overlap"].items():
        print_fn(f"Ranges over seeds, {pair}: {'OVERLAP' if overlap else 'apart'}")
    return c


def plot(result, path):
    """Left: each optimizer at its best lr, the mean validation loss over seeds and its min-max band; right: the mean
    final loss over seeds against the lr, every lr of each grid."""
    plt = pyplot()
    runs, grid = result["runs"], result["grid"]
    c = result["comparison"]
    fig, (curves, sweep) = plt.subplots(1, 2, figsize=(12, 4.2))
    for o, b in c["best"].items():
        mine = [r["val"] for r in runs if (r["optimizer"], r["lr"]) == (o, b["lr"])]
        steps = [s for s, _ in mine[0]]
        per_step = list(zip(*[[v for _, v in curve] for curve in mine]))
        curves.plot(steps, [statistics.fmean(v) for v in per_step], color=COLORS[o], lw=2,
                    label=f"{o}, lr {b['lr']:g}: mean of {len(mine)} seeds")
        curves.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], color=COLORS[o],
                            alpha=0.25)
        lrs = sorted({r["lr"] for r in runs if r["optimizer"] == o})
        means = [statistics.fmean(r["final_val"] for r in runs if (r["optimizer"], r["lr"]) == (o, lr)) for lr in lrs]
        sweep.plot(lrs, means, "o-", color=COLORS[o], label=o)
    curves.set_xlabel("step")
    curves.set_ylabel("validation loss (nats per byte)")
    curves.set_title("at each optimizer's best lr (band: min-max over seeds)")
    low, high = curves.get_ylim()
    curves.set_ylim(low, min(high, low + 1.5))  # the first evaluations (from ln 256 = 5.5) would flatten the rest
    curves.legend(fontsize=8)
    sweep.set_xscale("log")
    sweep.set_xlabel("lr (adamw-experts: the expert stacks')")
    sweep.set_ylabel(f"validation loss at step {grid['steps']}, mean over seeds")
    sweep.set_title("the lr grids")
    sweep.legend(fontsize=8)
    fig.suptitle(f"MoE GPT, {grid['experts']} experts, DP {grid['dp']} (EP {grid['ep']}) x TP {grid['tp']}: Muon vs "
                 f"AdamW on the experts vs AdamW everywhere, same tokens")
    fig.tight_layout()
    muon_tools.save_figure(fig, path, dpi=110)
    plt.close(fig)


def measure(a):
    check(a)
    t0 = time.perf_counter()
    result = dict(grid=grid_of(a), runs=train(a, save=lambda partial: muon_tools.write_json(a.json, partial)))
    result["comparison"] = report(result)
    result["wall_s"] = time.perf_counter() - t0
    print(f"Wall time: {result['wall_s']:.0f} s ({len(result['runs'])} runs)")
    return result


def build_parser():
    p = muon_tools.OneLineParser(description=__doc__.splitlines()[0])
    d = train_gpt_moe.Config(dp=2, ep=2, tp=1)  # two ranks: the two cores, a rank each
    p.add_argument("--optimizers", nargs="+", choices=tuple(train_gpt_moe.OPTIMIZERS),
                   default=list(train_gpt_moe.OPTIMIZERS),
                   help="train_gpt_moe.py's --optimizer values to compare (default all three)")
    for o, lrs in LRS.items():
        what = "the expert stacks' lr grid (every other group at muon's best lr)" if o == "adamw-experts" else "lr grid"
        p.add_argument(lr_flag(o), type=float, nargs="+", metavar="LR",
                       help=f"{o}'s {what} (default {' '.join(map(str, lrs))})")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="(default %(default)s)")
    p.add_argument("--steps", type=int, default=100, help="(default %(default)s)")
    p.add_argument("--every", type=int, default=10, help="steps between validation losses (default %(default)s)")
    for name in SIZES:
        p.add_argument(muon_tools.flag(name), type=int, default=getattr(d, name),
                       help="train_gpt_moe.py's (default %(default)s)")
    p.set_defaults(val_windows=64)  # twice train_gpt_moe's: the losses compared are the validation's
    return p


def main(argv=None):
    return benchmark_main(build_parser(), measure, plot, argv)


if __name__ == "__main__":
    sys.exit(main())
