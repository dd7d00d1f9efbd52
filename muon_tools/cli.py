"""Section 11, the command line: run (plan, launch, report), the parser every command uses (OneLineParser,
build_parser), how a command ends (exit_code), and `python distributed_muon_cpu.py`'s main."""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from dataclasses import fields

from distmuon.checks import ADJUST_LR_FNS, NS_COEFFICIENT_CHOICES
from distmuon.large_runs import NS_BLOCKS, TP_NEWTON_SCHULZ
from distmuon.owners import OPTIMIZERS, OVERLAP_DEFAULT
from muon_forkserver import start_method, stop_forkserver
from muon_tools.settings import MODELS, N_HEADS, RunConfig, demo_specs, plan_optimizer
from muon_tools.reference import bound, rank_program
from muon_tools.accounting import print_header, report
from muon_tools.outputs import WriteError, check_writable, write_json
from muon_tools.launch import Interrupted, RankFailure, raise_interrupted, spawn_ranks
from muon_tools.checks import under_torchrun, validate


def run(cfg, explain=False, print_fn=print):
    """Plan, start the ranks on this machine (the lesson's run_rank on each), report; returns the results dict."""
    if (cfg.backend, cfg.device) != ("gloo", "cpu"):
        raise ValueError(f"this launcher starts Gloo ranks on the CPU (got backend {cfg.backend}, device "
                         f"{cfg.device}): GPUs need torchrun, with distributed_muon.py")
    validate(cfg, demo_specs(cfg))
    start_method()  # the ranks' forkserver (a command's first lines started it already) imports torch meanwhile
    plan = plan_optimizer(cfg)
    print_header(cfg, plan, "CPU", "Gloo", explain, print_fn)
    t0 = time.perf_counter()
    out = spawn_ranks(cfg, program=rank_program(cfg))[0]  # rank 0's: every rank's results, and the check
    seconds = time.perf_counter() - t0
    return report(cfg, plan, out["ranks"], bound(cfg, out["checks"]), seconds - out["reference_s"],
                  out["reference_s"], print_fn=print_fn)


class OneLineParser(argparse.ArgumentParser):
    """The parser of every command of the project. What argparse itself refuses (an unknown flag, a
    value that is not a number, a choice not offered, a missing value) ends the command as every
    other refusal does: one line `error: <message>` on stderr, exit 2, before any rank starts
    (argparse's own ends with the usage, a dozen lines). --help is argparse's. Under torchrun every
    process parses the same argv: rank 0 alone says it, as run_under_torchrun does."""

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)

    def _get_values(self, action, arg_strings):
        # argparse converts what the command line gave here (a default never comes through): an empty value,
        # what an unset shell variable gives (--json $OUT), would be taken for "none" or for a path
        if action.option_strings and "" in arg_strings:
            self.error(f"argument {'/'.join(action.option_strings)}: an empty value")
        return super()._get_values(action, arg_strings)


def build_parser(description, launcher="spawn", one_run=True):
    """The command line. launcher "torchrun" (distributed_muon.py) takes DP from the world size by default.
    one_run=False: the command runs every strategy and the baseline itself (benchmarks/compare.py), and offers
    no --strategy and no --baseline."""
    d = RunConfig()
    p = OneLineParser(description=description)
    if launcher == "torchrun":
        p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: processes / TP)")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default %(default)s)")
    else:
        p.add_argument("--dp", type=int, default=d.dp, help="data-parallel size (default %(default)s)")
        p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of parameters and gradients (default %(default)s)")
    p.add_argument("--bucket-size", type=int, default=d.bucket_size,
                   help="largest bucket in elements, before padding to a multiple of DP (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate, Muon and AdamW (default %(default)s)")
    p.add_argument("--momentum", type=float, default=d.momentum, help="Muon momentum in [0, 1) (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="decoupled weight decay (default %(default)s)")
    p.add_argument("--ns-steps", type=int, default=d.ns_steps, help="Newton-Schulz iterations (default %(default)s)")
    p.add_argument("--adjust-lr-fn", default=d.adjust_lr_fn,
                   help=f"one of {', '.join(ADJUST_LR_FNS)} (default %(default)s)")
    if one_run:
        p.add_argument("--strategy", default=d.strategy, choices=tuple(OPTIMIZERS),
                       help="gather (default): every rank that touches a matrix orthogonalizes it; owner: one rank "
                            "per matrix, all-to-all exchanges; comm-free: matrices sharded whole across DP")
        p.add_argument("--baseline", action="store_true",
                       help="run the AdamW ZeRO-1 baseline instead: every parameter takes AdamW, no Muon")
        p.add_argument("--normuon", action="store_true",
                       help="the matrices take NorMuon (arXiv 2510.05491: each row of Muon's update normalized by its "
                            "own second moment), checked against a single-device reference; owner or comm-free")
    p.add_argument("--model", default=d.model, choices=MODELS,
                   help="transformer (default): section 6's model; lopsided: one huge matrix among small ones; "
                        "thin: matrices with a small side (600x6, 64x1, 97x5, ...)")
    p.add_argument("--layers", type=int, default=d.layers, help="layers of --model transformer (default %(default)s)")
    p.add_argument("--d-model", type=int, default=d.d_model,
                   help=f"width of --model transformer, a multiple of its {N_HEADS} heads (default %(default)s)")
    p.add_argument("--overlap", type=int, nargs="?", const=OVERLAP_DEFAULT, default=d.overlap, metavar="K",
                   help="owner, comm-free: pipeline the step bucket by bucket, Newton-Schulz K units behind "
                        f"the gradient reductions (section 7; K = {OVERLAP_DEFAULT} if omitted; default off)")
    p.add_argument("--batched-ns", action="store_true",
                   help="owner, comm-free: orthogonalize same-shape matrices in one batched call; faster for many "
                        "small matrices, but not bit-identical to torch (within 2**-5 of the largest entry)")
    p.add_argument("--ns-coefficients", default=d.ns_coefficients, choices=tuple(NS_COEFFICIENT_CHOICES),
                   help="Newton-Schulz coefficients: jordan (default, torch's one quintic) or polar_express "
                        "(one per iteration, arXiv 2505.16932)")
    p.add_argument("--ns-blocks", default=d.ns_blocks, choices=NS_BLOCKS,
                   help="the fused QKV orthogonalized whole (default, torch's), as Q, K, V (blocks) or per head "
                        "(heads), each block's lr adjusted for its own shape")
    p.add_argument("--tp-newton-schulz", default=d.tp_newton_schulz, choices=TP_NEWTON_SCHULZ,
                   help="gather (default): TP gather -> Newton-Schulz -> TP shard; gram: matrices split along "
                        "their long side exchange a Gram matrix per iteration instead (--strategy gather; "
                        "not bit-identical, within a derived bound)")
    p.add_argument("--qk-clip", type=float, default=d.qk_clip_tau, dest="qk_clip_tau", metavar="TAU",
                   help="QK-clip after every step (Kimi K2): heads whose largest logit exceeds TAU have their q "
                        "and k rows scaled by sqrt(TAU / max); the demo's maxima are synthetic (default off)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s", metavar="SECONDS",
                   help="seconds after which a rank that stopped responding, or a collective that waits, "
                        "ends the run (default %(default)s)")
    p.add_argument("--explain", action="store_true",
                   help="print which DP rank keeps which part of which parameter, and who owns which matrix")
    p.add_argument("--json", metavar="PATH", help="write the run's results (checks, bytes, FLOPs, timings)")
    p.add_argument("--traceback", action="store_true", help="on a rank's failure, print its traceback too")
    p.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)  # tests: make this rank raise
    if launcher == "torchrun":
        p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl", help="(default %(default)s)")
        p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="(default %(default)s)")
    return p


def config_from_args(a):
    """The RunConfig the parsed arguments describe (every field is a flag of the same name)."""
    return RunConfig(**{f.name: getattr(a, f.name) for f in fields(RunConfig) if hasattr(a, f.name)})


def leave(code, line=""):
    """End this process now, without Python's interpreter shutdown: `line` on stderr, what is buffered flushed
    (an interrupted command, below, and a torchrun process, torchrun.run_under_torchrun, each say why)."""
    if line:
        print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def not_under_torchrun(torchrun_command=None):
    """What a command meant for python says under torchrun (exit_code): one line; torchrun_command, the
    command to run under torchrun instead, if there is one."""
    script = os.path.basename(sys.argv[0])
    instead = f"; under torchrun, run {torchrun_command}" if torchrun_command else ""
    return (f"{script} runs with python, not under torchrun (RANK, WORLD_SIZE and LOCAL_RANK are set): torchrun "
            f"would run a copy of the whole command in each of its processes; run python {script}{instead}")


# How a command ends when the reader of its stdout has gone (`| head -1`): as a shell reports a command that
# SIGPIPE ended (128 + 13), quietly; under `set -o pipefail` the pipeline then says the command did not finish
CLOSED_STDOUT = 128 + signal.SIGPIPE


def stdout_closed():
    """Whether stdout is a pipe whose reading end is closed (poll reports POLLERR on the writing end)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLERR)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):  # no stdout, or one without a file descriptor (a test's capture)
        return False


def closed_stdout(command):
    """How exit_code ends once stdout's reader has gone: what is still buffered goes nowhere (not into a
    traceback at Python's exit), a command's forkserver is stopped, and the code is CLOSED_STDOUT."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if command:
        stop_forkserver()
    return CLOSED_STDOUT


def exit_code(work, show_traceback=False, torchrun_command=None):
    """Run work() the way a command should end: its return code, or one line on stderr and
    2 (a bad flag, path or config), 1 (a rank failed, an output could not be written), 130 (Ctrl-C) or 143
    (SIGTERM); or, quietly, CLOSED_STDOUT (141) when the reader of its stdout has gone.

    A command blocks SIGINT in its first lines, before it imports torch (seconds): a Ctrl-C
    then waits, and is delivered here, where it ends the command as any Ctrl-C does, not as
    a traceback out of torch's import. On the way out the mask is put back as it was: a
    command's Ctrl-C after work() waits for its end, and is dropped.

    exit_code is how a command meant for python ends (one that runs under torchrun, a rank per process, ends
    through run_under_torchrun instead): started under torchrun, it says so (rank 0 alone, as OneLineParser
    does) and exits 2 before work(): no copy of it starts ranks or writes anything, and a forkserver's start
    was skipped (muon_forkserver.start_command). torchrun_command: the command for torchrun, if there is one.
    """
    command = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ())  # blocked by a command's first lines
    if command and under_torchrun():
        if os.environ["RANK"] == "0":
            print(f"error: {not_under_torchrun(torchrun_command)}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, raise_interrupted)  # SIGTERM cleans up as Ctrl-C does
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # inside the try: one may be waiting
        code = work()
        sys.stdout.flush()  # here, where a closed stdout is caught, not in Python's teardown
        return code
    except RankFailure as e:
        if stdout_closed():  # the rank printing the run's lines found stdout's reader gone
            return closed_stdout(command)
        print(f"error: {e}", file=sys.stderr)
        if show_traceback:
            print(e.traceback, file=sys.stderr, end="")
        return 1
    except BrokenPipeError:
        if not stdout_closed():  # another pipe than stdout: a failure like any other
            raise
        return closed_stdout(command)
    except WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        if command:  # a forkserver started for ranks that will not come (by the command's first lines, or run())
            stop_forkserver()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as e:
        # 130 = 128 + SIGINT, 143 = 128 + SIGTERM, as shells and torchrun report them
        code, line = (130, "error: interrupted (SIGINT)") if isinstance(e, KeyboardInterrupt) else \
            (143, "error: terminated (SIGTERM)")
        line += "; every rank stopped, temporary files removed"
        if command:  # its ranks stopped and its folders removed, it ends now, and so does its forkserver
            stop_forkserver()  # (which may still be importing torch) rather than after Python's teardown
            leave(code, line)
        print(line, file=sys.stderr)  # an importer's process (a test's) just gets the code
        return code
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGTERM, previous)


def main(argv=None):
    args = build_parser("ZeRO-1 x TP distributed Muon on CPU ranks over Gloo, checked bit for bit against "
                        "torch.optim.Muon / AdamW.").parse_args(argv)

    def work():
        if args.json:
            check_writable(args.json)
        results = run(config_from_args(args), explain=args.explain)  # validates before spawning anything
        write_json(args.json, results)
        return 0 if results["passed"] else 1

    return exit_code(work, args.traceback, torchrun_command="distributed_muon.py, the lesson's twin for torchrun")


# Under torchrun: each process is a rank already, started and told who it is by torchrun. What our launcher
# does for a run (check the flags before any rank starts, report once) is done in every process, by rank 0
