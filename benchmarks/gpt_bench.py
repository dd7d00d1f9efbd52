"""What the GPT benchmarks share: examples/train_gpt.py on the path, a headless pyplot, and the
command line's ending (--json, --figure, checked before anything runs; errors as the lesson's)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from examples import train_gpt  # noqa: E402,F401  (the GPT benchmarks import it from here)

from distmuon import owners  # noqa: E402,F401  (train_gpt put the repository on the path)
import muon_tools  # noqa: E402  (train_gpt put the repository on the path)


def pyplot():
    """matplotlib's pyplot, drawing to files only (no screen needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def main(parser, measure, plot, argv=None, inputs=lambda args: {}):
    """Add --json and --figure to parser, parse argv, run measure(args) (it prints its tables and
    returns what --json writes), then plot(result, path) for --figure; returns the exit code.
    inputs(args): {what: path} of the files the command reads, which neither output may be."""
    parser.add_argument("--json", metavar="PATH", help="write the figures")
    parser.add_argument("--figure", metavar="PATH", help="draw them (PNG)")
    args = parser.parse_args(argv)

    def work():
        muon_tools.check_outputs({"--json": args.json, "--figure": args.figure})
        for path, option in ((args.json, "--json"), (args.figure, "--figure")):
            if path:
                muon_tools.check_writable(path, option, inputs=inputs(args))
        result = measure(args)
        muon_tools.write_json(args.json, result)
        if args.figure:
            plot(result, args.figure)
        return 0

    return muon_tools.exit_code(work)
