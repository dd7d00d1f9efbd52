"""Section 10: accounting (bytes per phase, Newton-Schulz FLOPs, redundancy, balance) and the report."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict

import torch

from distmuon.large_runs import newton_schulz_flops_of
from distmuon.assignment import load_balance
from distmuon.owners import OPTIMIZERS, strategy_class
from muon_tools.settings import BASELINE, MUON_GROUP, demo_row_layouts, demo_specs, run_kind
from muon_tools.reference import muon_groups_of, verdict


# =============================================================================
# 10. Accounting
# =============================================================================
# Bytes per phase come from each rank's Ledger (section 2); FLOPs from the
# Newton-Schulz calls each rank made. The redundancy factor is
#
#     sum over ranks of Newton-Schulz FLOPs  /  FLOPs of one device doing each matrix once.
#
# In the gather flow every TP peer orthogonalizes the same full matrix, and so does
# every DP rank whose shard touches it: the redundancy is TP x (how many DP
# shards a matrix touches, FLOP-weighted), at most DP x TP, which it reaches
# when every rank touches every matrix. The owner and comm-free strategies
# (section 7) give each matrix one owner instead: redundancy 1, and max/mean
# FLOPs per rank then says how well the owners are balanced.

BASELINE_PHASES = ("grad presence", "grad reduce-scatter", "param all-gather")


class Phases(Mapping):
    """{run kind: the phases of its data path, in the order they happen}: each strategy's own (its class's phases,
    every strategy of distmuon.owners.OPTIMIZERS, one registered later too), then the baseline's."""

    def __getitem__(self, kind):
        return BASELINE_PHASES if kind == BASELINE else strategy_class(kind).phases

    def __iter__(self):
        return iter((*OPTIMIZERS, BASELINE))

    def __len__(self):
        return len(OPTIMIZERS) + 1


PHASES_OF = Phases()
PHASES = PHASES_OF["gather"]


def bytes_per_step(ledgers, step, phases=PHASES):
    """{phase: {"axis", "dtype", "sent": [per rank], "received": [per rank]}} for one step."""
    table = {}
    for phase in phases:
        sent, received, axes, dtypes = [], [], set(), set()
        for ledger in ledgers:
            records = [r for r in ledger["comm"] if r["step"] == step and r["phase"] == phase]
            sent.append(sum(r["sent"] for r in records))
            received.append(sum(r["received"] for r in records))
            axes |= {r["axis"] for r in records}
            dtypes |= {r["dtype"] for r in records}
        table[phase] = dict(axis="/".join(sorted(axes)) or "-", dtype="/".join(sorted(dtypes)) or "-",
                            sent=sent, received=received)
    return table


def flops_per_step(ledgers, specs, step, ns_steps, muon_groups=(MUON_GROUP,), blocks=None):
    """Newton-Schulz FLOPs per rank; redundancy and max/mean are None where there is no Muon.
    blocks: {name: its blocks of rows} of the matrices orthogonalized by blocks (--ns-blocks)."""
    per_rank = [sum(r["flops"] for r in ledger["compute"] if r["step"] == step) for ledger in ledgers]
    single = sum(newton_schulz_flops_of(s.global_shape, ns_steps, (blocks or {}).get(s.name))
                 for s in specs if s.group in muon_groups)
    mean = sum(per_rank) / len(per_rank)
    return dict(per_rank=per_rank, single_device=single, redundancy=sum(per_rank) / single if single else None,
                max_over_mean=max(per_rank) / mean if mean else None)


def account(cfg, results):
    """Bytes per phase (last step), whether every step moved the same, and Newton-Schulz FLOPs."""
    ledgers = [r["ledger"] for r in results]
    phases = PHASES_OF[run_kind(cfg)]
    # and those of the options of section 8 a run took ("TP Gram", "QK-clip maxima", ...), as they came
    phases += tuple(dict.fromkeys(r["phase"] for ledger in ledgers for r in ledger["comm"] if r["phase"] not in phases))
    tables = [bytes_per_step(ledgers, s, phases) for s in range(1, cfg.steps + 1)]
    specs = demo_specs(cfg)
    blocks = ({} if cfg.ns_blocks == "whole" else
              {n: rows.blocks(cfg.ns_blocks == "heads") for n, rows in demo_row_layouts(specs, cfg).items()})
    flops = flops_per_step(ledgers, specs, cfg.steps, cfg.ns_steps, muon_groups_of(cfg), blocks)
    return tables[-1], all(t == tables[0] for t in tables), flops


def total_bytes(table, direction="sent"):
    """(max over ranks of bytes sent (or received) per step, the same by all ranks per step)."""
    per_rank = [sum(col) for col in zip(*(t[direction] for t in table.values()))]
    return max(per_rank), sum(per_rank)


def format_table(header, rows, aligns):
    if not len(header) == len(aligns) == (len(rows[0]) if rows else len(header)):
        raise ValueError(f"a table of {len(header)} columns needs as many aligns ({len(aligns)}) and cells")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(f"{str(x):{a}{w}}" for x, a, w in zip(row, aligns, widths))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def rounded_parts(parts, digits=0):
    """{name: value} rounded to `digits` decimals so that they add up to their rounded sum, as a printed line
    "total = a + b + c" must: each is rounded down, then the largest remainders up (Hare's method). Rounding
    each alone can miss by a unit per part."""
    unit = 10 ** digits
    floors = {k: math.floor(v * unit) for k, v in parts.items()}
    short = round(sum(parts.values()) * unit) - sum(floors.values())
    for k in sorted(parts, key=lambda k: floors[k] - parts[k] * unit)[:short]:
        floors[k] += 1
    return {k: v if digits == 0 else v / unit for k, v in floors.items()}


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def format_grid(dp, tp):
    """The rank layout as a small table."""
    grid = torch.arange(dp * tp).view(dp, tp)
    width = max(4, len(str(dp * tp - 1)) + 1)
    lines = ["      " + "".join(f"{'TP ' + str(t):>{width + 2}}" for t in range(tp))]
    for d in range(dp):
        lines.append(f"DP {d:<3}" + "".join(f"{r:>{width + 2}}" for r in grid[d].tolist()))
    return "\n".join(lines)


def format_buffer_map(layout):
    """--explain: which DP rank keeps which part of which parameter, and the padding."""
    dp, lines = layout.dp, []
    for b in layout.buckets:
        lines.append(f"bucket ({b.buffer_idx}, {b.bucket_idx}): {b.used:,} elements + {b.numel - b.used} padding "
                     f"= {b.numel:,}; DP shard = {b.numel // dp:,} elements")
        for name in b.names:
            start, end = layout.bucket_ranges[name]
            parts = " ".join(f"DP{r}[{m.param_slice.start}:{m.param_slice.stop}]"
                             for r, m in enumerate(ms[name] for ms in layout.metas) if m.local_numel)
            lines.append(f"    {name:<26} {str(layout.shapes[name]):<11} [{start:>6}, {end:>6})  {parts}")
        if b.numel > b.used:
            holders = " ".join(f"DP{r}" for r in range(dp) if b.shard_range(r, dp)[1] > b.used)
            lines.append(f"    {'(padding)':<26} {'':<11} [{b.used:>6}, {b.numel:>6})  {holders}")
    return "\n".join(lines)


def print_header(cfg, plan, device_kind, backend, explain, print_fn):
    """The grid, the virtual buffer and the owners, from `plan` (plan_optimizer): what every rank will hold."""
    world = cfg.dp * cfg.tp
    print_fn(f"Distributed Muon: {world} {device_kind} rank{'s' * (world != 1)} over {backend}, "
             f"DP={cfg.dp} x TP={cfg.tp}, {'the AdamW ZeRO-1 baseline' if cfg.baseline else 'strategy ' + cfg.strategy}, "
             f"{cfg.steps} steps, seed {cfg.seed}, "
             f"torch {torch.__version__}\n")
    print_fn("[2] The grid (rank = dp_rank * TP + tp_rank; a row is a TP group, a column a DP group)")
    print_fn(format_grid(cfg.dp, cfg.tp) + "\n")
    buckets = plan.layout.buckets
    used, padded = sum(b.used for b in buckets), sum(b.numel for b in buckets)
    n_buffers = len({b.buffer_idx for b in buckets})
    outside = any(not plan.strategy.bucketed(plan, n) for n in plan.muon_names)
    whole = " (Muon matrices are sharded whole, outside the buckets)" if outside else ""
    print_fn(f"[3] Virtual buffer: {n_buffers} param groups, {len(buckets)} buckets of <= {cfg.bucket_size:,} "
             f"elements, {used:,} TP-local elements + {padded - used} padding per rank{whole}")
    if explain:
        print_fn(format_buffer_map(plan.layout))
    if plan.owners:
        per_rank, balance = load_balance(plan.strategy.ns_flops, plan.owners, world)
        print_fn(f"[7] Owners: {len(plan.owners)} matrices on {world} ranks by longest-processing-time over "
                 f"Newton-Schulz FLOPs; max/mean = {balance:.2f}")
        if explain:
            rows = [[r, sum(o == r for o in plan.owners.values()), f"{per_rank[r] / 1e9:.3f}",
                     " ".join(n for n, o in plan.owners.items() if o == r)] for r in range(world)]
            print_fn(format_table(["rank", "matrices", "GFLOP", "owns"], rows, [">", ">", ">", "<"]))
    print_fn("")


def qk_clipped_heads(results):
    """Per step, {(matrix, head, multiplier)} of the heads QK-clip scaled, from every rank's clip_qk_ answers."""
    steps = len(results[0].get("qk_clip") or ())
    return [{(n, h, m) for r in results for n, ms in r["qk_clip"][i].items() for h, m in enumerate(ms)
             if m is not None and m < 1} for i in range(steps)]


def report(cfg, plan, results, checks, ranks_s, ref_s, backend="gloo", print_fn=print):
    """Print the verification (checks from verify) and the accounting; return them all as one dict."""
    world = cfg.dp * cfg.tp
    n_same = sum(c["identical"] for c in checks)
    passed, summary = verdict(checks, "NorMuon's reference and torch" if cfg.normuon else "torch")
    reference_name = ("torch.optim.AdamW" if cfg.baseline else
                      "NorMuon's reference / torch.optim.AdamW" if cfg.normuon else "torch.optim.Muon / torch.optim.AdamW")
    print_fn(f"[6] Every rank's piece against {reference_name} on one device "
             f"(torch.equal): {n_same}/{len(checks)} parameters identical")
    rows = [[c["name"], "x".join(map(str, c["global_shape"])) or "scalar",
             "-" if c["tp_split_dim"] < 0 else c["tp_split_dim"], c["optimizer"],
             f"{c['max_abs_diff']:.1e}" if c["max_abs_diff"] else "0",
             "yes" if c["identical"] else f"no, <= {c['tolerance']:.1e}" if c["ok"] else "NO"]
            for c in checks]
    print_fn(format_table(["parameter", "global shape", "split", "optimizer", "max |d|", "identical"], rows,
                          ["<", ">", ">", "<", ">", ">"]) + "\n")

    clipped = qk_clipped_heads(results)
    if cfg.qk_clip_tau is not None:
        heads = sum(len(m) for m in results[0]["qk_clip"][0].values())
        print_fn(f"[8] QK-clip, tau {cfg.qk_clip_tau:g}: heads clipped per step "
                 f"{', '.join(f'{len(c)}/{heads}' for c in clipped)} (one MAX all-reduce of the per-head maxima)\n")

    table, same_every_step, flops = account(cfg, results)
    gloo_note = "; on Gloo the reduce-scatter is an all-to-all and a local sum" if backend == "gloo" else ""
    print_fn(f"[10] Bytes per step: ring counts for all-gather and reduce-scatter, exact counts for all-to-all "
             f"({'the same every step' if same_every_step else 'last step; steps differ'}{gloo_note})")
    rows = [[phase, t["axis"], t["dtype"], human_bytes(max(t["sent"])), human_bytes(max(t["received"])),
             human_bytes(sum(t["sent"]))] for phase, t in table.items()]
    max_sent, all_sent = total_bytes(table)
    max_received, _ = total_bytes(table, "received")
    rows.append(["total", "", "", human_bytes(max_sent), human_bytes(max_received), human_bytes(all_sent)])
    print_fn(format_table(["phase", "axis", "dtype", "sent/rank (max)", "received/rank (max)", "sent, all ranks"],
                          rows, ["<", "<", "<", ">", ">", ">"]) + "\n")

    if flops["single_device"]:
        print_fn(f"[10] Newton-Schulz FLOPs per step: single device {flops['single_device'] / 1e9:.3f} GFLOP; "
                 f"per rank {', '.join(f'{f / 1e9:.3f}' for f in flops['per_rank'])} GFLOP")
        why = ("each matrix is orthogonalized once, by its owner" if strategy_class(cfg.strategy).orthogonalizes_once
               else "a matrix is orthogonalized on several ranks: in the gather flow, every TP peer and every DP rank "
                    "whose shard touches it")  # a strategy of its own may orthogonalize on fewer: the sum says
        print_fn(f"    redundancy = sum over ranks / single device = {flops['redundancy']:.2f} "
                 f"(upper bound DP x TP = {world}; {why}); max/mean per rank = {flops['max_over_mean']:.2f}\n")
    state = [r["state_bytes"] for r in results]
    print_fn(f"[10] Optimizer state per rank: max {human_bytes(max(state))}, min {human_bytes(min(state))}")

    step_ms = [max(r["step_ms"][i] for r in results) for i in range(cfg.steps)]
    timings = dict(ranks_s=ranks_s, reference_s=ref_s, step_ms_slowest_rank=step_ms,
                   step_ms_median=statistics.median(step_ms))
    print_fn(f"Timing: ranks {ranks_s:.1f} s (start, init, {cfg.steps} steps), reference {ref_s:.1f} s, "
             f"median step {timings['step_ms_median']:.0f} ms (slowest rank)")
    print_fn(f"Result: {summary}")
    return dict(config=asdict(cfg), torch=torch.__version__, passed=passed, checks=checks,
                buckets=[asdict(b) for b in plan.layout.buckets], owners=results[0]["owners"], bytes_per_step=table,
                bytes_same_every_step=same_every_step, bytes_sent_max_rank=max_sent, bytes_sent_all_ranks=all_sent,
                ns_flops=flops, state_bytes=state, timings=timings, ledgers=[r["ledger"] for r in results],
                qk_clip=[{f"{n} head {h}": m for n, h, m in sorted(c)} for c in clipped])
