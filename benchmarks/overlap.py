"""Does overlapping the owner exchange with Newton-Schulz help here? The owner strategy with
its exchanges cut into 1, 2 and 4 chunks (--overlap-chunks), each run checked against torch.

    python benchmarks/overlap.py          # about 2 minutes on 2 cores

The runs alternate (1, 2, 4, 1, 2, 4, ...) so that drift in the machine's load hits every
variant alike; the figure is the median over runs of each run's median step (slowest rank).
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distributed_muon_cpu as dm  # noqa: E402

CHUNKS = (1, 2, 4)
ROUNDS = 3
CONFIG = dict(dp=8, tp=1, layers=8, steps=6, strategy="owner")  # 40 matrices: 5 per rank, balanced


def main():
    print(f"Owner strategy, {CONFIG}, {ROUNDS} rounds\n")
    step_ms = {c: [] for c in CHUNKS}
    bytes_sent, calls = {}, {}
    for _ in range(ROUNDS):
        for chunks in CHUNKS:
            r = dm.run(dm.RunConfig(overlap_chunks=chunks, **CONFIG), print_fn=lambda *a, **k: None)
            assert r["passed"]
            step_ms[chunks].append(r["timings"]["step_ms_median"])
            bytes_sent[chunks] = r["bytes_sent_all_ranks"]
            last_step = [c for c in r["ledgers"][0]["comm"] if c["step"] == CONFIG["steps"]]
            calls[chunks] = sum(c["op"] == "all_to_all" for c in last_step)
    rows = [[c, calls[c], dm.human_bytes(bytes_sent[c]), " ".join(f"{t:.0f}" for t in step_ms[c]),
             f"{statistics.median(step_ms[c]):.0f}"] for c in CHUNKS]
    print(dm.format_table(["chunks", "all-to-alls/step", "bytes/step, all ranks", "step ms per run", "median ms"],
                          rows, [">", ">", ">", ">", ">"]))


if __name__ == "__main__":
    main()
