"""Does overlapping the step help here, and with which lookahead? The owner and comm-free strategies
with --overlap K for K = 0 (off), 1, 2 and 4 (section 7: the step pipelined bucket by bucket, every
collective asynchronous, Newton-Schulz K units behind the gradient reductions), timed as
benchmarks/scaling.py times them: step() only, gradients preset, one process and one thread per
rank, a step's time that of its slowest rank. Every variant is bit-identical to torch
(tests/test_strategies.py, tests/test_optimizer_api.py); only the time is measured here.

    python benchmarks/overlap.py                    # 2 ranks, 4 layers at d = 128, about 1 minute
    python benchmarks/overlap.py --ranks 4 --d 256 --rounds 3
"""

import os
import signal
import statistics
import sys

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import torch  # noqa: E402


import scaling  # noqa: E402  (its model, its timing and its launcher)
import muon_tools  # noqa: E402

LOOKAHEADS = (0, 1, 2, 4)
VARIANTS = {f"{s} --overlap {k}": (s, dict(overlap=k)) for s in scaling.OVERLAPPED for k in LOOKAHEADS}


def main(argv=None):
    p = muon_tools.OneLineParser(description="Step time with and without --overlap, over lookaheads.")
    p.add_argument("--ranks", type=int, default=2, help="ranks (DP = N, TP = 1; default %(default)s)")
    scaling.model_arguments(p, d=128, rounds=3, rounds_help="spawns, each timing every variant")
    args = p.parse_args(argv)
    if not 2 <= args.ranks <= scaling.muon_tools.MAX_WORLD:
        p.error(f"--ranks must be in [2, {scaling.muon_tools.MAX_WORLD}]")
    scaling.check_model(p, args, args.ranks)
    runs = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):  # every round times every variant: drift in the load hits them alike
        for v, times in scaling.on_ranks(args.ranks, args.d, args.layers, VARIANTS).items():
            runs[v] += times
    print(f"{args.ranks} ranks, {args.layers} layers at d = {args.d}, step() only, 1 thread per rank, "
          f"{args.rounds} x {scaling.ROUNDS} steps per variant, {os.cpu_count()} cores here; torch {torch.__version__}\n")
    rows = []
    for v, (strategy, options) in VARIANTS.items():
        off = statistics.median(runs[f"{strategy} --overlap 0"])
        median = statistics.median(runs[v])
        rows.append([strategy, options["overlap"], f"{min(runs[v]):.0f}", f"{median:.0f}", f"{median / off:.3f}"])
    print(muon_tools.format_table(["strategy", "K", "min ms", "median ms", "median / K = 0"], rows,
                          ["<", ">", ">", ">", ">"]))
    return 0


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
