"""Figures for notes/: the gather flow on every grid of 8 ranks, and the effect of the bucket size.

    python benchmarks/sweep.py            # about a minute on 2 cores

Bytes are what each rank logically sends per step (ring counts: the lesson's Ledger,
section 2, summed by muon_tools/accounting.py); times are wall-clock on this machine, the median over the steps of the
slowest rank, and on 2 cores shared by 8 ranks they measure oversubscription as
much as the algorithm: compare them with each other, not with a GPU.
"""

import sys


if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import muon_tools  # noqa: E402

STEPS = 5


def quiet(*args, **kwargs):
    pass


def per_rank_max(result, phase):
    return max(result["bytes_per_step"][phase]["sent"])


def main(argv=None):
    muon_tools.OneLineParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help; no options
    print(f"Grids of 8 ranks, default model, {STEPS} steps, bucket size {muon_tools.RunConfig().bucket_size:,} elements\n")
    rows = []
    for dp, tp in [(8, 1), (4, 2), (2, 4), (1, 8)]:
        r = muon_tools.run(muon_tools.RunConfig(dp=dp, tp=tp, steps=STEPS), print_fn=quiet)
        assert r["passed"]
        phases = [muon_tools.human_bytes(per_rank_max(r, p)) for p in muon_tools.PHASES]
        total, _ = muon_tools.total_bytes(r["bytes_per_step"])
        rows.append([f"{dp}x{tp}", *phases, muon_tools.human_bytes(total),
                     f"{max(r['ns_flops']['per_rank']) / 1e9:.3f}",
                     f"{r['ns_flops']['redundancy']:.2f}", f"{r['timings']['step_ms_median']:.0f}"])
    header = ["DPxTP", *muon_tools.PHASES, "total/rank", "NS GFLOP/rank (max)", "redundancy", "step ms"]
    print(muon_tools.format_table(header, rows, ["<"] + [">"] * (len(header) - 1)))

    print(f"\nBucket size on DP=4 x TP=2 ({STEPS} steps): fewer, larger DP messages\n")
    rows = []
    for bucket_size in (1, 8_192, 65_536, 1 << 20):
        r = muon_tools.run(muon_tools.RunConfig(dp=4, tp=2, steps=STEPS, bucket_size=bucket_size), print_fn=quiet)
        assert r["passed"]
        ledger = r["ledgers"][0]["comm"]
        calls = {p: sum(1 for c in ledger if c["step"] == STEPS and c["phase"] == p) for p in muon_tools.PHASES}
        padding = sum(b["numel"] - b["used"] for b in r["buckets"])
        rows.append([f"{bucket_size:,}", len(r["buckets"]), padding, calls["grad reduce-scatter"], calls["DP gather"],
                     calls["TP gather"], calls["param all-gather"],
                     muon_tools.human_bytes(muon_tools.total_bytes(r["bytes_per_step"])[0]),
                     f"{r['ns_flops']['redundancy']:.2f}", f"{r['timings']['step_ms_median']:.0f}"])
    print(muon_tools.format_table(["bucket size", "buckets", "padding", "RS calls", "DP gather calls",
                                   "TP gather calls",
                           "param AG calls", "total/rank", "redundancy", "step ms"], rows, ["<"] + [">"] * 9))


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
