"""Section 11, the launcher: start one process per rank (from muon_forkserver's forkserver), watch their
heartbeats, stop every rank on a failure, Ctrl-C or SIGTERM, and name the rank that failed first (RankFailure)."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing.util
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist

from muon_forkserver import remove_at_exit, start_method
from muon_tools.outputs import one_line, write_atomically


# =============================================================================
# 11. Main: the launcher and the command line
# =============================================================================
# The launcher checks the arguments and plans the layout (before starting any
# rank), starts one process per rank and watches them, then prints the report.
# Like torchrun, it tells each process who it is (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT), stops every rank on Ctrl-C or SIGTERM, and names the
# rank that failed, died or stopped responding. What a rank returns reaches the
# launcher through a temporary folder: the lesson's run_rank returns its report
# on rank 0 (every rank's results, gathered there, and the check against torch).
# Under torchrun (distributed_muon.py, and the examples' --backend nccl) there is
# no launcher of ours: run_under_torchrun (torchrun.py) does in each process what can
# be done there.


HEARTBEAT_S = 0.5  # how often a rank says it is alive


def end_if_orphaned(launcher, folders, wait_s=0.0):
    """End this rank if the launcher is gone (start_heartbeat), removing the launcher's temporary folders first.
    A rank also looks once it has written its last file there (its result, or its error, which a peer's going
    may cause): every rank removes them after its last write, so the last one out leaves nothing."""
    if launcher.poll(wait_s):
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)


def start_heartbeat(heartbeats, rank, launcher, folders):
    """A thread that writes the time into heartbeats[rank] every HEARTBEAT_S.

    It beats while the rank computes or waits in a collective, and stops only
    when the whole process does (SIGSTOP, a debugger, swapped out): that is how
    the launcher tells the rank that stopped from the peers waiting for it.
    `launcher` is the read end of a pipe whose write end only the launcher holds:
    it becomes readable (end of file) when the launcher is gone, even killed by
    SIGKILL, and then the rank ends itself rather than run on as an orphan. A
    launcher killed so cleans up nothing: the ranks remove its temporary `folders`
    (the run's, and multiprocessing's, where the forkserver's socket lies).
    """
    def beat():
        while True:
            end_if_orphaned(launcher, folders, HEARTBEAT_S)  # nothing is ever sent: it times out, or ends all
            heartbeats[rank] = time.monotonic()

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()


def name_process(title):
    """Show `title` in ps and top (Linux's prctl PR_SET_NAME); elsewhere do nothing."""
    try:
        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME, at most 15 bytes
    except (OSError, AttributeError):
        pass


def rank_process(rank, body, program, cfg, port, out_dir, heartbeats, launcher, folders):
    """One spawned rank, told who it is as torchrun tells it. body: body(rank, cfg, "cpu") once this
    process has joined the Gloo world; or program: program(), which joins and leaves by itself (the
    lesson's run_rank). What it returns is written to out_dir.

    Nothing is printed here: a failure is written to rank<R>.error (time, one
    line, traceback) and the launcher reports it once, for the whole run.
    """
    # Ctrl-C in a terminal sends SIGINT to every process of the job; the launcher
    # alone decides what happens next (it stops every rank and cleans up).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process(f"muon rank {rank}")
    start_heartbeat(heartbeats, rank, launcher, folders)
    torch.set_num_threads(1)  # same thread count everywhere, as in torch's reference (section 9)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.dp * cfg.tp),
                      LOCAL_WORLD_SIZE=str(cfg.dp * cfg.tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if program is not None:
            result = program()
        else:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
            result = body(rank, cfg, "cpu")
            dist.destroy_process_group()
        write_atomically(os.path.join(out_dir, f"rank{rank}.pt"), lambda f: torch.save(result, f))
    except BaseException as e:
        # When one rank dies its peers fail too ("connection closed"). The time
        # lets the launcher name the rank that failed first: the cause.
        text = f"{time.time()!r}\n{one_line(e)}\n{traceback.format_exc()}"
        with contextlib.suppress(OSError):  # the launcher died and its folder went with it: nobody to tell
            write_atomically(os.path.join(out_dir, f"rank{rank}.error"), lambda f: f.write(text.encode()))
        end_if_orphaned(launcher, folders)
        os._exit(1)  # no teardown that could wait on a dead peer
    end_if_orphaned(launcher, folders)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(RuntimeError):
    """A rank failed, died or stopped responding; str() is one line, .traceback the rank's own."""

    def __init__(self, message, traceback_text=""):
        super().__init__(message)
        self.traceback = traceback_text


class Interrupted(BaseException):
    """SIGTERM, turned into an exception so that the launcher can clean up as for Ctrl-C."""


def raise_interrupted(signum, frame):
    raise Interrupted()


def rank_errors(out_dir):
    """[(time, rank, one-line error, traceback)] of every rank that wrote an error, earliest first."""
    errors = []
    for name in os.listdir(out_dir):
        if name.startswith("rank") and name.endswith(".error"):
            with open(os.path.join(out_dir, name)) as f:
                when, error, trace = f.read().split("\n", 2)
            errors.append((float(when), int(name[len("rank"):-len(".error")]), error, trace))
    return sorted(errors)


# How a rank's error says that another rank found the problem: the optimizers vote, then the ranks that found
# it raise the details and every other one raises "rank R refused ... (it raised why); nothing changed"
# (distributed_muon_cpu.py's and distmuon/dtensor's refused step, clip_qk_ in distmuon/large_runs.py and
# distmuon/dtensor/).
SECONDHAND = "(it raised why)"


def is_secondhand(error):
    """Whether a rank's one-line error only says that another rank found the problem (SECONDHAND)."""
    return SECONDHAND in error


def culprit_failure(exits, out_dir):
    """The RankFailure that names the cause, once some rank has exited abnormally.

    exits: [(rank, exit code)] in the order the launcher saw them end. A rank
    killed by a signal is the cause (its peers then fail with "connection
    closed"); otherwise the rank whose error was written first is, unless it is
    secondhand (another rank found the problem): after a vote every rank raises at
    once, in any order, and the first error that gives the details is the cause.
    """
    for rank, code in exits:
        if code < 0:
            return RankFailure(f"rank {rank} was killed by {signal.Signals(-code).name}")
    errors = rank_errors(out_dir)
    if errors:
        errors.sort(key=lambda e: is_secondhand(e[2]))  # stable: the details first, each kind by time
        _, rank, error, trace = errors[0]
        others = sorted(r for _, r, _, _ in errors[1:])
        also = f" (then rank{'s' * (len(others) > 1)} {', '.join(map(str, others))} failed too)" if others else ""
        return RankFailure(f"rank {rank} failed: {error}{also}", trace)
    rank, code = exits[0]
    return RankFailure(f"rank {rank} exited with code {code}")


POLL_S = 0.2  # how often the launcher looks at the ranks
ERRORS_LAND_S = 1.0  # after a first failure, how long its peers get to fail and say why


def watch(procs, heartbeats, out_dir, timeout_s):
    """Wait for every rank; return None when all succeeded, else the RankFailure.

    Every POLL_S it looks at which processes ended and at every heartbeat. A rank
    that exited with an error ends the run (its peers fail right after it; the
    launcher waits ERRORS_LAND_S for their errors, to name the first, and while
    every error so far is secondhand (another rank found the problem), up to
    timeout_s for the rank that found it); so does a rank whose heartbeat is older
    than timeout_s.
    """
    exits = []
    while True:
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=POLL_S)
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if p.exitcode is None and now - heartbeats[rank] > timeout_s:
                return RankFailure(f"rank {rank} stopped responding: no heartbeat for {timeout_s:g} s "
                                   f"(--timeout {timeout_s:g}); it was stopped or frozen")
        exits += [(rank, p.exitcode) for rank, p in enumerate(procs)
                  if p.exitcode not in (None, 0) and rank not in dict(exits)]
        if exits:
            def waiting_for_the_details():
                errors = rank_errors(out_dir)
                return time.monotonic() < now + timeout_s and errors and all(is_secondhand(e[2]) for e in errors)

            while (any(p.exitcode is None for p in procs)
                   and (time.monotonic() < now + ERRORS_LAND_S or waiting_for_the_details())):
                multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=POLL_S)
            return culprit_failure(exits, out_dir)
        if all(p.exitcode == 0 for p in procs):
            return None


def stop(procs):
    """SIGKILL every rank still running (a stopped one too) and reap it; a rank whose start
    failed (no pid) has nothing to stop, and the start's own error goes on."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.exitcode is None:
            p.kill()
    for p in started:
        p.join()


def spawn_ranks(cfg, body=None, program=None):
    """Run body(rank, cfg, "cpu") on cfg.dp x cfg.tp ranks, each joined to the Gloo world first; or
    program(), which joins by itself as under torchrun (rank_program: the lesson's run_rank). Returns
    what each returned, in rank order, or raises RankFailure naming the rank at fault.

    body and program must be importable by name, as any multiprocessing target (a functools.partial of
    one is). cfg needs dp, tp and timeout_s. Whatever ends the run (success, a failure, Ctrl-C or SIGTERM
    in the launcher), every rank is stopped and the temporary folder removed before this returns.
    """
    if (body is None) == (program is None):
        raise ValueError("spawn_ranks runs a body or a program: give one of them")
    context = multiprocessing.get_context(start_method())
    world = cfg.dp * cfg.tp
    heartbeats = context.Array("d", world, lock=False)  # shared memory: one time per rank
    with tempfile.TemporaryDirectory(prefix="distributed-muon-") as out_dir:
        remove_at_exit(out_dir)
        launcher, alive = context.Pipe(duplex=False)  # the ranks watch `launcher`; `alive` stays here
        folders = (out_dir, multiprocessing.util.get_temp_dir())  # what the ranks remove if the launcher is killed
        args = (body, program, cfg, free_port(), out_dir, heartbeats, launcher, folders)
        procs = [context.Process(target=rank_process, args=(rank,) + args, name=f"rank {rank}")
                 for rank in range(world)]
        try:
            for p in procs:
                p.start()
            for rank in range(world):  # the clock starts once every rank is started
                heartbeats[rank] = time.monotonic()
            failure = watch(procs, heartbeats, out_dir, cfg.timeout_s)
        finally:
            stop(procs)
        if failure:
            raise failure
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def worker_process(rank, fn, launcher, folders, *args):
    """A benchmark's worker (run_processes): fn(rank, *args), ended by a thread of its own, the launcher's
    temporary folders removed, once the launcher is gone (killed by SIGKILL too), as a rank is (start_heartbeat)."""
    def watch():
        while True:
            end_if_orphaned(launcher, folders, HEARTBEAT_S)

    threading.Thread(target=watch, daemon=True, name="launcher watch").start()
    fn(rank, *args)


def run_processes(fn, args, nprocs, folders=()):
    """fn(rank, *args) in nprocs processes started as the ranks are (start_method), for the benchmarks' workers,
    which join their process group themselves: wait for every one; the first that fails ends the run
    (RankFailure naming it; its traceback is on stderr). Whatever ends it (a failure, Ctrl-C, SIGTERM), every
    process is stopped before this returns; a launcher killed outright, the workers end themselves and remove
    `folders` (the caller's temporary ones) and multiprocessing's."""
    context = multiprocessing.get_context(start_method())
    remove_at_exit(*folders)
    launcher, alive = context.Pipe(duplex=False)  # the workers watch `launcher`; `alive` stays here
    folders = tuple(folders) + (multiprocessing.util.get_temp_dir(),)
    procs = [context.Process(target=worker_process, args=(rank, fn, launcher, folders) + tuple(args),
                             name=f"rank {rank}") for rank in range(nprocs)]
    try:
        for p in procs:
            p.start()
        while any(p.exitcode is None for p in procs):
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=POLL_S)
            failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                rank, code = failed[0]
                raise RankFailure(f"rank {rank} " + (f"was killed by {signal.Signals(-code).name}" if code < 0
                                                     else f"exited with code {code}"))
    finally:
        stop(procs)
        alive.close()
