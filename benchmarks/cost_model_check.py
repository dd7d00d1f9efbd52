"""The cost model against this machine (benchmarks/cost_model.py --check-here): the library's per-call costs
measured here, fed to the model, and its times compared with steps measured on 1, 2 and 4 processes."""

from __future__ import annotations

import datetime
import math
import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import distributed_muon_cpu
from distmuon import owners
import muon_tools
from distmuon.adamw import adamw_step_
from cost_model_inputs import Cluster
from cost_model_plans import lesson_optimizer
from cost_model_predict import summarize
from cost_model_tables import ms
from cost_model_traffic import FP32, lesson_cost


# =============================================================================
# 7. This machine, measured: the model fed what --check-here measures here (the library's own collectives, Newton-
#    Schulz and elementwise steps, each at a tiny size and at the step's), against steps measured on 1, 2 and 4
#    processes (benchmarks/scaling.py's model and timing)
# =============================================================================
# What a step costs beyond its bytes and FLOPs is mostly per call: a collective's fixed cost (Gloo's rendezvous, the
# library's wrapper), a Newton-Schulz call's (a dozen small ops), a parameter part's elementwise step, and the step's
# own Python around every parameter (its bookkeeping: the vote, the buffers, the loops). Each is measured here, the
# least disturbed of many tries (the minimum, as the steps are compared by their minimum), and priced per call as the
# plan counts the calls; the bookkeeping per parameter alone is fitted, from each optimizer's step at d = TINY_D, where
# every size-dependent term is a few percent of it. Ranks that outnumber the cores share them ("shared cores").

CHECK_RANKS = (1, 2, 4)
CHECK_ROUNDS = 15  # steps of every variant, interleaved; the minimum of 15 is steadier than of 5 on a shared machine
TINY_D = 8  # the width at which a step is its per-call costs
PROBE_NUMELS = (1, 1 << 15, 1 << 17)  # float32 elements a rank sends a peer: a tiny call, a 64K-element bucket's
# shard (the step's), and 4 times that (for the bandwidth's fit)
PROBE_REPEATS = 25
UNIT_REPEATS = 200
NS_ROUNDS = 20  # rounds of Newton-Schulz on the model's shapes, alone and all at once
NS_REPEATS = 3
BAND = 0.25  # the issue's: predicted within 25 % of the least disturbed step


def probe_rank(rank, world, port, out_dir, shapes):
    """One of `world` ranks: {op: [(bytes the Ledger counts for the call, typical seconds, typical CPU seconds of the
    process, Gloo's threads included)] at each of PROBE_NUMELS} of the library's own collectives (the lesson's
    all_gather, reduce_scatter and all_reduce, section 7's exchange); and the seconds of NS_ROUNDS rounds of
    Newton-Schulz on `shapes`, rank 0 alone, then every rank at once (sharing the cores, and their matrix units)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    axis, ledger, out = distributed_muon_cpu.make_grid(world, 1, rank).dp, distributed_muon_cpu.Ledger(), {}
    for n in PROBE_NUMELS:
        shard, bucket = torch.ones(n), torch.ones(n * world)
        sends, receive = [[torch.ones(n)] if i != rank else [] for i in range(world)], [n * (i != rank) for i in range(world)]
        calls = {"all_gather": lambda: distributed_muon_cpu.all_gather(shard, axis, ledger, "probe"),
                 "reduce_scatter": lambda: distributed_muon_cpu.reduce_scatter(bucket, axis, ledger, "probe"),
                 "all_reduce": lambda: distributed_muon_cpu.all_reduce(shard.clone(), axis, ledger, "probe"),
                 "all_to_all": lambda: owners.exchange(sends, receive, axis, ledger, "probe", FP32, "cpu")()}
        for op, call in calls.items():
            samples, cpu = [], []
            for _ in range(PROBE_REPEATS):
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            last = ledger.comm[-1]
            out.setdefault(op, []).append((max(last["sent"], last["received"]), statistics.median(samples),
                                           statistics.median(cpu)))
    matrices = [torch.randn(s) for s in shapes]

    def rounds():
        t0 = time.perf_counter()
        for _ in range(NS_ROUNDS):
            for m in matrices:
                distributed_muon_cpu.newton_schulz(m)
        return time.perf_counter() - t0

    rounds()  # warm up (the first calls of a shape allocate)
    alone, together = [], []
    for _ in range(NS_REPEATS):  # the least disturbed of each
        dist.barrier()
        alone.append(rounds() if rank == 0 else 0.0)
        dist.barrier()
        together.append(rounds())
    out["newton-schulz"] = (min(alone), min(together))
    muon_tools.write_atomically(os.path.join(out_dir, f"{rank}.pt"), lambda f: torch.save(out, f))
    dist.destroy_process_group()


def fit_line(points):
    """(intercept us, GB/s) of seconds against bytes, least squares through (bytes, seconds) points; a slope the
    noise made negative is none (infinite GB/s)."""
    n = len(points)
    mean_b, mean_t = sum(b for b, _ in points) / n, sum(t for _, t in points) / n
    slope = (sum((b - mean_b) * (t - mean_t) for b, t in points)
             / max(sum((b - mean_b) ** 2 for b, _ in points), 1e-30))
    if slope <= 0:
        return mean_t * 1e6, math.inf
    return max(mean_t - slope * mean_b, 0.0) * 1e6, 1 / slope / 1e9


def collective_costs(world, shapes):
    """({op: ((us a call, GB/s), (CPU us a call, CPU GB/s))}, Newton-Schulz's slowdown) on `world` ranks here, the
    slowest rank's: a collective's fixed cost and its bandwidth, fitted to its typical times at PROBE_NUMELS,
    in time and in the CPU a rank's process spends (its own and Gloo's threads: what the ranks take from each other's
    compute where they share cores); how many times longer Newton-Schulz takes when every rank runs it at once than
    on one rank alone (probe_rank)."""
    with tempfile.TemporaryDirectory() as out_dir:
        muon_tools.run_processes(probe_rank, (world, muon_tools.free_port(), out_dir, shapes), world,
                                 folders=(out_dir,))
        ranks = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]
    ops = [op for op in ranks[0] if op != "newton-schulz"]
    costs = {op: tuple(fit_line([(b, max(r[op][i][k] for r in ranks)) for i, (b, *_) in enumerate(ranks[0][op])])
                       for k in (1, 2)) for op in ops}
    return costs, max(r["newton-schulz"][1] for r in ranks) / ranks[0]["newton-schulz"][0]


def typical_seconds(call, repeats=UNIT_REPEATS):
    """The median seconds of `repeats` calls: a step makes many such calls, and its least disturbed run is a sum of
    typical ones, not of the fastest."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def unit_costs(specs):
    """This process's (one thread) per-call costs and rates, each the median of many calls, with the library's own
    functions: Newton-Schulz on a 2 x 2 matrix (its fixed cost) and on every matrix shape of `specs` (its rate, that
    fixed cost aside), one part's Muon step (muon_update, then apply_muon_update_) and AdamW step (adamw_step_) on one
    element, applying an update alone, and an fp32 lerp_ (12 bytes an element) for the elementwise bandwidth."""
    torch.set_num_threads(1)
    group = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=None)
    adamw = dict(lr=0.02, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    tiny = torch.randn(2, 2)
    ns_call = typical_seconds(lambda: distributed_muon_cpu.newton_schulz(tiny))
    shapes = ns_shapes(specs)
    flops = sum(distributed_muon_cpu.newton_schulz_flops(s) for s in shapes)
    ns = sum(typical_seconds(lambda m=torch.randn(s): distributed_muon_cpu.newton_schulz(m),
                             20) for s in shapes) - len(shapes) * ns_call
    one, buf, p = torch.randn(1), torch.zeros(1), torch.zeros(1)
    state = dict(step=torch.tensor(0.0), exp_avg=torch.zeros(1), exp_avg_sq=torch.zeros(1))
    n = 1 << 22
    a, b = torch.randn(n), torch.randn(n)
    return dict(ns_tflops=flops / max(ns, 1e-9) / 1e12, ns_call_us=ns_call * 1e6,
                muon_part_us=typical_seconds(lambda: distributed_muon_cpu.apply_muon_update_(
                    p, distributed_muon_cpu.muon_update(buf, one, group), group, (1, 1))) * 1e6,
                adamw_part_us=typical_seconds(lambda: adamw_step_(p, one, state, adamw)) * 1e6,
                apply_us=typical_seconds(lambda: distributed_muon_cpu.apply_muon_update_(p, one, group, (1, 1))) * 1e6,
                hbm_gbs=12 * n / typical_seconds(lambda: a.lerp_(b, 0.05), 7) / 1e9)


def ns_shapes(specs):
    """The distinct shapes of the matrices Newton-Schulz takes."""
    return sorted({s.global_shape for s in specs if s.group == "muon"})


def gloo_threads():
    """The worker threads on which Gloo runs a process group's collectives: torch's default, from ProcessGroupGloo's
    options (a private field: 2, its value in torch 2.14, if it moved)."""
    try:
        return dist.ProcessGroupGloo._Options()._threads
    except AttributeError:
        return 2


def this_machine(units, collectives, ns_shared, world):
    """A Cluster of this machine's measured figures for a run of `world` ranks, all on one "node" (Gloo over
    loopback): each collective's fixed cost and bandwidth (collective_costs), the latency of its messages inside the
    former; the unit costs of this process (unit_costs); Newton-Schulz's slowdown when every rank runs it at once."""
    call_us = tuple((op, us) for op, ((us, _), _) in sorted(collectives.items()))
    op_gbs = tuple((op, gbs) for op, ((_, gbs), _) in sorted(collectives.items()))
    cpu_call_us = tuple((op, us) for op, (_, (us, _)) in sorted(collectives.items()))
    cpu_gbs = tuple((op, gbs) for op, (_, (_, gbs)) in sorted(collectives.items()))
    gbs = dict(op_gbs).get("all_to_all", 1.0)
    # the lesson's unfused ops: Muon 48 bytes an element (lerp_ 12, lerp 12, bf16 cast 6, decay 8, add_ 10),
    # torch's single-tensor AdamW 80 (mul_ 8, lerp_ 12, mul_ 8, addcmul_ 12, sqrt / div / add_ 24, addcdiv_ 16)
    return Cluster(f"this machine: {world} Gloo rank{'s' * (world > 1)} on {os.cpu_count()} cores", gpus_per_node=64,
                   intra_gbs=gbs, inter_gbs=gbs, intra_us=0.0, inter_us=0.0, train_tflops=1.0, muon_bytes=48,
                   adamw_bytes=80, call_us=call_us, op_gbs=op_gbs, cpu_call_us=cpu_call_us, cpu_gbs=cpu_gbs,
                   ns_shared=ns_shared, cores=os.cpu_count() or 1, in_flight=gloo_threads(), **units)


def scaling_specs(d, layers):
    """benchmarks/scaling.py's model as the lesson's ParamSpecs (TP = 1: nothing is split)."""
    import scaling

    matrices, vectors = scaling.shapes(d, layers)
    return [distributed_muon_cpu.ParamSpec(n, s, -1, "muon") for n, s in matrices.items()] + \
        [distributed_muon_cpu.ParamSpec(n, s, -1, "adamw") for n, s in vectors.items()]


def check_costs(specs, ranks):
    """{variant: Cost} of scaling.py's variants on `ranks` ranks (DP = ranks), and torch's step on one."""
    import scaling

    node_of = lambda r: 0  # noqa: E731  -- one machine
    costs = {}
    if ranks == 1:
        costs[scaling.TORCH] = lesson_cost(lesson_optimizer(specs, muon_tools.RunConfig(dp=1, tp=1)), node_of,
                                           scaling.TORCH)
    for variant, (strategy, options) in scaling.VARIANTS.items():
        # (RunConfig's bucket_size is DistributedMuon's default, which scaling.py's optimizers take)
        cfg = muon_tools.RunConfig(dp=ranks, tp=1, strategy=strategy, overlap=options.get("overlap", 0))
        costs[variant] = lesson_cost(lesson_optimizer(specs, cfg), node_of, variant)
    for cost in costs.values():  # every rank's step walks every parameter (its bookkeeping: Cluster.param_us)
        cost.calls["params"] = [len(specs)] * cost.world
    return costs


def predicted(row, ranks, variant):
    """The model's step: communication + compute; with --overlap on more than one rank, Row.overlap_s (the largest of
    communication over the collectives in flight at once, compute, and the shared cores' floor)."""
    import scaling

    return row.overlap_s if scaling.VARIANTS.get(variant, (None, {}))[1].get("overlap") and ranks > 1 else row.step_s


TERMS = ("bandwidth", "calls", "NS FLOPs", "NS calls", "elementwise", "parts", "bookkeeping", "shared cores")


def check_here(d, layers, rounds, print_fn=print):
    """Predicted against measured: torch's step in one process and every strategy of scaling.py on 1, 2 and 4 ranks,
    each term of the prediction shown."""
    import scaling

    load = os.getloadavg()[0]
    specs, tiny_specs = scaling_specs(d, layers), scaling_specs(TINY_D, layers)
    units = unit_costs(specs)
    measured = {1: scaling.on_one_process(d, layers, rounds)}
    tiny = scaling.on_one_process(TINY_D, layers, rounds)
    machines = {1: this_machine(units, {}, 1.0, 1)}
    for ranks in CHECK_RANKS[1:]:
        machines[ranks] = this_machine(units, *collective_costs(ranks, ns_shapes(specs)), ranks)
        measured[ranks] = scaling.on_ranks(ranks, d, layers, rounds=rounds)
    # the bookkeeping per parameter, fitted: what each variant's least disturbed step at d = TINY_D leaves unexplained
    param_us = {}
    for variant, cost in check_costs(tiny_specs, 1).items():
        modeled = summarize(cost, machines[1]).step_s
        param_us[variant] = max(min(tiny[variant]) / 1e3 - modeled, 0.0) / len(tiny_specs) * 1e6
    print_fn(f"This machine: {os.cpu_count()} cores; torch {torch.__version__}; {layers} layers at d = {d} "
             f"(benchmarks/scaling.py's model, {len(specs)} parameters), {rounds} interleaved steps of each, the slowest "
             f"rank's; load average {load:.1f} at the start (other jobs share the cores: the minimum is the least "
             f"disturbed step, the median feels them)")
    print_fn(f"  * Newton-Schulz: {units['ns_tflops'] * 1e3:.1f} GFLOP/s on the model's shapes (bf16, one thread), "
             f"{units['ns_call_us']:.0f} us a call (a 2 x 2 matrix)")
    print_fn(f"  * a part's elementwise step: Muon {units['muon_part_us']:.0f} us, AdamW {units['adamw_part_us']:.0f} us, "
             f"an update applied {units['apply_us']:.0f} us; fp32 lerp_ {units['hbm_gbs']:.1f} GB/s")
    for ranks in CHECK_RANKS[1:]:
        m = machines[ranks]
        ops = ", ".join(f"{op} {us:.0f} us + {gbs:.2f} GB/s (CPU {cpu:.0f} us + {cpu_gbs:.2f} GB/s)"
                        for (op, us), (_, gbs), (_, cpu), (_, cpu_gbs) in zip(m.call_us, m.op_gbs, m.cpu_call_us, m.cpu_gbs))
        print_fn(f"  * {ranks} ranks: the library's collectives, a call + its bytes: {ops}; Newton-Schulz "
                 f"{m.ns_shared:.2f} x as long when every rank runs it at once")
    print_fn(f"  * bookkeeping, fitted at d = {TINY_D} (per parameter, every rank): "
             + ", ".join(f"{v} {us:.0f} us" for v, us in param_us.items()))
    table, errors, outside = [], [], []
    for ranks in CHECK_RANKS:
        for variant, cost in check_costs(specs, ranks).items():
            row = summarize(cost, replace(machines[ranks], param_us=param_us[variant]))
            guess, times = predicted(row, ranks, variant), measured[ranks][variant]
            least, median = min(times) / 1e3, statistics.median(times) / 1e3
            errors.append((guess / least - 1, guess / median - 1))
            if abs(guess / least - 1) > BAND:  # (the calls of the busiest rank: every rank makes as many here)
                outside.append((ranks, variant, least - guess, least,
                                max(map(sum, zip(*cost.traffic.calls_table().values())), default=0)))
            table.append([ranks, variant] + [ms(row.terms[t]) for t in TERMS]
                         + [ms(guess), ms(least), ms(median), f"{guess / least - 1:+.0%}",
                            f"{guess / median - 1:+.0%}"])
    print_fn(muon_tools.format_table(["ranks", "step"] + [f"{t} ms" for t in TERMS]
                             + ["predicted ms", "min ms", "median ms", "vs min", "vs median"], table,
                             [">", "<"] + [">"] * (len(TERMS) + 5)))
    print_fn(f"(predicted: the sum of the terms; with --overlap on 2 or more ranks, the largest of communication "
             f"(bandwidth + calls) over Gloo's {gloo_threads()} worker threads, compute (NS to bookkeeping), and the "
             f"shared cores' floor)")
    for i, what in enumerate(("minimum", "median")):
        print_fn(f"|error| against the {what}: median {statistics.median(abs(e[i]) for e in errors):.0%}, largest "
                 f"{max(abs(e[i]) for e in errors):.0%}")
    for ranks, variant, missing, least, calls in outside:
        per_call = (f"; as the one term left, a collective's cost inside a step beyond the probe's: "
                    f"{missing / calls * 1e6:+,.0f} us on each of its {calls} calls" if calls else "")
        print_fn(f"outside +-{BAND:.0%}: {ranks} rank{'s' * (ranks > 1)}, {variant}: {missing * 1e3:+,.1f} ms unexplained "
                 f"({missing / least:+.0%} of its least disturbed step){per_call}")
    return table
