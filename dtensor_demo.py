"""DTensorMuon's demo: the demo model (dtensor_run.py) on an FSDP2 x TP mesh of spawned Gloo ranks, or one rank per
torchrun process, stepped and checked against torch.optim.Muon / AdamW in one process (dtensor_verify.py).

    python dtensor_demo.py                     # 8 Gloo ranks, mesh dp=4 x tp=2, 3 steps, PASS/FAIL
    python dtensor_demo.py --dp 3 --tp 2       # uneven FSDP2 shards (dims that 3 does not divide)
    python dtensor_demo.py --dp 2 --tp 4 --json run.json
    python dtensor_demo.py --compare           # bytes and FLOPs beside the lesson's strategies (dtensor_accounting.py)
    python dtensor_demo.py --batched-ns        # batched Newton-Schulz, held to the lesson's bound
    python dtensor_demo.py --train             # a real FSDP2 x TP training, checked as every real training here
    torchrun --standalone --nproc-per-node 8 dtensor_demo.py --dp 4 --tp 2     # GPUs: NCCL, one per rank
    torchrun --standalone --nproc-per-node 4 dtensor_demo.py --dp 2 --tp 2 --backend gloo --device cpu
"""

import sys
import time
from dataclasses import asdict, replace

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch

from distmuon import checks
import muon_tools
from dtensor_accounting import (COMPARISON_HEADER, MEASURED_HEADER, LessonRuns, account, comparison_rows,
                                lesson_accounts, measured_rows, print_comparison, run_lesson_rank,
                                single_device_flops)
from dtensor_run import BATCH, SEQ, DemoConfig, DemoModel, demo_parameters, param_groups, run_demo_rank
from dtensor_verify import run_reference, training_table, verify, verify_training

# Spawned: every argument checked before any rank starts (exit 2, one line), dp x tp Gloo ranks started by the
# lesson's launcher, torch's reference run here. Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) this process is
# one rank (muon_tools.run_under_torchrun, shared with the lesson's GPU twin and the GPT example); rank 0 gathers, checks and
# prints. --compare is refused there: it spawns the lesson's strategies on Gloo ranks of its own.


def validate(cfg):
    muon_tools.check_topology(cfg.dp, cfg.tp)
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1 (got {cfg.steps})")
    muon_tools.check_seed(cfg.seed)
    checks.check_hyperparameters(muon_tools.flag, bucket_size=1, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             momentum=cfg.momentum, adjust_lr_fn=cfg.adjust_lr_fn)
    if cfg.lr == 0:
        raise ValueError("--lr must be > 0: with lr 0 no weight moves and the comparison proves nothing")
    if cfg.layers < 1 or cfg.experts < 1:
        raise ValueError(f"--layers and --experts must be >= 1 (got {cfg.layers}, {cfg.experts})")
    if demo_parameters(cfg) > muon_tools.MAX_DEMO_PARAMETERS:  # every rank builds the whole model before sharding it
        raise ValueError(f"--layers {cfg.layers} x --experts {cfg.experts}: {demo_parameters(cfg):,} parameters, more "
                         f"than the {muon_tools.MAX_DEMO_PARAMETERS:,} a laptop's ranks can each hold whole")
    with torch.random.fork_rng(devices=[]):  # the seed it sets (manual_seed) undone on the way out
        model = DemoModel(replace(cfg, layers=1))  # one layer has every layer's shapes
    groups = param_groups(model, cfg)
    muon_tools.check_step_numbers(muon_tools.flag, groups, [p.shape[-2:] for _, p in groups[0]["params"]])  # each expert a matrix
    if cfg.train and (4 * cfg.d) % cfg.tp:
        raise ValueError(f"--train with TP {cfg.tp}: torch's ColwiseParallel -> RowwiseParallel forward needs TP to "
                         f"divide the hidden size {4 * cfg.d} (it takes the uneven pieces for even ones); without "
                         f"--train (exact gradients, no forward) any TP runs")
    if cfg.train and cfg.batched_ns:
        raise ValueError("--train checks its replay against torch bit for bit, which --batched-ns does not promise: "
                         "use one of them")
    muon_tools.check_launch(cfg.timeout_s)


def build_parser():
    d = DemoConfig()
    p = muon_tools.OneLineParser(description="Distributed Muon for DTensor parameters (FSDP2 x TP on a 2-D mesh, "
                                            "a MoE expert stack) on CPU Gloo ranks, or one rank per process under "
                                            "torchrun, checked bit for bit against torch.optim.Muon / AdamW.")
    p.add_argument("--dp", type=int, default=d.dp, help="FSDP2 (mesh dim 'dp') size (default %(default)s)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel (mesh dim 'tp') size (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of weights and gradients (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (default %(default)s)")
    p.add_argument("--momentum", type=float, default=d.momentum, help="Muon momentum (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="weight decay (default %(default)s)")
    p.add_argument("--layers", type=int, default=d.layers, help="layers of the demo model (default %(default)s)")
    p.add_argument("--experts", type=int, default=d.experts, help="experts per MoE layer (default %(default)s)")
    p.add_argument("--batched-ns", action="store_true",
                   help="owners orthogonalize same-shape matrices in one batched call: need not be bit-identical "
                        "to torch, so each Muon matrix is checked within steps x adjusted lr x 1.5 x 2**-5 (the "
                        "lesson's bound) and every other parameter bit for bit")
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s", metavar="SECONDS",
                   help="a rank silent this long ends the run (default %(default)s)")
    p.add_argument("--train", action="store_true",
                   help=f"real forward and backward on random tokens ({BATCH} x {SEQ} per DP rank a step) instead of "
                        "exact gradients, checked as train_gpt checks a training: the replay of the ranks' own "
                        "gradients bit for bit, the gradients within a bound derived from the arithmetic, the "
                        "free-running gap reported beside a one-ulp chaos floor")
    p.add_argument("--compare", action="store_true",
                   help="also run the lesson's owner and comm-free strategies on this model's matrices, on the same "
                        "grid, measure what FSDP2 and the TP layers send in one training step, and print bytes and "
                        "Newton-Schulz FLOPs per rank side by side")
    p.add_argument("--json", metavar="PATH", help="write the run's checks, owners, bytes and FLOPs")
    p.add_argument("--traceback", action="store_true", help="on a rank's failure, print its traceback too")
    muon_tools.add_backend_flags(p)
    return p


def report_parameters(cfg, checks, print_fn=print):
    """[7] of exact gradients: one row per parameter against torch; returns muon_tools.verdict's (passed, line)."""
    print_fn("[7] Every rank's local elements against torch.optim.Muon / AdamW in one process:")
    rows = [[c["name"], "x".join(map(str, c["shape"])), c["placements"], c["optimizer"],
             f"{c['max_abs_diff']:.1e}" if c["max_abs_diff"] else "0",
             "yes" if c["identical"] else f"no, <= {c['tolerance']:.1e}" if c["ok"] else "NO"]
            for c in checks]
    print_fn(muon_tools.format_table(["parameter", "shape", "placements", "optimizer", "max |d|", "identical"], rows,
                             ["<", ">", "<", "<", ">", ">"]) + "\n")
    if cfg.batched_ns:
        bounds = {"x".join(map(str, c["shape"][-2:])): c["tolerance"] for c in checks if c["optimizer"] == "Muon"}
        print_fn("--batched-ns: each Muon matrix is held to steps x adjusted lr x 1.5 x BATCHED_NS_BOUND (2**-5) "
                 "of torch's (the lesson's batched_ns_tolerance), every other parameter bit for bit; bounds: "
                 + ", ".join(f"{shape} {bound:.1e}" for shape, bound in bounds.items()) + "\n")
    return muon_tools.verdict(checks)


def report(cfg, results, checks, print_fn=print):
    """The checks ([7]: verify's per-parameter list; verify_training's dict with cfg.train), the bytes and
    FLOPs ([8]) and the verdict, printed; returns the JSON dict."""
    if cfg.train:
        print_fn(f"[7] A real training ({BATCH} x {SEQ} = {BATCH * SEQ} random tokens per DP rank a step, {cfg.steps} "
                 f"steps) against torch.optim.Muon / AdamW in one process on each step's whole batch (FSDP2 and TP "
                 f"sum in other orders):")
        print_fn(training_table(checks) + "\n")
        passed = checks["passed"]
        line = (f"{'PASS' if passed else 'FAIL'}: the replay bit for bit, the gradients within the derived bound "
                f"(the free-running gap reported, not checked)")
    else:
        passed, line = report_parameters(cfg, checks, print_fn)
    world = cfg.dp * cfg.tp
    table, same, flops = account(cfg, results)
    print_fn(f"[8] Bytes per step, counted by the ledger (exact all-to-all counts; "
             f"{'the same every step' if same else 'last step; steps differ'}):")
    rows = [[phase, t["dtype"], muon_tools.human_bytes(max(t["sent"])), muon_tools.human_bytes(max(t["received"])),
             muon_tools.human_bytes(sum(t["sent"]))] for phase, t in table.items()]
    max_sent, all_sent = muon_tools.total_bytes(table)
    rows.append(["total", "", muon_tools.human_bytes(max_sent),
                 muon_tools.human_bytes(muon_tools.total_bytes(table, "received")[0]),
                 muon_tools.human_bytes(all_sent)])
    print_fn(muon_tools.format_table(["phase", "dtype", "sent/rank (max)", "received/rank (max)", "sent, all ranks"],
                                     rows,
                             ["<", "<", ">", ">", ">"]))
    print_fn("per rank sent: " + ", ".join(muon_tools.human_bytes(sum(t["sent"][r] for t in table.values()))
                                           for r in range(world)))
    single = single_device_flops(cfg)
    print_fn(f"[8] Newton-Schulz GFLOP per rank (last step): {', '.join(f'{f / 1e9:.4f}' for f in flops)}; "
             f"single device {single / 1e9:.4f}; redundancy {sum(flops) / single:.2f}\n")
    print_fn(f"Result: {line}")
    return dict(config=asdict(cfg), torch=torch.__version__, passed=passed, checks=checks, owners=results[0]["owners"],
                bytes_per_step=table, bytes_same_every_step=same, ns_flops_per_rank=flops, ns_flops_single=single,
                state_bytes=[r["state_bytes"] for r in results])


def demo_config(args):
    return DemoConfig(dp=args.dp, tp=args.tp, steps=args.steps, seed=args.seed, lr=args.lr, momentum=args.momentum,
                      weight_decay=args.weight_decay, layers=args.layers, experts=args.experts,
                      batched_ns=args.batched_ns, timeout_s=args.timeout_s, count_comm=args.compare, train=args.train)


def print_header(cfg, ranks, print_fn=print):
    print_fn(f"DTensorMuon: {cfg.dp * cfg.tp} {ranks}, mesh dp={cfg.dp} x tp={cfg.tp} (rank = dp_rank * tp + tp_rank), "
             f"{cfg.steps} steps, torch {torch.__version__}")
    print_fn(muon_tools.format_grid(cfg.dp, cfg.tp) + "\n")


def finish(cfg, results, ranks_s, device="cpu", print_fn=print):
    """Once every rank's result is in one process: the owners and placements, the verification against torch's
    reference (run on `device`; compared on the CPU) and the report; returns the JSON dict."""
    print_fn("[3] Owners: longest-processing-time over Newton-Schulz FLOPs, among each matrix's holders")
    print_fn(results[0]["table"] + "\n")
    print_fn("[2] Placements: " + "; ".join(sorted({f"{n.split('.')[-2]}.{n.split('.')[-1]} {p}"
                                                   for n, p in results[0]["placements"].items()
                                                   if n.startswith("layers.0.")})) + "\n")
    t0 = time.perf_counter()
    checks = verify_training(cfg, results, device) if cfg.train else verify(cfg, results, run_reference(cfg, device))
    checked_s = time.perf_counter() - t0
    out = report(cfg, results, checks, print_fn)
    # the ranks step together (each step ends in collectives): a step takes as long as its slowest rank's
    steps = len(results[0]["step_ms"])
    steps_s = sum(max(r["step_ms"][i] for r in results) for i in range(steps)) / 1e3
    made = "forward and backward" if cfg.train else "the exact gradients"
    shown = muon_tools.rounded_parts(dict(steps=steps_s, rest=ranks_s - steps_s), 1)  # tenths of a second that add up
    print_fn(f"Timing: ranks {sum(shown.values()):.1f} s = {steps} optimizer steps {shown['steps']:.1f} s (each its "
             f"slowest rank's) + the rest {shown['rest']:.1f} s (start, build, {made}, the copies the checks read); "
             f"torch's reference and the checks {checked_s:.1f} s")
    out["timings"] = dict(ranks_s=ranks_s, optimizer_steps_s=steps_s, reference_and_checks_s=checked_s)
    return out


def main(argv=None):
    args = build_parser().parse_args(argv)
    if muon_tools.under_torchrun():
        return main_torchrun(args)

    def work():
        muon_tools.backend_flags(args)
        cfg = demo_config(args)
        validate(cfg)
        if args.json:
            muon_tools.check_writable(args.json)
        print_header(cfg, "CPU ranks over Gloo")
        t0 = time.perf_counter()
        results = muon_tools.spawn_ranks(cfg, run_demo_rank)
        out = finish(cfg, results, time.perf_counter() - t0)
        if args.compare:
            lesson = LessonRuns(cfg)
            accounts = lesson_accounts(lesson, muon_tools.spawn_ranks(lesson, run_lesson_rank))
            rows, per_rank = comparison_rows(cfg, results, accounts)
            print_comparison(cfg, rows, per_rank, accounts, results)
            out["comparison"] = dict(header=COMPARISON_HEADER, rows=rows, per_rank=per_rank,
                                     measured_header=MEASURED_HEADER, measured_rows=measured_rows(results),
                                     measured=[r["comm"] for r in results],
                                     lesson_checks={s: a["checks"] for s, a in accounts.items()},
                                     lesson_bytes_per_step={s: a["table"] for s, a in accounts.items()})
            lesson_ok = all(c["identical"] for a in accounts.values() for c in a["checks"])
            out["passed"] = out["passed"] and lesson_ok
        muon_tools.write_json(args.json, out)
        return 0 if out["passed"] else 1

    return muon_tools.exit_code(work, args.traceback)


def main_torchrun(args):
    """Under torchrun: this process is one rank; rank 0 prints, verifies and writes --json."""
    def prepare(world):
        cfg = demo_config(args)
        muon_tools.check_topology(cfg.dp, cfg.tp, world)
        validate(cfg)
        if args.compare:
            raise ValueError("--compare spawns the lesson's strategies on Gloo ranks of its own: run it without "
                             "torchrun")
        if args.json:
            muon_tools.check_writable(args.json)
        return cfg

    def body(cfg, rank, device):
        if rank == 0:
            print_header(cfg, f"ranks under torchrun over {'NCCL' if args.backend == 'nccl' else 'Gloo'} "
                              f"({args.device})")
        return run_demo_rank(rank, cfg, device)

    def report_at_rank_0(cfg, gathered, device, seconds):
        out = finish(cfg, gathered, seconds, device)
        out["launcher"] = dict(launcher="torchrun", backend=args.backend, device=args.device)
        muon_tools.write_json(args.json, out)
        return 0 if out["passed"] else 1

    args.backend, args.device = muon_tools.backend_flags(args)
    return muon_tools.run_under_torchrun(args.backend, args.device, prepare, body, report_at_rank_0, args.traceback)


if __name__ == "__main__":
    sys.exit(main())
