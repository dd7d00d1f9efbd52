"""Issue 30, item 9: how often `examples/train_gpt_dtensor.py --verify` dies on a loaded machine.

Once in five runs under a load near 15 on 2 cores it ended with `malloc(): unaligned fastbin chunk
detected` and a rank killed by SIGABRT: heap corruption, cause unknown. This runs the command again and
again beside busy loops (the load) and counts how each run ended; --malloc-check runs it with glibc's
MALLOC_CHECK_=3, which aborts at the first inconsistency it sees instead of later (glibc 2.34 and later
honour it only with their debugging malloc preloaded, libc_malloc_debug.so.0: --malloc-check preloads it,
and refuses to run where it is missing; what was seen with glibc 2.36: notes/measured/from_code_comments.md).

    python benchmarks/heap_stress.py                          # 10 runs of --verify beside 2 busy loops
    python benchmarks/heap_stress.py --runs 30 --busy 6 --malloc-check
    python benchmarks/heap_stress.py --runs 5 -- --dp 2 --tp 2 --steps 3   # other flags for the command
    git worktree add /tmp/then 04eef11 && python benchmarks/heap_stress.py --checkout /tmp/then  # as it was

It prints one line a run (exit code, seconds, the first line of stderr when it failed) and the rate.
A rate is only what was seen: 0 in N runs bounds the rate below about 3/N (95 %), no more. The runs made so
far, and what is alive in a rank when it ends: notes/measured/from_code_comments.md.
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

import muon_tools  # noqa: E402

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
    p = muon_tools.OneLineParser(description=__doc__.splitlines()[0])
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

    return muon_tools.exit_code(work)


if __name__ == "__main__":
    sys.exit(main())
