"""What the demo's optimizer moves and computes, beside the lesson's strategies run on the same matrices
(dtensor_demo.py --compare): bytes per phase from each rank's Ledger, Newton-Schulz FLOPs, and FSDP2's and the TP
layers' bytes of a training step as CollectiveCounter measured them."""

import functools
from dataclasses import dataclass

import torch

import distributed_muon_cpu
import muon_tools
from collective_counter import FORWARD_BACKWARD, measured_sent, measured_table
from distributed_muon_cpu import NS_STEPS, newton_schulz_flops
from dtensor_run import BATCH, SEQ, DemoConfig, DemoModel, expert_stack_names, is_muon, param_groups

# Bytes come from each rank's Ledger: the lesson's send_parts records what every
# all-to-all really sends and receives (exact counts, not a ring model), and
# newton_schulz_owned the FLOPs of every Newton-Schulz call. Gloo's profiler
# records no message sizes, hence the ledger.
#
# Beside the lesson, like for like (--compare): the lesson's OwnerMuon and
# CommFreeMuon are run for real, on the same dp x tp grid, over THIS demo
# model's parameters, given to the lesson as its ParamSpecs (lesson_specs):
# every expert of a stack is its own 2-D matrix (the lesson has no 3-D
# parameters, and no expert parallelism), TP-split as Megatron splits an MLP
# (w1's experts by rows, w2's by columns: column / row parallel, as fc1 / fc2),
# where tp divides the dim; the embedding, head, norms and router are not
# TP-split (as in the demo). Both lessons' ledgers count their own bytes, and
# their results are checked against torch like DTensorMuon's. What each counts is
# NOT the same work, and the table says so:
#   * DTensorMuon's step moves only the owner exchange (and the grad-presence
#     vote): FSDP2 reduce-scatters the gradients in backward and all-gathers
#     the parameters in forward and backward, outside the optimizer, where its
#     Ledger does not look (CollectiveCounter, below, measures them);
#   * the lesson's step holds ZeRO-1 itself: the gradient reduce-scatter and
#     the parameter all-gather (ring counts, (n-1)/n of a bucket per rank; for
#     comm-free the Muon matrices' reduce at / broadcast from the owner row
#     instead) are inside its step, beside its owner exchange; ZeRO-1 keeps
#     whole parameters, so nothing of DP moves in its forward and backward.
# So "owner exchange" compares like with like, and so does "step + DP": the
# optimizer step plus the data-parallel bytes of forward and backward.
DTENSOR_PHASES = ("grad presence", "gather at owner", "scatter from owner")


def account(cfg, results):
    """Bytes per phase (last step; every rank), NS FLOPs per rank (last step), and whether steps moved the same."""
    ledgers = [r["ledger"] for r in results]
    tables = [muon_tools.bytes_per_step(ledgers, s, DTENSOR_PHASES) for s in range(1, cfg.steps + 1)]
    flops = [sum(c["flops"] for c in ledger["compute"] if c["step"] == cfg.steps) for ledger in ledgers]
    return tables[-1], all(t == tables[0] for t in tables), flops


def single_device_flops(cfg):
    model = DemoModel(cfg)
    stacks = expert_stack_names(model)
    return sum(newton_schulz_flops(tuple(p.shape[-2:])) * (p.shape[0] if n in stacks else 1)
               for g in param_groups(model, cfg)[:1] for n, p in g["params"])


# The demo's TP split dims, as the lesson's ParamSpec.tp_split_dim (-1: not split); experts per matrix.
LESSON_TP_SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "moe.w1": 0, "moe.w2": 1}
OWNER_EXCHANGE = ("gather at owner", "scatter from owner")
DP_IN_STEP = ("grad reduce-scatter", "param all-gather", "grad reduce at owner", "update broadcast from owner")


def lesson_specs(cfg):
    """This demo model's parameters as the lesson's [distributed_muon_cpu.ParamSpec]: each expert of a stack its own 2-D matrix."""
    model = DemoModel(cfg)
    stacks = expert_stack_names(model)
    specs = []
    for name, p in model.named_parameters():
        group = "muon" if is_muon(name, p.ndim) else "adamw" if name.startswith(("embed.", "head.")) \
            else "adamw_no_wd"
        shape = tuple(p.shape[1:]) if name in stacks else tuple(p.shape)
        split = LESSON_TP_SPLIT.get(".".join(name.split(".")[-2:]), -1)
        if split >= 0 and shape[split] % cfg.tp:
            split = -1  # the lesson splits evenly only: replicated over TP instead
        names = [f"{name}[{e}]" for e in range(p.shape[0])] if name in stacks else [name]
        specs += [distributed_muon_cpu.ParamSpec(n, shape, split, group) for n in names]
    return specs


def lesson_config(cfg, strategy):
    return muon_tools.RunConfig(dp=cfg.dp, tp=cfg.tp, steps=cfg.steps, seed=cfg.seed, lr=cfg.lr, momentum=cfg.momentum,
                        weight_decay=cfg.weight_decay, strategy=strategy)


@dataclass(frozen=True)
class LessonRuns:
    """The lesson's strategies on this demo's matrices, on the grid dp x tp (a muon_tools.spawn_ranks cfg, or a run
    inside Runs)."""

    demo: DemoConfig
    strategies: tuple = ("owner", "comm-free")

    @property
    def dp(self):
        return self.demo.dp

    @property
    def tp(self):
        return self.demo.tp

    @property
    def timeout_s(self):
        return self.demo.timeout_s


def run_lesson_rank(rank, runs, device):
    """Every rank: the lesson's own steps (distributed_muon_cpu.run_steps, with muon_tools.build_optimizer) on lesson_specs, one optimizer
    per strategy; {strategy: what run_steps returned}."""
    torch.set_num_threads(1)
    cfg = runs.demo
    specs = lesson_specs(cfg)
    grid = distributed_muon_cpu.make_grid(cfg.dp, cfg.tp, rank)
    out = {}
    for strategy in runs.strategies:
        lcfg = lesson_config(cfg, strategy)
        build = functools.partial(muon_tools.build_optimizer, specs, lcfg)
        out[strategy] = distributed_muon_cpu.run_steps(lcfg, specs, build, grid, device)
    return dict(rank=rank, lesson=out)


def lesson_accounts(runs, results):
    """{strategy: dict(checks, table, flops)}: each lesson run checked against torch (as the lesson checks
    itself), its bytes per phase (last step) and its Newton-Schulz FLOPs per rank (last step)."""
    cfg, specs = runs.demo, lesson_specs(runs.demo)
    accounts = {}
    for strategy in runs.strategies:
        lcfg = lesson_config(cfg, strategy)
        ledgers = [r["lesson"][strategy]["ledger"] for r in results]
        reference = muon_tools.reference_params(specs, lcfg)
        checks = distributed_muon_cpu.check_against_torch(specs, [r["lesson"][strategy] for r in results], reference, cfg.tp)
        accounts[strategy] = dict(checks=checks, table=muon_tools.bytes_per_step(ledgers, cfg.steps, muon_tools.PHASES_OF[strategy]),
                                  flops=muon_tools.flops_per_step(ledgers, specs, cfg.steps, NS_STEPS))
    return accounts


def phase_bytes(table, phases):
    """Bytes sent per rank (a list) over the phases of `table` among `phases`."""
    rows = [table[p]["sent"] for p in phases if p in table]
    return [sum(col) for col in zip(*rows)] if rows else None


def comparison_rows(cfg, results, accounts):
    """One row per optimizer (this one and the lesson's strategies; same matrices, same grid, last step), as
    COMPARISON_HEADER; and {optimizer: (bytes sent per rank in its step plus DP in forward / backward, NS FLOPs
    per rank)}. DTensorMuon's forward / backward figures are CollectiveCounter's (results run with count_comm)."""
    table, _, flops = account(cfg, results)
    single = single_device_flops(cfg)
    runs = [("DTensorMuon", table, flops, sum(flops) / single,
             measured_sent(results, FORWARD_BACKWARD, "dp"), measured_sent(results, FORWARD_BACKWARD, "tp"))]
    for strategy, acc in accounts.items():  # ZeRO-1 keeps whole parameters: no DP message in forward / backward
        runs.append((f"lesson {strategy}", acc["table"], acc["flops"]["per_rank"], acc["flops"]["redundancy"],
                     [0] * len(flops), None))
    rows, per_rank = [], {}
    for label, t, f, redundancy, dp_outside, tp_outside in runs:
        total = [a + b for a, b in zip(phase_bytes(t, tuple(t)), dp_outside)]
        dp_bytes = phase_bytes(t, DP_IN_STEP)
        rows.append([label, muon_tools.human_bytes(max(phase_bytes(t, OWNER_EXCHANGE))),
                     muon_tools.human_bytes(max(dp_bytes) if dp_bytes else 0), muon_tools.human_bytes(max(dp_outside)),
                     muon_tools.human_bytes(max(total)), muon_tools.human_bytes(sum(total)),
                     muon_tools.human_bytes(max(tp_outside)) if tp_outside else "not run", f"{max(f) / 1e9:.4f}",
                     f"{sum(f) / len(f) / 1e9:.4f}", f"{redundancy:.2f}"])
        per_rank[label] = (total, f)
    return rows, per_rank


COMPARISON_HEADER = ["optimizer", "owner exchange", "DP in step", "DP in fwd/bwd", "step + DP", "all ranks",
                     "TP in fwd/bwd", "NS GFLOP max", "mean", "redundancy"]
MEASURED_HEADER = ["phase", "collective", "mesh dim", "dtype", "calls", "sent/rank (max)", "sent, all ranks"]


def measured_rows(results):
    """The measured training step (CollectiveCounter) as rows of MEASURED_HEADER."""
    return [[phase, op, axis, dtype, max(t["calls"]), muon_tools.human_bytes(max(t["sent"])),
             muon_tools.human_bytes(sum(t["sent"]))]
            for (phase, op, axis, dtype), t in measured_table(results).items()]


def print_comparison(cfg, rows, per_rank, accounts, results, print_fn=print):
    ledger_sent = phase_bytes(account(cfg, results)[0], DTENSOR_PHASES)
    counted_sent = measured_sent(results, ("optimizer step",))
    print_fn(f"\n[8] FSDP2 and the TP layers in one training step (forward and backward of {BATCH} x {SEQ} tokens per "
             f"DP rank), measured by CollectiveCounter: every collective each rank dispatched, bytes sent per rank "
             f"as the Ledger counts (ring counts for all-gather, reduce-scatter, all-reduce; the optimizer step's "
             f"own collectives beside them, {'equal to' if counted_sent == ledger_sent else 'NOT equal to'} its "
             f"Ledger's on every rank):")
    print_fn(muon_tools.format_table(MEASURED_HEADER, measured_rows(results), ["<", "<", "<", "<", ">", ">", ">"]))
    print_fn(f"\n[8] Beside the lesson's owner and comm-free strategies, run for real on THIS model's matrices "
             f"(each expert its own 2-D matrix), same mesh dp={cfg.dp} x tp={cfg.tp}, last step; bytes sent per "
             f"rank (max over ranks) unless 'all ranks':")
    for strategy, acc in accounts.items():
        n_same = sum(c["identical"] for c in acc["checks"])
        print_fn(f"lesson {strategy} on these {len(acc['checks'])} parameters: {n_same}/{len(acc['checks'])} "
                 f"bit-identical to torch")
    print_fn(muon_tools.format_table(COMPARISON_HEADER, rows, ["<"] + [">"] * 9))
    for label, (sent, flops) in per_rank.items():
        print_fn(f"{label:<24} step + DP, sent per rank: {', '.join(muon_tools.human_bytes(b) for b in sent)}")
        print_fn(f"{'':<24} NS GFLOP per rank: {', '.join(f'{f / 1e9:.4f}' for f in flops)}")
    print_fn("owner exchange = gather at owner + scatter from owner (bf16, exact all-to-all counts). DP in step = "
             "ZeRO-1's grad reduce-scatter + param all-gather (fp32, ring counts), and for comm-free the matrices' "
             "grad reduce at the owner row (fp32) and the update broadcast from it (bf16); DTensorMuon's step has none. DP in fwd/bwd = "
             "FSDP2's param all-gathers (forward, and again in backward) and grad reduce-scatters (measured above); "
             "ZeRO-1 keeps whole parameters and has none. step + DP = the optimizer step (with the grad-presence "
             "vote) + DP in fwd/bwd. TP in fwd/bwd = the TP layers' all-reduces and the experts' all-gathers "
             "(measured); the lesson's runs have no model, so theirs were not run.")

