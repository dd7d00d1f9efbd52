"""The cost model's DTensorMuon by groups against this machine (benchmarks/cost_model.py --check-overlap-here): its
step on 2 Gloo ranks, one exchange and exchange_bytes groups at overlap K = 0, 1, 2, timed, beside section 9's
pipeline fed what --check-here measures here (the library's collectives, Newton-Schulz, the elementwise bandwidth)."""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import distributed_muon_cpu
import muon_tools
from cost_model_check import collective_costs, ns_shapes, scaling_specs, this_machine, unit_costs
from cost_model_inputs import Param
from cost_model_overlap import exchange_label, predict_overlap
from cost_model_plans import Mesh, placed_copies
from cost_model_tables import ms

HERE_RANKS = 2
HERE_KS = (0, 1, 2)


def variants(exchange_bytes):
    """(exchange_bytes, K) of every step timed: one exchange, then the groups at each K."""
    return [(None, 0)] + [(exchange_bytes, k) for k in HERE_KS]


def overlap_rank(rank, world, port, out_dir, shapes, exchange_bytes, rounds):
    """One of `world` ranks: DTensorMuon over the matrices `shapes` ({name: shape}, FSDP2's Shard(0) on a 1-D mesh)
    for every variant, the same parameters and gradients, stepped in turn `rounds` times after one untimed step:
    {variant: [this rank's seconds a step]}."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from distmuon.dtensor import DTensorMuon

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    start = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    grads = {n: torch.randint(-64, 65, s, generator=g).float() / 1024 for n, s in shapes.items()}
    steps = {}
    for eb, k in variants(exchange_bytes):
        params = {n: torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for n, t in start.items()}
        for n, p in params.items():
            p.grad = distribute_tensor(grads[n], mesh, [Shard(0)])
        steps[(eb, k)] = DTensorMuon(list(params.items()), lr=0.02, weight_decay=0.1, exchange_bytes=eb, overlap=k)
    times = {v: [] for v in steps}
    for i in range(rounds + 1):
        for v, opt in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            if i:
                times[v].append(time.perf_counter() - t0)
    muon_tools.write_atomically(os.path.join(out_dir, f"{rank}.pt"), lambda f: torch.save(times, f))
    dist.destroy_process_group()


def check_overlap_here(d, layers, rounds, exchange_bytes, print_fn=print):
    """Predicted against measured: DTensorMuon's step on HERE_RANKS ranks, one exchange and by groups."""
    import scaling

    load = os.getloadavg()[0]
    matrices, _ = scaling.shapes(d, layers)
    specs = [s for s in scaling_specs(d, layers) if s.group == "muon"]
    machine = this_machine(unit_costs(specs), *collective_costs(HERE_RANKS, ns_shapes(specs)), HERE_RANKS)
    with tempfile.TemporaryDirectory() as out_dir:
        muon_tools.run_processes(overlap_rank, (HERE_RANKS, muon_tools.free_port(), out_dir, matrices, exchange_bytes,
                                                rounds),
                         HERE_RANKS, folders=(out_dir,))
        ranks = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(HERE_RANKS)]
    measured = {v: [max(r[v][i] for r in ranks) for i in range(rounds)] for v in ranks[0]}  # the slowest rank's
    copies = placed_copies([Param(n, s, None, "muon") for n, s in matrices.items()], Mesh(HERE_RANKS, 1),
                           {"muon": 0})
    predicted = {}
    for eb in (None, exchange_bytes):
        for p in predict_overlap(copies, list(matrices), {0: "muon"}, {0: distributed_muon_cpu.NS_STEPS}, HERE_RANKS,
                                 lambda r: 0,
                                 machine, eb, (0,) if eb is None else HERE_KS):
            predicted[(eb, p.k)] = p
    print_fn(f"This machine: {os.cpu_count()} cores; torch {torch.__version__}; DTensorMuon on {HERE_RANKS} Gloo ranks "
             f"(FSDP2's Shard(0)), benchmarks/scaling.py's {len(matrices)} matrices at d = {d}, {rounds} interleaved "
             f"steps of each, the slowest rank's; load average {load:.1f} at the start")
    table = []
    for v in variants(exchange_bytes):
        p, times = predicted[v], measured[v]
        least, median = min(times), statistics.median(times)
        table.append([exchange_label(v[0]), "-" if v[0] is None else v[1],
                      len(p.groups), ms(p.link_s), ms(p.ns_s), ms(p.schedule.total), ms(p.step_s), ms(least),
                      ms(median), f"{p.step_s / least - 1:+.0%}", f"{p.step_s / median - 1:+.0%}"])
    print_fn(muon_tools.format_table(["exchange_bytes", "overlap K", "groups", "comm ms", "NS ms (busiest)",
                                      "pipeline ms",
                              "predicted ms", "min ms", "median ms", "vs min", "vs median"], table, ["<"] + [">"] * 10))
    print_fn("(predicted: section 9's pipeline with this machine's per-call costs; it takes the link as free while "
             f"Newton-Schulz runs, which {os.cpu_count()} cores shared by the ranks' Newton-Schulz and Gloo's threads "
             "are not; and it has no per-parameter or per-group cost of DTensorMuon's own Python)")
    return table
