"""What each Gloo collective costs for the same logical bytes, and why the script's reduce_scatter
does not use Gloo's: N ranks (1 thread each) move a buffer of M float32 per rank, where a ring
reduce-scatter, a ring all-gather and a direct all-to-all all send (N - 1) / N * M elements per
rank. "RS, all-to-all + sum" is the script's reduce_scatter on Gloo (section 2): an all-to-all,
then each rank adds the shards it received, in rank order.

    python benchmarks/gloo_collectives.py              # 8 ranks
    python benchmarks/gloo_collectives.py --ranks 2
"""

import datetime
import os
import statistics
import sys
import tempfile
import time


if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distmuon import collectives  # noqa: E402
import distributed_muon_cpu  # noqa: E402
import muon_tools  # noqa: E402

REPEATS = 9
SIZES = (1 << 16, 1 << 20, 1 << 22)  # float32 elements per rank: 256 KiB, 4 MiB, 16 MiB


def timed_collectives(n, world, dp_axis):
    shard = n // world
    full, part = torch.ones(n), torch.ones(shard)
    return {
        "Gloo's reduce-scatter (RS)": lambda: collectives.reduce_scatter_single(torch.empty(shard), full,
                                                                        op=dist.ReduceOp.SUM),
        "RS, all-to-all + sum": lambda: distributed_muon_cpu.reduce_scatter(full, dp_axis, distributed_muon_cpu.Ledger(),
                                                           "grad reduce-scatter"),
        "all-gather (AG)": lambda: collectives.all_gather_single(torch.empty(n), part),
        "all-to-all": lambda: dist.all_to_all_single(torch.empty(n), full),
        "all-reduce": lambda: dist.all_reduce(full),
    }


def rank_main(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    dp_axis = distributed_muon_cpu.make_grid(world, 1, rank).dp
    times = {}
    for n in SIZES:
        for name, fn in timed_collectives(n, world, dp_axis).items():
            samples = []
            for _ in range(REPEATS):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
            times[(n, name)] = statistics.median(samples)
    muon_tools.write_atomically(os.path.join(out_dir, f"{rank}.pt"), lambda f: torch.save(times, f))
    dist.destroy_process_group()


def main(argv=None):
    p = muon_tools.OneLineParser(description="What each Gloo collective costs for the same logical bytes.")
    p.add_argument("--ranks", type=int, default=8, help="ranks (default %(default)s)")
    world = p.parse_args(argv).ranks
    if not 2 <= world <= muon_tools.MAX_WORLD:
        p.error(f"--ranks must be in [2, {muon_tools.MAX_WORLD}] (got {world})")
    with tempfile.TemporaryDirectory() as out_dir:
        muon_tools.run_processes(rank_main, (world, muon_tools.free_port(), out_dir), world, folders=(out_dir,))
        per_rank = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]
    print(f"Gloo, {world} ranks on this machine, median of {REPEATS}, slowest rank; torch {torch.__version__}\n")
    names = [name for n, name in per_rank[0] if n == SIZES[0]]  # in the order they ran
    rows = []
    for n in SIZES:
        sent = muon_tools.human_bytes((world - 1) * n // world * 4)
        rows.append([muon_tools.human_bytes(n * 4), sent] +
                    [f"{max(t[(n, name)] for t in per_rank):.1f}" for name in names])
    print(muon_tools.format_table(["buffer/rank", "ring/direct bytes sent/rank", *(f"{x} ms" for x in names)], rows,
                          [">"] * (2 + len(names))))


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
