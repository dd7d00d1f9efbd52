"""benchmarks/moe_optimizers.py: examples/train_gpt_moe.py's three --optimizer values over an lr grid and seeds, each at
its best lr. What it concludes is checked on runs whose answer is known; the command itself at a tiny size, its
printed tables against each other and against its JSON."""

import json
import os
import statistics
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import moe_optimizers  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "moe_optimizers.py")
TINY = ["--steps", "3", "--every", "1", "--d-model", "16", "--layers", "1", "--heads", "1", "--experts", "2",
        "--expert-hidden", "8", "--batch", "4", "--context", "16", "--val-windows", "2"]


def run(optimizer, lr, seed, final):
    return dict(seed=seed, optimizer=optimizer, lr=lr, val=[(10, final + 1), (20, final)], final_val=final)


def test_each_optimizer_takes_its_lowest_mean_over_seeds_and_is_compared_seed_by_seed():
    runs = [run("muon", 0.01, 0, 2.60), run("muon", 0.01, 1, 2.70), run("muon", 0.02, 0, 2.50),
            run("muon", 0.02, 1, 2.62), run("muon", 0.05, 0, 2.90), run("muon", 0.05, 1, 2.40),
            run("adamw-experts", 0.005, 0, 2.80), run("adamw-experts", 0.005, 1, 2.64),
            run("adamw-experts", 0.01, 0, 2.90), run("adamw-experts", 0.01, 1, 2.90),
            run("adamw", 0.003, 0, 3.00), run("adamw", 0.003, 1, 3.10)]
    c = moe_optimizers.compare(runs, ["muon", "adamw-experts", "adamw"])
    muon, experts, adamw = (c["best"][o] for o in ("muon", "adamw-experts", "adamw"))
    # muon: means 2.65, 2.56, 2.65: 0.02, a worse lr on both sides (0.05's seed 1 is the lowest run, not the mean)
    assert (muon["lr"], muon["bracketed"], muon["finals"]) == (0.02, True, [2.50, 2.62])
    assert abs(muon["mean"] - 2.56) < 1e-12 and abs(muon["sd"] - statistics.stdev([2.50, 2.62])) < 1e-12
    assert (experts["lr"], experts["bracketed"], adamw["bracketed"]) == (0.005, False, False)  # the grid's edge
    assert [round(x, 12) for x in experts["minus_muon"]] == [0.30, 0.02]
    assert [round(x, 12) for x in adamw["minus_muon"]] == [0.50, 0.48]
    # ranges over seeds: muon 2.50-2.62, adamw-experts 2.64-2.80, adamw 3.00-3.10
    assert c["ranges_overlap"] == {"muon / adamw-experts": False, "muon / adamw": False,
                                   "adamw-experts / adamw": False}
    runs[7] = run("adamw-experts", 0.005, 1, 2.55)  # now inside muon's range
    assert moe_optimizers.compare(runs, ["muon", "adamw-experts"])["ranges_overlap"] == {"muon / adamw-experts": True}


def table(lines, title):
    """The rows of the table after the line starting with `title` (its header and rule skipped), split on spaces."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title)) + 3
    end = next((i for i in range(start, len(lines)) if not lines[i].strip() or lines[i].startswith("  ")), len(lines))
    return [line.split() for line in lines[start:end]]


def test_the_command_at_a_tiny_size_prints_its_best_lrs_and_spreads_as_its_json_holds(tmp_path):
    """Three optimizers x 2 lrs x 2 seeds of 3 steps (four spawns of 2 ranks: muon's and adamw's grids, then
    adamw-experts' at muon's best lr): the best lr of each is the argmin of its printed means, each mean that of its
    printed seeds, the summary the best rows', the JSON the same numbers."""
    path, figure = tmp_path / "m.json", tmp_path / "m.png"
    argv = ["--muon-lrs", "0.01", "0.03", "--adamw-experts-lrs", "0.01", "0.02", "--adamw-lrs", "0.003", "0.01",
            "--seeds", "0", "1", *TINY, "--json", str(path), "--figure", str(figure)]
    proc = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("MoE GPT 1 layers x d=16, 1 heads, 2 experts of 8 (top-2); DP 2 (EP 2) x TP 1 = 2")
    result = json.loads(path.read_text())
    every = table(lines, "Validation loss at step 3")
    assert len(every) == 3 * 2 and len(result["runs"]) == 3 * 2 * 2
    best = {}
    for o in ("muon", "adamw-experts", "adamw"):
        rows = [r for r in every if r[0] == o]
        means = [float(r[4]) for r in rows]
        for r in rows:  # each mean is its seeds' (printed to 3 decimals)
            assert abs(statistics.fmean([float(r[2]), float(r[3])]) - float(r[4])) <= 0.0011, r
        marked = [r for r in rows if r[-1] == "best"]
        assert len(marked) == 1 and float(marked[0][4]) == min(means), rows  # the argmin of the printed means
        best[o] = marked[0]
        mine = [x for x in result["runs"] if x["optimizer"] == o]
        mean = lambda lr: statistics.fmean(x["final_val"] for x in mine if x["lr"] == lr)  # noqa: E731
        lr = min({x["lr"] for x in mine}, key=mean)
        assert float(marked[0][1]) == lr == result["comparison"]["best"][o]["lr"]
        assert all(x["final_val"] == x["val"][-1][1] and [s for s, _ in x["val"]] == [1, 2, 3] for x in mine)
    for r in table(lines, "Each optimizer at its best lr"):
        o, b = r[0], result["comparison"]["best"][r[0]]
        assert r[1] == best[o][1] and [r[-2], r[-1]] == best[o][2:4]  # the best row's lr and seeds
        assert [f"{x:.3f}" for x in b["finals"]] == [r[-2], r[-1]] and r[2] == "NO"  # two lrs: never bracketed
        assert f"{b['mean']:.3f} ± {b['sd']:.3f}" == " ".join(r[-6:-3]) and r[-3] == f"{b['low']:.3f}-{b['high']:.3f}"
        assert abs(b["sd"] - statistics.stdev(b["finals"])) < 1e-12
    muon_lr = result["comparison"]["best"]["muon"]["lr"]  # adamw-experts' other groups: at muon's best lr
    assert {x["other_lr"] for x in result["runs"] if x["optimizer"] == "adamw-experts"} == {muon_lr}
    assert f"every other group's {muon_lr:g}" in proc.stdout
    for o in ("adamw-experts", "adamw"):
        d = result["comparison"]["best"][o]["minus_muon"]
        line = next(x for x in lines if x.startswith(f"{o} minus muon"))
        assert f": {' '.join(f'{x:+.3f}' for x in d)} (mean {statistics.fmean(d):+.3f})" in line
    assert sum(x.startswith("Ranges over seeds, ") for x in lines) == 3 and lines[-1].startswith("Wall time: ")
    with open(figure, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
