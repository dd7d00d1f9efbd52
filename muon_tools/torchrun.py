"""Section 11 under torchrun: each process is a rank already; what the launcher does for a run (check the flags
before any rank joins, report once) is done in every process (run_under_torchrun, main_under_torchrun)."""

from __future__ import annotations

import datetime
import importlib.util
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
from muon_tools.settings import demo_specs, plan_optimizer
from muon_tools.reference import bound, rank_program
from muon_tools.accounting import print_header, report
from muon_tools.outputs import check_writable, one_line, write_json
from muon_tools.checks import check_topology, validate
from muon_tools.cli import build_parser, config_from_args, leave


# where once is enough: distributed_muon.py's command, and examples/train_gpt.py's and dtensor_demo.py's
# under torchrun.
def environment():
    """RANK, WORLD_SIZE, LOCAL_RANK from torchrun, or a ValueError saying how to launch."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v not in os.environ]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set: launch with torchrun --standalone "
                         f"--nproc-per-node N {os.path.basename(sys.argv[0])}")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def check_devices(backend, device_kind, local_rank=0):
    """The backend and device flags, and a GPU for LOCAL_RANK local_rank (ValueError)."""
    if backend == "nccl" and device_kind != "cuda":
        raise ValueError("NCCL needs --device cuda; on CPUs use --backend gloo --device cpu")
    if device_kind == "cuda" and torch.cuda.device_count() <= local_rank:
        raise ValueError(f"no CUDA device for LOCAL_RANK {local_rank} here ({torch.cuda.device_count()} GPUs): "
                         f"use --backend gloo --device cpu")


def rank_device(device_kind, local_rank):
    """This process's device: its GPU, "cuda:LOCAL_RANK", or "cpu"."""
    return f"cuda:{local_rank}" if device_kind == "cuda" else "cpu"


def join_world(backend, device_kind, local_rank, timeout_s):
    """Bind this process to its GPU (cuda:LOCAL_RANK) or the CPU and join torchrun's world; returns the device."""
    device = rank_device(device_kind, local_rank)
    if device_kind == "cuda":
        torch.cuda.set_device(device)
    # device_id binds the NCCL communicator to this rank's GPU up front (else NCCL guesses it from the rank).
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device(device) if device_kind == "cuda" else None)
    return device


def run_under_torchrun(backend, device_kind, prepare, body, finish, show_traceback=False, program=None):
    """What every torchrun entry point of the project does (distributed_muon.py's, examples/train_gpt.py's and
    dtensor_demo.py's), around its own parts:

      prepare(world) -> cfg: every check that can be made before joining; a ValueError is the same
          on every rank, so rank 0 alone prints it (exit 2). cfg.timeout_s bounds every collective.
      body(cfg, rank, device) -> this rank's result, gathered at rank 0 (gather_object), run once this
          process has joined the world; or program(cfg) -> rank 0's result (None on the others), which
          joins, gathers and leaves by itself (the lesson's run_rank): give body=None then.
      finish(cfg, result, device, seconds) -> the exit code; rank 0 only, after every rank's part.

    Before joining, a refusal returns 2 (a rank without its GPU says so itself). Once joined, the
    process ends here, with os._exit (below): 0, or finish's code on rank 0. An error in a rank's
    part is printed by that rank, in one line naming it (exit 1); no teardown then: the peers may
    be waiting in a collective, and torchrun stops them.
    """
    # torchrun hands a Ctrl-C on to every rank (SIGINT; SIGKILL 30 s later). The command's first lines blocked
    # it while torch imported (exit_code's docstring): from here it ends the rank at once, rank 0 saying so.
    signal.signal(signal.SIGINT, lambda *_: leave(130, "error: interrupted (SIGINT)"
                                                       if os.environ.get("RANK", "0") == "0" else ""))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        rank, world, local_rank = environment()
        cfg = prepare(world)
        check_devices(backend, device_kind)  # the flags, and a GPU at all: the same on every rank
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        check_devices(backend, device_kind, local_rank)  # this rank's own GPU
    except ValueError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr)
        return 2
    device = rank_device(device_kind, local_rank) if program else join_world(backend, device_kind, local_rank,
                                                                              cfg.timeout_s)
    try:
        t0 = time.perf_counter()
        if program:
            result = program(cfg)
        else:
            mine, result = body(cfg, rank, device), [None] * world if rank == 0 else None
            dist.gather_object(mine, result, dst=0)
        seconds = time.perf_counter() - t0
    except Exception as e:
        print(f"error: rank {rank} failed: {one_line(e)}", file=sys.stderr, flush=True)
        if show_traceback:
            traceback.print_exc()
        code = 1
    else:
        try:
            code = finish(cfg, result, device, seconds) if rank == 0 else 0
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    # End the process without Python's interpreter shutdown, as multiprocessing ends a forked rank.
    # destroy_process_group does not stop every Gloo worker thread: DTensor's caches still hold the
    # mesh's process groups. A worker that has just finished this rank's last collective
    # (gather_object's gather, on every rank but 0, which leaves at once) may drop that work's
    # tensors only after the main thread began shutting the interpreter down; freeing them takes
    # the GIL, Python then ends the thread (pthread_exit), and unwinding through the work's
    # destructor calls std::terminate: "terminate called without an active exception", exit -6
    # (a core dump showed exactly this stack; pytorch/pytorch PR 179291 describes the same crash). Without
    # the shutdown, no thread can meet it.
    leave(code)


def main_under_torchrun(module, argv=None):
    """distributed_muon.py's command, in each process torchrun started: the flags (rank 0 says what is
    wrong, exit 2), the plan (rank 0 prints it), the run_rank of `module` (distributed_muon: the lesson's twin for
    GPUs, imported here by name, as its command starts before it defines run_rank), and the report (rank 0). DP is
    the world size / TP unless --dp says otherwise."""
    run_rank = importlib.import_module(module).run_rank
    args = build_parser("Distributed Muon on GPUs (NCCL, one process per GPU, launched with torchrun), "
                        "checked bit for bit against torch.optim.Muon / AdamW on the same device.",
                        launcher="torchrun").parse_args(argv)
    backend = {"gloo": "Gloo", "nccl": "NCCL"}[args.backend]

    def prepare(world):
        if args.dp is None:
            if world % args.tp:
                raise ValueError(f"TP {args.tp} does not divide the world size {world}")
            args.dp = world // args.tp
        cfg = config_from_args(args)
        check_topology(cfg.dp, cfg.tp, world)
        validate(cfg, demo_specs(cfg))
        if args.json:
            check_writable(args.json)
        return cfg

    def program(cfg):
        if os.environ["RANK"] == "0":  # the layout every rank builds, printed once
            print_header(cfg, plan_optimizer(cfg), "GPU" if cfg.device == "cuda" else "CPU", backend, args.explain,
                         print)
        return rank_program(cfg, run_rank)()

    def finish(cfg, out, device, seconds):
        gpu = torch.cuda.get_device_name(device) if cfg.device == "cuda" else None
        if gpu:
            print(f"device: {gpu}\n")
        results = report(cfg, plan_optimizer(cfg), out["ranks"], bound(cfg, out["checks"], device),
                         seconds - out["reference_s"], out["reference_s"], backend=cfg.backend)
        results["launcher"] = dict(backend=cfg.backend, device=cfg.device, gpu=gpu)
        write_json(args.json, results)
        return 0 if results["passed"] else 1

    return run_under_torchrun(args.backend, args.device, prepare, None, finish, args.traceback, program)
