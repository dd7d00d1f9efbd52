"""The ranks' forkserver and the janitor: how a command starts its ranks quickly and leaves nothing behind.

No torch here, on purpose: every command calls start_command() in its first lines, before its own import of
torch (seconds), so that the forkserver's import of it, which the ranks need, runs at the same time on another
core instead of after it (a small run's command seconds sooner on 2 cores: notes/measured/timings.md).
muon_tools/launch.py, the launcher, forks every rank from this forkserver; a command refused before any rank
starts stops it on the way out. Beside the lesson, no part of it.
"""

import atexit
import contextlib
import functools
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import subprocess
import sys

# The ranks remove the launcher's temporary folders when it is killed outright (end_if_orphaned), but only once
# they run: a launcher killed by SIGKILL while its forkserver imports torch (seconds) left its folders behind.
# A janitor, a small Python of its own (no torch: a tenth of a second), waits for the end of a pipe that only
# the launcher writes to, then removes every folder the launcher named on it: at the launcher's end, however
# it ends (those it removed itself are gone already). Ctrl-C and SIGTERM reach it with the job: it ignores them.
JANITOR = """
import shutil, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
folders = sys.stdin.read().splitlines()  # until the end of file: the launcher is gone
for folder in folders:
    shutil.rmtree(folder, ignore_errors=True)
"""


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT ignored in this process while it starts a child, which inherits that from its first instruction
    (a handler would not survive the child's exec, nor a mask: _posixsubprocess clears it). Ctrl-C reaches the
    whole job; a child that cannot ignore it yet prints Python's traceback, or its fatal error. A Ctrl-C that
    waits (SIGINT blocked, as in a command's first lines) would be dropped by SIG_IGN (POSIX): it is raised
    again, and waits on."""
    pending = signal.SIGINT in signal.sigpending()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            signal.raise_signal(signal.SIGINT)


@functools.lru_cache(maxsize=None)
def janitor():
    """This process's janitor (started at first use; one a launcher, for every run it starts), told at once of
    multiprocessing's folder (the forkserver's socket, the ranks' semaphores: one for the process's life)."""
    with sigint_ignored():
        proc = subprocess.Popen([sys.executable, "-c", JANITOR], stdin=subprocess.PIPE, text=True)
    proc.stdin.write(multiprocessing.util.get_temp_dir() + "\n")
    proc.stdin.flush()
    return proc


def remove_at_exit(*folders):
    """Have the janitor remove these folders once this process is gone, however it goes."""
    with contextlib.suppress(OSError):  # a janitor killed by hand: the run goes on, as before there was one
        janitor().stdin.write("".join(f"{folder}\n" for folder in folders))
        janitor().stdin.flush()


def start_method():
    """How ranks are started: forked from a server that has already imported torch.

    Each freshly spawned process spends seconds importing torch (and torch._dynamo,
    which torch.optim.Optimizer imports on first use), and 8 ranks on 2 cores do it
    at once. A forkserver imports them once and forks each rank from it, which
    reaches the first step several times sooner. "spawn" remains where there is no forkserver.
    """
    janitor()  # it removes multiprocessing's folder, where the forkserver puts its socket, however this ends
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch.optim", "torch._dynamo"])
    # multiprocessing's resource tracker (the forkserver's first child) unblocks SIGINT and SIGTERM once it has
    # started, whatever they were: the mask is put back (a command's first lines block SIGINT until
    # muon_tools.exit_code takes it), and a Ctrl-C that lands meanwhile is caught, then raised again.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        multiprocessing.resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, previous)
    if caught:
        signal.raise_signal(signal.SIGINT)  # waits, where the mask blocks it; else as any Ctrl-C here
    # The forkserver imports torch before it would ignore SIGINT itself; the launcher ignores it only while the
    # server process is made, not while it imports.
    with sigint_ignored():
        try:
            multiprocessing.forkserver.ensure_running()
        except OSError as e:  # its socket lies in multiprocessing's folder, in TMPDIR: a Unix socket's path is short
            if "too long" not in str(e):
                raise
            raise ValueError(f"the ranks' forkserver cannot listen in {multiprocessing.util.get_temp_dir()} ({e}): "
                             f"set TMPDIR to a shorter folder") from None
    return "forkserver"


def stop_forkserver():
    """SIGKILL this process's forkserver, if it started one, and reap it. An interrupted command's: it would
    end by itself once it sees the command gone, but only after its own import of torch, seconds later."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # multiprocessing's own record of it
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def start_command(spawns_ranks=True):
    """A command's first lines, in one call, before it imports torch (seconds): SIGINT is blocked, so that a Ctrl-C
    while torch loads waits for muon_tools.exit_code (one line, exit 130), not a traceback out of torch's import;
    and for a command that spawns ranks, the janitor and the forkserver start now, the forkserver importing torch
    beside this process, and ending with the command whichever way it ends (a refusal, --help, a finished run;
    exit_code stops it itself before an os._exit). Under torchrun every process is a rank already: none starts."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    if not spawns_ranks or {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= os.environ.keys():
        return
    atexit.register(stop_forkserver)
    with contextlib.suppress(ValueError):  # the launcher meets it again, where a refusal is one line: not here
        start_method()
