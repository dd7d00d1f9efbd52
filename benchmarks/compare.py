"""Every strategy and the AdamW ZeRO-1 baseline on the same grid and parameters, each run checked
against torch, then one table: bytes per phase, Newton-Schulz FLOPs, redundancy, balance, state
and step time, and the targets of the zero-redundancy strategies that do not depend on the
machine (FLOPs and bytes). Step times are printed as figures and ratios, never as verdicts: on a
shared 2-core machine they move from run to run.

    python benchmarks/compare.py                                  # DP=4 x TP=2, the 2-layer demo
    python benchmarks/compare.py --steps 5 --dp 8 --tp 1 --layers 8   # balanced owners; comm-free = AdamW bytes
    python benchmarks/compare.py --model lopsided --explain       # --explain: each run's layout, as a run prints it

It takes the script's flags but --strategy and --baseline (it runs them all), and writes every run
with --json. An option of some strategies goes to the runs that take it, the others run without it
(--overlap and --batched-ns: owner and comm-free; --tp-newton-schulz gram: gather; Muon's options:
every run but the baseline), as the printout says.

    python benchmarks/compare.py --tp-newton-schulz-bytes         # no runs: gather vs Gram bytes and FLOPs, from shapes

--tp-newton-schulz-bytes prints, instead of running, what tp_newton_schulz="gram" moves and computes
against the TP gather for every TP-split matrix of the demo, the GPT (examples/gpt.py) and GPT-2 small,
at TP 2, 4 and 8 (tp_newton_schulz_costs: the formulas, counted as the Ledger counts the collectives),
and the rule for when each moves fewer bytes.
"""

import os
import signal
import sys
from dataclasses import asdict, replace


if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch  # noqa: E402

import distributed_muon_cpu  # noqa: E402
from distmuon import large_runs  # noqa: E402
from distmuon import owners  # noqa: E402
import muon_tools  # noqa: E402

COMPARED = owners.STRATEGIES + (muon_tools.BASELINE,)  # every strategy, then the baseline
LABELS = {**{s: s for s in owners.STRATEGIES}, muon_tools.BASELINE: "AdamW ZeRO-1"}
ONCE = owners.strategies_where(lambda s: s.orthogonalizes_once)  # redundancy 1: each matrix once, by its owner
BALANCE_TARGET = 1.10  # max/mean Newton-Schulz FLOPs per rank that the owner assignment should reach


# Which runs take an option (each strategy's own, and the Gram form where a matrix is orthogonalized on every rank that
# touches it): every other run keeps its default.
TAKEN_BY = {**{k: owners.strategies_where(lambda s, k=k: k in s.own_options) for k in ("overlap", "batched_ns")},
            "tp_newton_schulz": owners.strategies_where(lambda s: not s.orthogonalizes_once),
            **{k: owners.STRATEGIES for k in muon_tools.MUON_ONLY + ("ns_blocks", "qk_clip_tau") if k != "tp_newton_schulz"}}


def run_config(cfg, kind):
    """cfg as the run of `kind` takes it: its strategy (or the baseline), and each option of TAKEN_BY only where
    that run takes it."""
    d = muon_tools.RunConfig()
    return replace(cfg, strategy="gather" if kind == muon_tools.BASELINE else kind,
                   baseline=kind == muon_tools.BASELINE,
                   **{k: getattr(cfg if kind in runs else d, k) for k, runs in TAKEN_BY.items()})


def options_line(cfg):
    """'Options: --overlap 2 for owner and comm-free; ...' for each option away from its default, or ''."""
    d = muon_tools.RunConfig()
    given = {}
    for k, runs in TAKEN_BY.items():
        if getattr(cfg, k) != getattr(d, k):
            value = "" if isinstance(getattr(cfg, k), bool) else f" {getattr(cfg, k)}"
            given.setdefault(runs, []).append(f"{'--qk-clip' if k == 'qk_clip_tau' else muon_tools.flag(k)}{value}")
    runs_named = lambda runs: "every Muon run" if runs == owners.STRATEGIES else " and ".join(runs)  # noqa: E731
    return "; ".join(f"{', '.join(flags)} for {runs_named(runs)}" for runs, flags in given.items())


def compare(cfg, explain=False, print_fn=print):
    """Run each of COMPARED in turn (each checked against torch), then print one table; returns them all."""
    world = cfg.dp * cfg.tp
    configs = {kind: run_config(cfg, kind) for kind in COMPARED}
    for run_cfg in configs.values():  # every run's flags, before any rank starts
        muon_tools.validate(run_cfg, muon_tools.demo_specs(run_cfg))
    print_fn(f"Comparing strategies: {world} CPU rank{'s' * (world != 1)} over Gloo, DP={cfg.dp} x TP={cfg.tp}, "
             f"{cfg.model} model, {cfg.steps} steps, seed {cfg.seed}, torch {torch.__version__}\n"
             + (f"Options: {options_line(cfg)}\n" if options_line(cfg) else ""))
    runs = {}
    for kind, run_cfg in configs.items():
        if explain:  # the grid, the buffer map and the owners of this run, as the run alone prints them
            muon_tools.print_header(run_cfg, muon_tools.plan_optimizer(run_cfg), "CPU", "Gloo", explain, print_fn)
        runs[kind] = result = muon_tools.run(run_cfg, print_fn=lambda *args: None)
        if kind in ONCE:  # for the balance target: every matrix's Newton-Schulz FLOPs, as its owners weigh them
            result["ns_flops_by_matrix"] = muon_tools.plan_optimizer(run_cfg).strategy.ns_flops
        failed = [c["name"] for c in result["checks"] if not c["ok"]]
        print_fn(f"{LABELS[kind]:<13} {muon_tools.verdict(result['checks'])[1]}"
                 + (f" (not: {', '.join(failed)})" if failed else ""))
    balance = realistic_balance(world, cfg.ns_steps)
    print_fn("")
    print_fn(format_comparison(cfg, runs, balance))
    return dict(config=asdict(cfg), torch=torch.__version__, passed=all(r["passed"] for r in runs.values()),
                runs=runs, realistic_balance=balance)


def realistic_balance(n_ranks, ns_steps=distributed_muon_cpu.NS_STEPS):
    """max/mean Newton-Schulz FLOPs of the owner assignment for GPT-2 small's matrices (12 layers, d = 768),
    from shapes alone: the demo model is too small to balance 8 ranks (see section 7)."""
    matrices = [s for s in distributed_muon_cpu.transformer_specs(vocab=50304, d=768, n_layers=12) if s.group == muon_tools.MUON_GROUP]
    flops = {s.name: distributed_muon_cpu.newton_schulz_flops(s.global_shape, ns_steps) for s in matrices}
    owner_of = owners.assign_owners(flops, n_ranks, {s.name: s.global_shape for s in matrices})
    _, balance = owners.load_balance(flops, owner_of, n_ranks)
    return dict(model="GPT-2 small shapes (12 layers, d = 768, with an 8-expert router)", matrices=len(flops),
                ranks=n_ranks, max_over_mean=balance)


def format_comparison(cfg, runs, realistic):
    world = cfg.dp * cfg.tp
    baseline_all = runs[muon_tools.BASELINE]["bytes_sent_all_ranks"]
    phases = list(dict.fromkeys(p for s in COMPARED for p in muon_tools.PHASES_OF[s]))  # in first-seen order
    model = f"{cfg.layers}-layer transformer, d = {cfg.d_model}" if cfg.model == "transformer" else f"{cfg.model} model"
    lines = [f"[8] Bytes sent per step by all ranks, per phase (DP={cfg.dp} x TP={cfg.tp}, {model})"]
    rows = [[p] + [muon_tools.human_bytes(sum(runs[s]["bytes_per_step"][p]["sent"])) if p in runs[s]["bytes_per_step"]
                   else "-" for s in COMPARED] for p in phases]
    rows.append(["total"] + [muon_tools.human_bytes(runs[s]["bytes_sent_all_ranks"]) for s in COMPARED])
    lines.append(muon_tools.format_table(["phase"] + [LABELS[s] for s in COMPARED], rows,
                                         ["<"] + [">"] * len(COMPARED)))
    lines.append("")
    lines.append(f"[8] Per strategy ({world} ranks, median of {cfg.steps} steps; ratio and extra are against "
                 f"AdamW ZeRO-1's total)")
    rows = []
    for s in COMPARED:
        r, f = runs[s], runs[s]["ns_flops"]
        mean = sum(f["per_rank"]) / world
        rows.append([LABELS[s], muon_tools.human_bytes(r["bytes_sent_all_ranks"]),
                     muon_tools.human_bytes(r["bytes_sent_max_rank"]),
                     f"{r['bytes_sent_all_ranks'] / baseline_all:.2f}" if baseline_all else "-",
                     muon_tools.human_bytes(r["bytes_sent_all_ranks"] - baseline_all),
                     f"{max(f['per_rank']) / 1e9:.3f}", f"{mean / 1e9:.3f}",
                     f"{f['max_over_mean']:.2f}" if f["max_over_mean"] else "-",
                     f"{f['redundancy']:.2f}" if f["redundancy"] is not None else "-",
                     muon_tools.human_bytes(max(r["state_bytes"])), f"{r['timings']['step_ms_median']:.0f}"])
    lines.append(muon_tools.format_table(["strategy", "bytes, all", "bytes/rank max", "ratio", "extra", "NS GFLOP max",
                               "mean", "max/mean", "redundancy", "state/rank max", "step ms"],
                              rows, ["<"] + [">"] * 10))
    lines.append("")
    lines.append(format_targets(cfg, runs, realistic))
    return "\n".join(lines)


def format_targets(cfg, runs, realistic):
    """The targets of the zero-redundancy strategies that do not depend on the machine (counts of FLOPs
    and bytes), each with what this run got and why where missed; then the step-time ratios, as figures."""
    world, yes = cfg.dp * cfg.tp, lambda ok: "met" if ok else "NOT met"
    owner, free, gather, adamw = (runs[s] for s in ("owner", "comm-free", "gather", muon_tools.BASELINE))
    redundancy = [runs[s]["ns_flops"]["redundancy"] for s in ONCE]
    lines = [f"[8] Targets, from this run: redundancy 1.00 for {' and '.join(ONCE)}: "
             f"{yes(all(r == 1.0 for r in redundancy))} ({', '.join(f'{r:.2f}' for r in redundancy)})"]
    ratio = realistic["max_over_mean"]
    lines.append(f"    max/mean NS FLOPs <= {BALANCE_TARGET:.2f} for {realistic['model']}, {realistic['matrices']} "
                 f"matrices on {world} ranks: {yes(ratio <= BALANCE_TARGET)} ({ratio:.2f}, from shapes)")
    flops = runs["owner"]["ns_flops_by_matrix"]
    balance = owner["ns_flops"]["max_over_mean"]
    bound = max(max(flops.values()) / (sum(flops.values()) / world), 1.0)
    largest = f"; the largest matrix alone is {bound:.2f}x the mean" if bound > 1 else ""
    why = "" if balance <= BALANCE_TARGET else (
        f": too few matrices, of too few sizes, to split evenly (LPT is within 4/3 of the best assignment of "
        f"whole matrices{largest})")
    lines.append(f"    this model: {len(flops)} matrices on {world} ranks, max/mean = {balance:.2f}{why}")
    extra = free["bytes_sent_all_ranks"] - adamw["bytes_sent_all_ranks"]
    # The baseline's matrix buckets are padded to a multiple of DP, and every TP column's DP group
    # reduce-scatters and all-gathers that padding; comm-free moves whole matrices, without it.
    padding = cfg.tp * sum(2 * (cfg.dp - 1) * (b["numel"] - b["used"]) * 4 for b in adamw["buckets"]
                           if set(b["names"]) <= set(flops))
    exchange = sum(sum(free["bytes_per_step"][p]["sent"]) for p in ("gather at owner", "scatter from owner"))
    # Where ZeRO-1 all-gathers the matrices' fp32 weights, comm-free broadcasts their bf16 update: half the bytes.
    saved = sum(free["bytes_per_step"]["update broadcast from owner"]["sent"])
    less_padding = f", less the {muon_tools.human_bytes(padding)} of padding ZeRO-1's buckets move" if padding else ""
    lines.append(f"    comm-free extra bytes over AdamW ZeRO-1: {muon_tools.human_bytes(extra)} = its TP exchange "
                 f"({muon_tools.human_bytes(exchange)}; 0 at TP = 1, here TP = {cfg.tp}) less the {muon_tools.human_bytes(saved)} its "
                 f"bf16 update broadcast saves over an fp32 all-gather{less_padding}: "
                 f"{yes(extra == exchange - saved - padding)}")
    o_ms, g_ms = owner["timings"]["step_ms_median"], gather["timings"]["step_ms_median"]
    o_max, g_max = (max(r["ns_flops"]["per_rank"]) / 1e9 for r in (owner, gather))
    lines.append(f"[8] Step time, median on this machine (a figure, not a target: it moves from run to run): "
                 f"owner / gather = {o_ms / g_ms:.2f} ({o_ms:.0f} against {g_ms:.0f} ms; gather does "
                 f"{gather['ns_flops']['redundancy']:.2f}x the Newton-Schulz work, and a step waits for the most "
                 f"loaded rank: {o_max:.3f} against {g_max:.3f} GFLOP)")
    return "\n".join(lines)


# -- Newton-Schulz of a TP-split matrix: gather it, or all-reduce its Gram matrix ------------------------
# For one matrix of global shape (rows, cols) split over n TP ranks, per TP rank and per step, counted as
# the Ledger counts them (distributed_muon_cpu.py, section 2: a ring all-gather sends (n - 1) pieces, a ring
# all-reduce of k elements 2 (n - 1) pieces of ceil(k / n)), with m the short side and N the long one:
#   gather  TP gather of the bf16 update: (n - 1) pieces of m N / n elements, 2 bytes each; the TP shard
#           is a slice (0 bytes). Newton-Schulz on the whole matrix on every TP rank: k (4 m^2 N + 2 m^3).
#   gram    newton_schulz_tp (the lesson's section 8.3): one all-reduce of the float32 norm (1 element), then per
#           iteration one all-reduce of the float32 m x m Gram matrix; each rank multiplies only its
#           N / n columns: k (4 m^2 N / n + 2 m^3) FLOPs (A @ A, m x m, stays whole on every rank).
# Gram moves fewer bytes when k 2 (n - 1) / n 4 m^2 < (n - 1) / n 2 m N, i.e. N > 4 k m: the long side
# more than 4 x ns_steps (20 at 5 steps) times the short one, whatever n (the float32 norm aside); a
# bf16 Gram would halve that to 2 k m. It always does fewer FLOPs per rank, and k + 1 collectives, not 1.
GRAM_BYTES, GATHER_BYTES = 4, 2  # float32 Gram and norm (newton_schulz_tp); the bf16 update (tp_gather)


def tp_newton_schulz_costs(shape, tp_split_dim, tp, ns_steps=distributed_muon_cpu.NS_STEPS):
    """What one TP rank sends per step for one matrix, and its Newton-Schulz FLOPs, both ways:
    dict(gather_bytes, gram_bytes, gather_flops, gram_flops, eligible); gram_* are None where the split
    cuts the short side (large_runs.gram_eligible: X X^T is then not a sum over the pieces)."""
    m = min(shape)
    numel = shape[0] * shape[1]
    gather_bytes = (tp - 1) * (numel // tp) * GATHER_BYTES
    eligible = large_runs.gram_eligible(shape, tp_split_dim)
    ring = lambda k: 2 * (tp - 1) * -(-k // tp)  # noqa: E731 -- a ring all-reduce's elements, as distributed_muon_cpu.all_reduce counts
    gram_bytes = (ring(1) + ns_steps * ring(m * m)) * GRAM_BYTES if eligible else None
    gram_flops = large_runs.newton_schulz_tp_flops(shape, tp, ns_steps) if eligible else None
    return dict(gather_bytes=gather_bytes, gram_bytes=gram_bytes,
                gather_flops=distributed_muon_cpu.newton_schulz_flops(shape, ns_steps),
                gram_flops=gram_flops, eligible=eligible)


def split_matrices(models):
    """[(model, name, global shape, tp_split_dim)] of the TP-split Muon matrices, one per distinct shape
    and split, of each model."""
    out = []
    for model, specs in models:
        seen = set()
        for s in specs:
            if s.group == muon_tools.MUON_GROUP and s.tp_split_dim >= 0 and (s.global_shape, s.tp_split_dim) not in seen:
                seen.add((s.global_shape, s.tp_split_dim))
                out.append((model, s.name.split(".", 2)[-1], s.global_shape, s.tp_split_dim))
    return out


def tp_newton_schulz_models():
    """The demo's matrices, the GPT's (examples/gpt.py at train_gpt.py's defaults) and GPT-2 small's."""
    from examples.gpt import GPT, GPTConfig, muon_params
    gpt_model = GPT(GPTConfig())
    split = gpt_model.tp_split_dims()
    gpt_specs = [distributed_muon_cpu.ParamSpec(n, tuple(gpt_model.get_parameter(n).shape), split.get(n, -1),
                                                muon_tools.MUON_GROUP)
                 for n in muon_params(gpt_model)]
    return [(f"demo (d={distributed_muon_cpu.D_MODEL})", distributed_muon_cpu.transformer_specs()),
            (f"GPT (d={GPTConfig.d_model})", gpt_specs),
            ("GPT-2 small (d=768)", distributed_muon_cpu.transformer_specs(vocab=50304, d=768, n_layers=1))]


def format_tp_newton_schulz(ns_steps=distributed_muon_cpu.NS_STEPS, tps=(2, 4, 8)):
    """The table of --tp-newton-schulz-bytes: per matrix and TP size, bytes sent and FLOPs per TP rank."""
    rows = []
    for model, name, shape, split in split_matrices(tp_newton_schulz_models()):
        for tp in tps:
            if shape[split] % tp:
                continue
            c = tp_newton_schulz_costs(shape, split, tp, ns_steps)
            gram = c["gram_bytes"]
            rows.append([model, name, f"{shape[0]}x{shape[1]}", split, tp, muon_tools.human_bytes(c["gather_bytes"]),
                         muon_tools.human_bytes(gram) if gram is not None else "-",
                         f"{gram / c['gather_bytes']:.2f}" if gram is not None else "-",
                         f"{c['gather_flops'] / 1e6:.2f}",
                         f"{c['gram_flops'] / 1e6:.2f}" if gram is not None else "-",
                         ("gram" if gram < c["gather_bytes"] else "gather") if gram is not None else "gather (only)"])
    lines = [f"Newton-Schulz of a TP-split matrix, per TP rank and step ({ns_steps} iterations): the TP gather "
             f"(bf16 update, {GATHER_BYTES} B) against tp_newton_schulz=\"gram\" (float32 norm + {ns_steps} "
             f"float32 Gram all-reduces); ring counts, as the Ledger's",
             muon_tools.format_table(["model", "matrix", "shape", "split", "TP", "gather sent", "gram sent",
                                      "gram/gather",
                              "gather MFLOP", "gram MFLOP", "fewer bytes"], rows,
                             ["<", "<", ">", ">", ">", ">", ">", ">", ">", ">", "<"])]
    flips = []
    m = 64
    for ratio in (4, 4 * ns_steps - 2, 4 * ns_steps + 2, 64):
        c = tp_newton_schulz_costs((m, m * ratio), 1, 4, ns_steps)
        flips.append(f"{m}x{m * ratio}: {c['gram_bytes'] / c['gather_bytes']:.2f}")
    lines.append("")
    lines.append(f"Rule: gram moves fewer bytes when the long side exceeds 4 x ns_steps = {4 * ns_steps} times the "
                 f"short one (float32 Gram; 2 x ns_steps with a bf16 one), whatever the TP size; gram/gather at TP 4 "
                 f"for " + ", ".join(flips) + ". Every transformer matrix above is at most 4:1, so the gather moves "
                 f"fewer bytes; gram always does fewer FLOPs per rank, in {ns_steps + 1} collectives instead of 1.")
    return "\n".join(line.rstrip() for text in lines for line in text.split("\n"))


def main(argv=None):
    parser = muon_tools.build_parser("Every strategy and the AdamW ZeRO-1 baseline on one grid, each checked against torch, "
                             "in one table.", one_run=False)
    parser.add_argument("--tp-newton-schulz-bytes", action="store_true",
                        help="print, without running, the bytes and FLOPs of the TP gather against "
                             "tp_newton_schulz='gram' for the demo's, the GPT's and GPT-2 small's TP-split matrices "
                             "(it takes --ns-steps, and no other flag)")
    args = parser.parse_args(argv)

    def work():
        if args.tp_newton_schulz_bytes:
            ignored = [a.option_strings[0] for a in parser._actions  # what differs from its default was given
                       if a.dest not in ("help", "ns_steps", "tp_newton_schulz_bytes")
                       and getattr(args, a.dest) != a.default]
            if ignored:
                raise ValueError(f"--tp-newton-schulz-bytes runs nothing: it takes --ns-steps alone "
                                 f"(got {', '.join(ignored)})")
            print(format_tp_newton_schulz(args.ns_steps))
            return 0
        if args.json:
            muon_tools.check_writable(args.json)
        results = compare(muon_tools.config_from_args(args), explain=args.explain)
        muon_tools.write_json(args.json, results)
        return 0 if results["passed"] else 1

    return muon_tools.exit_code(work, args.traceback)


if __name__ == "__main__":
    sys.exit(main())
