"""Why comm-free beats even AdamW ZeRO-1 in wall time on this machine: what each Gloo
collective costs for the same logical bytes. 8 ranks (1 thread each) move a buffer of N
float32 per rank, where a ring reduce-scatter, a ring all-gather and a direct all-to-all
all send (8 - 1) / 8 * N elements per rank.

    python benchmarks/gloo_collectives.py     # about 30 s on 2 cores
"""

import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distributed_muon_cpu as dm  # noqa: E402

WORLD, REPEATS = 8, 9
SIZES = (1 << 16, 1 << 20, 1 << 22)  # float32 elements per rank: 256 KiB, 4 MiB, 16 MiB


def collectives(n):
    shard = n // WORLD
    full, part = torch.ones(n), torch.ones(shard)
    return {
        "reduce-scatter (RS)": lambda: dm._reduce_scatter_single(torch.empty(shard), full, op=dist.ReduceOp.SUM),
        "all-gather (AG)": lambda: dm._all_gather_single(torch.empty(n), part),
        "all-to-all": lambda: dist.all_to_all_single(torch.empty(n), full),
        "all-reduce": lambda: dist.all_reduce(full),
    }


def rank_main(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    times = {}
    for n in SIZES:
        for name, fn in collectives(n).items():
            samples = []
            for _ in range(REPEATS):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
            times[(n, name)] = statistics.median(samples)
    torch.save(times, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def main():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(rank_main, args=(dm.free_port(), out_dir), nprocs=WORLD, start_method=dm.start_method())
        per_rank = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(WORLD)]
    print(f"Gloo, {WORLD} ranks on this machine, median of {REPEATS}, slowest rank; torch {torch.__version__}\n")
    names = list(collectives(WORLD))
    rows = []
    for n in SIZES:
        sent = dm.human_bytes((WORLD - 1) * n // WORLD * 4)
        rows.append([dm.human_bytes(n * 4), sent] +
                    [f"{max(t[(n, name)] for t in per_rank):.1f}" for name in names])
    print(dm.format_table(["buffer/rank", "ring/direct bytes sent/rank", *(f"{x} ms" for x in names)], rows,
                          [">"] * (2 + len(names))))


if __name__ == "__main__":
    main()
