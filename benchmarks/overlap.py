"""Does overlapping the step help here? The owner and comm-free strategies with and without
--overlap (section 6: the step pipelined bucket by bucket, every collective asynchronous), on the
demo model over 8 ranks, each run checked against torch.

    python benchmarks/overlap.py          # about 3 minutes on 2 cores

The runs alternate (plain, overlapped, plain, ...) so that drift in the machine's load hits every
variant alike; the figure is the median over runs of each run's median step (slowest rank).
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distributed_muon_cpu as dm  # noqa: E402

ROUNDS = 3
CONFIG = dict(dp=8, tp=1, layers=8, steps=6)  # 40 matrices: 5 per rank, balanced
OWNER_PHASES = ("gather at owner", "scatter from owner")


def main():
    print(f"{CONFIG}, {ROUNDS} rounds, {os.cpu_count()} cores here\n")
    variants = [(s, o) for s in ("owner", "comm-free") for o in (False, True)]
    step_ms = {v: [] for v in variants}
    bytes_sent, calls = {}, {}
    for _ in range(ROUNDS):
        for strategy, overlap in variants:
            r = dm.run(dm.RunConfig(strategy=strategy, overlap=overlap, **CONFIG), print_fn=lambda *a, **k: None)
            assert r["passed"]
            step_ms[strategy, overlap].append(r["timings"]["step_ms_median"])
            bytes_sent[strategy, overlap] = r["bytes_sent_all_ranks"]
            last_step = [c for c in r["ledgers"][0]["comm"] if c["step"] == CONFIG["steps"]]
            calls[strategy, overlap] = sum(c["phase"] in OWNER_PHASES for c in last_step)
    rows = [[s + (" --overlap" if o else ""), calls[s, o], dm.human_bytes(bytes_sent[s, o]),
             " ".join(f"{t:.0f}" for t in step_ms[s, o]), f"{statistics.median(step_ms[s, o]):.0f}"]
            for s, o in variants]
    print(dm.format_table(["strategy", "owner exchanges/step", "bytes/step, all ranks", "step ms per run",
                           "median ms"], rows, ["<", ">", ">", ">", ">"]))


if __name__ == "__main__":
    main()
