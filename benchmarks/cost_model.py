"""What a distributed Muon step costs on a cluster, predicted from the project's own plans (notes/12-cost-model.md).

Give it a model (layers, d_model, heads and KV heads, FFN width, vocabulary, experts) and a cluster (GPUs per
node, link bandwidths and latencies, bf16 rates). It builds the layout each optimizer itself would build, on
a virtual grid, with no process and no memory:

  * the lesson's strategies, gather (and its Gram form, and with a flat buffer: one bucket per param group),
    owner and comm-free (Muon's, and with --normuon NorMuon's), and the AdamW ZeRO-1 baseline: the optimizer
    class itself, constructed as muon_tools.plan_optimizer constructs it, over parameters on PyTorch's meta
    device; so its virtual buffer is plan_layout's, its owners assign_owners', its routes plan_routes' and its
    chunks CommFreeMuon's own;
  * DTensorMuon over FSDP2 x TP x EP: each parameter's copies placed as fully_shard and parallelize_module
    place them (section 3: the rules, which the test checks against real FSDP2 runs), its owners by its own
    rule (assign_owners(holders=, load=)), its transfers its own: the plan is distmuon/dtensor/plan.py's plan_matrices.

From the plans it counts, for every rank, what the Ledger would count (bytes and calls of every collective
phase), the Newton-Schulz FLOPs and calls, the optimizer state, the elementwise work and the parts it steps,
and it prices them: each collective by an alpha-beta model on the links it crosses (plus a fixed cost per
call where a machine measured one), compute at the cluster's rates (plus per-call costs, likewise); the step
without overlap (the sum) and with perfect overlap (the larger of communication and compute); beside AdamW's
step on the same layout and beside the forward + backward of the same step ((6 x active parameters +
attention) x tokens FLOPs). tests/test_cost_model.py proves the bytes, calls, FLOPs and state equal real
runs' Ledgers on every grid the tests run; --check-here measures this machine's per-call costs and compares
the times with steps measured on 1, 2 and 4 processes.

    python benchmarks/cost_model.py --model llama3-70b --gpus 512 --tp 8       # one table, H100 figures
    python benchmarks/cost_model.py --model deepseek-v3 --gpus 1024 --ep 64 --normuon    # and NorMuon's rows
    python benchmarks/cost_model.py --model marin-moe-d2560 --gpus 8 --ep 1             # one node, a small batch
    python benchmarks/cost_model.py --chapter --json c.json --figure c.png    # notes/12's tables and figures
    python benchmarks/cost_model.py --check-here                              # predicted vs measured, this CPU
    python benchmarks/cost_model.py --model llama3-70b --gpus 512 --overlap 0,1,2 --exchange-bytes 256MiB,1GiB
    python benchmarks/cost_model.py --overlap-table        # DTensorMuon by groups, overlapped: notes/12's table
    python benchmarks/cost_model.py --check-overlap-here   # and against its steps on 2 ranks here

Sections, one module each beside this file: 1. models and 2. clusters (cost_model_inputs.py), 3. the plans, lesson
and DTensor (cost_model_plans.py), 4. traffic and its price (cost_model_traffic.py), 5. one prediction
(cost_model_predict.py), 6. tables and figures, and one node's MFU against marin's (cost_model_tables.py), 7. this
machine, measured (cost_model_check.py); 8. the command line is this file, and its names are the model's to import;
9. DTensorMuon's step by groups (exchange_bytes), overlapped (overlap=K): a pipeline (cost_model_overlap.py), and
against this machine (cost_model_check_overlap.py).
"""

from __future__ import annotations

import argparse
import sys

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import muon_tools  # noqa: E402
from distmuon.dtensor.plan import ONE_PER_OWNER  # noqa: E402
from cost_model_check import CHECK_RANKS, CHECK_ROUNDS, check_here  # noqa: E402
from cost_model_check_overlap import HERE_RANKS, check_overlap_here  # noqa: E402
from cost_model_inputs import H100, LLAMA3, MODELS, Cluster, Model, Param  # noqa: E402
from cost_model_overlap import (OVERLAP_KS, OVERLAP_SIZES, dtensor_groups, format_overlap, link_order,  # noqa: E402
                                overlap_chapter, pipeline, predict_overlap, scenario_overlap)
from cost_model_plans import (Mesh, dtensor_plan, dtensor_transfers, held, lesson_optimizer, param_order,  # noqa: E402
                              placed_copies)
from cost_model_predict import (FLAT, GROUPS, NORMUON, Scenario, baseline_of, dtensor_algorithms,  # noqa: E402
                                forward_backward_seconds, predict_costs, summarize)
from cost_model_tables import chapter, format_rows, mfu_with, ms, predict, scenario_title  # noqa: E402
from cost_model_traffic import Cost, Traffic, dtensor_cost, lesson_cost  # noqa: E402

# The model's names as its importers (the tests, benchmarks/at_scale.py and peers_1gpu.py) use them; each is
# defined once, in its section's module.
__all__ = ["Cluster", "Cost", "FLAT", "GROUPS", "H100", "LLAMA3", "MODELS", "Mesh", "Model", "NORMUON", "Param",
           "Scenario", "Traffic", "baseline_of", "chapter", "check_here", "check_overlap_here", "dtensor_algorithms",
           "dtensor_cost", "dtensor_groups", "dtensor_plan", "dtensor_transfers", "format_overlap", "format_rows",
           "forward_backward_seconds", "held", "lesson_cost", "lesson_optimizer", "link_order", "main", "mfu_with",
           "ms", "overlap_chapter", "param_order", "pipeline", "placed_copies", "predict", "predict_costs",
           "predict_overlap", "scenario_overlap", "scenario_title", "summarize"]

# =============================================================================
# 8. The command line
# =============================================================================

# The model plans every rank, so its time grows with the GPUs (notes/measured/from_code_comments.md). 16,384 H100s
# is the largest training run the chapter cites (Llama 3 405B's, "The Llama 3 Herd of Models", section 3.3).
MAX_GPUS = 16384
PREDICTION_OPTIONS = ("model", "gpus", "tp", "ep", "normuon")  # one scenario's; --chapter and --check-here take none
CHECK_OPTIONS = ("d", "layers", "rounds")  # --check-here's and --check-overlap-here's
HERE_EXCHANGE_BYTES = 256 << 10  # --check-overlap-here's groups: 2 or 3 of the model's matrices at d = 128
OVERLAP_OPTIONS = ("overlap", "exchange_bytes")  # one scenario's DTensorMuon by groups (section 9)
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "": 1}


def comma_list(kind, minimum, what):
    """An argparse type: a comma-separated list of `kind` (parse one item), each >= minimum."""
    def parse(text):
        try:
            values = [kind(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {what}") from None
        if any(not isinstance(v, str) and v < minimum for v in values):  # a str: a name (one_per_owner)
            raise argparse.ArgumentTypeError(f"{text!r}: each must be >= {minimum}")
        return values
    return parse


def size(text):
    """Bytes: an integer, or one with KiB, MiB or GiB after it (256MiB); or one_per_owner (DTensorMuon's
    exchange_bytes: groups in which each owner has one matrix)."""
    if text == ONE_PER_OWNER:
        return text
    for unit, factor in UNITS.items():
        if text.endswith(unit) and text[:len(text) - len(unit)].isdigit():
            return int(text[:len(text) - len(unit)]) * factor
    raise ValueError(text)


def main(argv=None):
    p = muon_tools.OneLineParser(description="Predict a distributed Muon step on a cluster from the project's own plans.")
    p.add_argument("--model", choices=sorted(MODELS), help="the model (default llama3-8b)")
    p.add_argument("--gpus", type=int, help="GPUs (default 64)")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default 8; 1 for an MoE)")
    p.add_argument("--ep", type=int, default=None, help="expert parallel size of an MoE (default 64)")
    p.add_argument("--normuon", action="store_true",
                   help="add NorMuon's rows: owner, comm-free and DTensorMuon with their matrices on NorMuon")
    p.add_argument("--chapter", action="store_true", help="every table and figure of notes/12-cost-model.md")
    p.add_argument("--json", metavar="PATH", help="--chapter: write its figures as JSON")
    p.add_argument("--figure", metavar="PATH", help="--chapter: write its three plots as a PNG")
    p.add_argument("--check-here", action="store_true", help="this machine's measured steps against the model")
    p.add_argument("--d", type=int, help="--check-here: model width (default 128)")
    p.add_argument("--layers", type=int, help="--check-here: layers (default 4)")
    p.add_argument("--rounds", type=int, help=f"--check-here: timed steps of each (default {CHECK_ROUNDS})")
    p.add_argument("--overlap", type=comma_list(int, 0, "integers"), metavar="K[,K...]",
                   help="DTensorMuon by groups: its step at each overlap=K (default "
                        f"{','.join(map(str, OVERLAP_KS))}), one scenario")
    p.add_argument("--exchange-bytes", type=comma_list(size, 1, "sizes (4096, 256MiB, 1GiB, one_per_owner)"),
                   metavar="N[,N...]", help="DTensorMuon by groups: its exchange_bytes (default 256MiB,1GiB; "
                                            "one_per_owner: groups in which each owner has one matrix)")
    p.add_argument("--overlap-table", action="store_true",
                   help="DTensorMuon by groups and overlapped: notes/12-cost-model.md's table")
    p.add_argument("--check-overlap-here", action="store_true",
                   help=f"DTensorMuon by groups, overlapped, on {HERE_RANKS} ranks here against the model (--exchange-bytes: "
                        f"one size, default {HERE_EXCHANGE_BYTES >> 10}KiB)")
    args = p.parse_args(argv)
    given = lambda names: [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]  # noqa: E731
    runs = (args.chapter, args.check_here, args.overlap_table, args.check_overlap_here)
    if sum(map(bool, runs)) > 1:
        p.error("--chapter, --check-here, --overlap-table and --check-overlap-here are separate runs: give one")
    scenario = given(PREDICTION_OPTIONS + OVERLAP_OPTIONS[:1 if args.check_overlap_here else 2])
    if any(runs) and scenario:
        p.error(f"{' '.join(scenario)}: one scenario's options, not --chapter's, --check-here's, --overlap-table's or "
                "--check-overlap-here's")
    if given(CHECK_OPTIONS) and not (args.check_here or args.check_overlap_here):
        p.error(f"{' '.join(given(CHECK_OPTIONS))}: only with --check-here or --check-overlap-here (they size its model)")
    if args.check_overlap_here and args.exchange_bytes and len(args.exchange_bytes) > 1:
        p.error("--check-overlap-here takes one --exchange-bytes")
    if (args.json or args.figure) and not args.chapter:
        p.error("--json and --figure go with --chapter")
    for path, option in ((args.json, "--json"), (args.figure, "--figure")):
        if path:
            try:
                muon_tools.check_writable(path, option)
            except ValueError as e:
                p.error(str(e))
    if args.chapter:
        chapter(args.json, args.figure)
        return 0
    if args.overlap_table:
        overlap_chapter()
        return 0
    if args.check_here or args.check_overlap_here:
        d, layers, rounds = (v if v is not None else default for v, default in
                             zip((args.d, args.layers, args.rounds), (128, 4, CHECK_ROUNDS)))
        if d < 1 or layers < 1 or rounds < 1:
            p.error("--d, --layers and --rounds must be >= 1")
        import scaling

        why = scaling.memory_error(d, layers, max(CHECK_RANKS) if args.check_here else HERE_RANKS)
        if why:
            p.error(why)
        if args.check_here:
            check_here(d, layers, rounds)
        else:
            check_overlap_here(d, layers, rounds, (args.exchange_bytes or [HERE_EXCHANGE_BYTES])[0])
        return 0
    model = MODELS[args.model or "llama3-8b"]
    gpus = args.gpus if args.gpus is not None else 64
    tp = args.tp if args.tp is not None else (1 if model.experts else 8)
    ep = (args.ep if args.ep is not None else 64) if model.experts else 0
    if gpus < 1 or tp < 1 or (model.experts and (ep < 1 or tp != 1)):
        p.error("--gpus and --tp must be >= 1; an MoE takes --ep >= 1 and no TP")
    if gpus > MAX_GPUS:
        p.error(f"--gpus {gpus}: at most {MAX_GPUS} (the model plans every rank: Llama 3 405B's 16,384 GPUs take 41 s)")
    if args.ep is not None and not model.experts:
        p.error(f"--ep applies to an MoE; {model.name} is dense")
    s = Scenario(model, gpus, tp=tp, ep=ep, normuon=args.normuon)
    if given(OVERLAP_OPTIONS):
        try:
            table = format_overlap(s, H100, args.exchange_bytes or OVERLAP_SIZES, args.overlap or OVERLAP_KS)
        except ValueError as e:
            p.error(str(e))
        print(f"{scenario_title(s, H100)}\nCluster: {H100.name}; DTensorMuon by groups" + (", NorMuon" * args.normuon))
        print(table)
        return 0
    try:
        rows, fwd_bwd, _ = predict(s, H100)
    except ValueError as e:
        p.error(str(e))
    print(f"{scenario_title(s, H100)}; forward + backward {ms(fwd_bwd)} ms\nCluster: {H100.name}")
    print(format_rows(rows, fwd_bwd))
    return 0


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
