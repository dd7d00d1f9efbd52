"""Issue 30, item 9: how often `examples/train_gpt_dtensor.py --verify` dies on a loaded machine.

Once in five runs under a load near 15 on 2 cores it ended with `malloc(): unaligned fastbin chunk
detected` and a rank killed by SIGABRT: heap corruption, cause unknown. This runs the command again and
again beside busy loops (the load) and counts how each run ended; --malloc-check runs it with glibc's
MALLOC_CHECK_=3, which aborts at the first inconsistency it sees instead of later (glibc 2.34 and later
honour it only with their debugging malloc preloaded, libc_malloc_debug.so.0: --malloc-check preloads it,
and refuses to run where it is missing. Measured with glibc 2.36: a C program writing one byte past a
24-byte block ran to its end without it and with MALLOC_CHECK_=3 alone; preloaded, free() aborted).

    python benchmarks/heap_stress.py                          # 10 runs of --verify beside 2 busy loops
    python benchmarks/heap_stress.py --runs 30 --busy 6 --malloc-check
    python benchmarks/heap_stress.py --runs 5 -- --dp 2 --tp 2 --steps 3   # other flags for the command
    git worktree add /tmp/then 04eef11 && python benchmarks/heap_stress.py --checkout /tmp/then  # as it was

It prints one line a run (exit code, seconds, the first line of stderr when it failed) and the rate.
A rate is only what was seen: 0 in N runs bounds the rate below about 3/N (95 %), no more.

Observed so far (2 cores shared with another engineer's jobs, load 4-16, torch 2.14.1, no fix applied):
`--runs 8 --busy 2`, stopped by a timeout after 6 whole runs of 192-319 s: 0 failures (and --malloc-check,
before it preloaded the debugging malloc, checked nothing). At commits 252d68a and 866148e (runs 3-5: the
janitor's error handling changed in between), the machine otherwise idle:
`--runs 5 --busy 2 --malloc-check`, heap checks on: 5 runs of 215-254 s, 0 failures, no heap message. 0 in 11
neither reproduces the crash nor rules out 1 in 5 (0 in 11 happens 9 % of the time at that rate); no cause
found. At commit 6fdc039, many short runs instead (each start and exit, where threads are made and left, 40 times):
`--runs 40 --busy 2 --malloc-check -- --verify --steps 6 --val-windows 4`: 40 runs of 60-73 s, 0 failures, no
heap message (load 5 at the end). At commit a9b6a1c, under a heavier load (eight busy loops, as near the load of
15 the crash was seen under): `--runs 12 --busy 8 --malloc-check -- --verify --steps 6 --val-windows 4`: 12 runs of
136-170 s, 0 failures, no heap message (load 9.9 at the end). At commit 4b99ebf (the lesson's forkserver started
first; the examples' unchanged), the same command with --runs 6: 6 runs of 138-160 s, 0 failures, no heap message
(load 9.8 at the end). At commit bf7ea08 (this command's own forkserver started first too), with --runs 8: 8 runs of
127-139 s, 0 failures, no heap message (load 10.0 at the end). Most of those ran with --malloc-check, whose
debugging malloc places blocks otherwise than glibc's own, which can hide a bug that depends on where they lie; the
crash was seen without it. So at commit 25cee33, without it (glibc's own checks, such as the "unaligned fastbin
chunk" one, stay on): `--runs 16 --busy 8 -- --verify --steps 6 --val-windows 4`: 16 runs of 94-174 s, 0 failures
(load 10.0 at the end); then the crash's own command at its full length, `--runs 8 --busy 12` (load 13-14), stopped
by SIGTERM after 3 whole runs of 644-654 s: 0 failures. At commit eee5388, on another 2-core EPYC, one with
AVX512-BF16 (bf16 matmul 206 GFLOP/s a thread against 1.7: the ranks' phases interleave otherwise), the crash's own
command at its full length, `--runs 20 --busy 8`, glibc's own allocator: 20 runs of 159-231 s, 0 failures (load 9.4
at the end); then many short runs (each start and exit), `--runs 40 --busy 12 -- --verify --steps 6 --val-windows 4`:
40 runs of 60-85 s, 0 failures (load 14.0 at the end). The rate before, at the code the crash was seen with
(commit 04eef11, the last before issue 30's first changes; its own checkout, a git worktree, run by --checkout), on the
same AVX512-BF16 EPYC, glibc's own allocator: `--runs 15 --busy 8 --checkout DIR` (the crash's own command at its full
length): 15 runs of 209-303 s, 0 failures (load 9.6 at the end; 0 in 15 happens 3.5 % of the time at 1 in 5). So the
code of then does not crash here either: 0 in 171 in all, before and after; whatever made the one crash (another
engineer's jobs on that machine, its memory, a rarer race) is not in these runs, and no cause is found or claimed.
What is alive in a rank when it ends (`/proc/self/task` read at the end of rank_process, in a copy, one run of
`train_gpt_dtensor.py --steps 2`): the main thread and the heartbeat thread, 4 Gloo run loops (pt_gloo_runloop)
and 2 Gloo TCP loops after destroy_process_group, 8 autograd threads, and rank 0's TCPStore loop. A rank forked
by the forkserver ends in os._exit (multiprocessing's forkserver.py), so no destructor runs beside them.
The forkserver itself holds one thread beside its main one once torch is imported: numpy's OpenBLAS thread server
(torch imports numpy; found with gdb), idle; OpenBLAS stops it before every fork (its pthread_atfork handler:
measured, a process's 2 threads are 1 after an os.fork, and the child has 1), so no rank starts with it.
"""

import signal
import sys

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import ctypes.util  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import muon_tools as mt  # noqa: E402

COMMAND = os.path.join("examples", "train_gpt_dtensor.py")  # in this checkout, or in --checkout DIR
HEAP = "malloc"  # glibc's heap checks all say malloc(), free() or corrupted...: the first word of the known one
RUN_TIMEOUT_S = 900


def spin():
    """A busy loop, forked: it takes the command's SIGTERM handler and SIGINT with it; the command kills it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        pass


def malloc_check_env():
    """{variable: value} that turn glibc's heap checks on (MALLOC_CHECK_=3); glibc 2.34 moved them into
    libc_malloc_debug.so.0, which must be preloaded (its NEWS for 2.34); ValueError where it cannot be."""
    env = {"MALLOC_CHECK_": "3"}
    version = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else ""
    if not version.startswith("glibc "):
        raise ValueError(f"--malloc-check needs glibc (this C library says {version or 'nothing'})")
    if tuple(map(int, version.split()[1].split(".")[:2])) >= (2, 34):
        debug = ctypes.util.find_library("c_malloc_debug")
        if not debug:
            raise ValueError(f"--malloc-check: {version} checks the heap only with libc_malloc_debug.so.0 "
                             f"preloaded, and it is not installed")
        env["LD_PRELOAD"] = " ".join(filter(None, [debug, os.environ.get("LD_PRELOAD", "")]))
    return env


def one_run(command, flags, env):
    """(exit code, seconds, what it said): the command once, as a user runs it."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, command, *flags], capture_output=True, text=True, env=env,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0, f"no end after {RUN_TIMEOUT_S} s"
    said = next((line for line in proc.stderr.splitlines() if line.strip()), "")
    return proc.returncode, time.monotonic() - t0, said


def main(argv=None):
    p = mt.OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="how many runs (default %(default)s)")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 1,
                   help="busy loops beside the runs, the load (default %(default)s: one a core)")
    p.add_argument("--malloc-check", action="store_true",
                   help="run the command with MALLOC_CHECK_=3 (and glibc's debugging malloc preloaded)")
    p.add_argument("--checkout", default=ROOT, metavar="DIR",
                   help="run DIR's examples/train_gpt_dtensor.py, e.g. a git worktree at an older commit (default: "
                        "this checkout's)")
    p.add_argument("flags", nargs="*", default=["--verify"],
                   help="the command's flags, after -- (default --verify)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.busy < 0:
        p.error(f"--runs must be >= 1 and --busy >= 0 (got {args.runs}, {args.busy})")
    command = os.path.join(args.checkout, COMMAND)
    if not os.path.isfile(command):
        p.error(f"--checkout {args.checkout}: it has no {COMMAND}")

    def work():
        try:
            commit = subprocess.run(["git", "-C", args.checkout, "log", "-1", "--format=%h"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:  # no git here
            commit = ""
        checks = malloc_check_env() if args.malloc_check else {}
        env = dict(os.environ, **checks)
        busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
        print(f"{args.runs} runs of {COMMAND} {' '.join(args.flags)} at commit "
              f"{commit or '(not a git checkout)'} beside {args.busy} busy "
              f"loop{'s' * (args.busy != 1)} on {os.cpu_count()} cores"
              + "".join(f", {k}={v}" for k, v in checks.items()), flush=True)
        ends = []
        try:
            for b in busy:
                b.start()
            for i in range(args.runs):
                code, seconds, said = one_run(command, args.flags, env)
                ends.append((code, said))
                print(f"run {i + 1:3d}/{args.runs}  exit {code!s:>4}  {seconds:6.1f} s"
                      + (f"  {said}" if code != 0 else ""), flush=True)
        finally:
            for b in busy:
                b.kill()
                b.join()
        failed = [said for code, said in ends if code != 0]
        heap = [said for said in failed if HEAP in said or "SIGABRT" in said]
        print(f"Failed: {len(failed)} of {len(ends)}; of which heap corruption or SIGABRT: {len(heap)} "
              f"(load: {os.getloadavg()[0]:.1f} at the end)")
        return 0

    return mt.exit_code(work)


if __name__ == "__main__":
    sys.exit(main())
