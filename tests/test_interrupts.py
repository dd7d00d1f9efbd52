"""What a user does to a real run, and what they get back, as torchrun would give it:
Ctrl-C and SIGTERM stop every rank and clean up (exit 130 / 143), at any moment, even while
torch imports; a rank that dies or stops ends the run with one line naming it (exit 1); a
launcher killed outright leaves no rank and no temporary file. Each test starts the script in a
session of its own, with a private temporary folder, so that it can check that no process and
no temporary file is left behind."""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, SCRIPT
import muon_tools

TRAIN_GPT = os.path.join(ROOT, "examples", "train_gpt.py")

LONG_RUN = ["--dp", "2", "--tp", "2", "--steps", "2000"]  # minutes of steps: only a signal ends it early
STOPS_WITHIN_S = 10  # what "within seconds" means on a loaded 2-core machine


STARTED = []  # every Run of the session: a test that fails before it ends its run leaves it to conftest's reaper


class Run:
    """The script (or another that uses its launcher; script=None: argv is python's own) in its own session (a
    terminal's job), with TMPDIR under tmp_path."""

    def __init__(self, tmp_path, *argv, script=SCRIPT, tmp="tmp"):
        STARTED.append(self)
        self.tmp = tmp_path / tmp
        self.tmp.mkdir()
        # torch creates an (empty) compile cache in TMPDIR at import; it is torch's, and persistent
        env = dict(os.environ, TMPDIR=str(self.tmp), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
        self.proc = subprocess.Popen([sys.executable, *([script] if script else []), *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)

    def processes(self, parent=None):
        """{pid: name} of the live processes of the run's session (zombies are dead already); of those whose parent
        is `parent`, if given."""
        found = {}
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(stat) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(os.path.join(os.path.dirname(stat), "comm")) as f:
                    name = f.read().strip()
            except OSError:
                continue  # ended while we looked
            if int(fields[3]) == self.proc.pid and fields[0] != "Z" and parent in (None, int(fields[1])):
                found[int(os.path.basename(os.path.dirname(stat)))] = name  # session id, state, parent's pid
        return found

    def kill_all(self):
        """SIGKILL whatever of the run's session is still alive (after its test, whatever happened in it)."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.poll()

    def rank_pid(self, rank, world=4, within_s=60):
        """Wait until every rank runs (they name themselves 'muon rank R'), then a moment more."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            ranks = {name: pid for pid, name in self.processes().items() if name.startswith("muon rank")}
            if len(ranks) == world:
                time.sleep(2)  # into the steps
                return ranks[f"muon rank {rank}"]
            time.sleep(0.2)
        pytest.fail(f"the ranks did not start: {self.processes()}")

    def forkserver(self):
        """The pid of the run's forkserver (multiprocessing's, which imports torch before it forks a rank), or None."""
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"multiprocessing.forkserver" in f.read():
                        return pid
            except OSError:
                continue
        return None

    def sigint(self, field):
        """Whether SIGINT is in the process's signal mask field of /proc/PID/status: SigBlk (blocked), ShdPnd
        (pending)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith(field + ":"))
        return bool(int(mask, 16) >> (signal.SIGINT - 1) & 1)

    def finish(self, within_s):
        """(exit code, stdout, stderr, seconds), then check that nothing is left behind."""
        t0 = time.monotonic()
        out, err = self.proc.communicate(timeout=within_s + 60)
        seconds = time.monotonic() - t0
        deadline = time.monotonic() + 10  # the forkserver exits once it sees the launcher gone
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.processes() == {}
        return self.proc.returncode, out, err, seconds


def assert_one_line(err, expected):
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(expected), err


def assert_ctrl_c_stops_every_rank(tmp_path, *argv, script=SCRIPT):
    """Ctrl-C (SIGINT to the job) once every rank runs: exit 130 within STOPS_WITHIN_S, one line, no process
    and no temporary file left (for the scripts that reuse the lesson's launcher)."""
    run = Run(tmp_path, *argv, script=script)
    run.rank_pid(0)
    os.killpg(run.proc.pid, signal.SIGINT)
    returncode, out, err, seconds = run.finish(STOPS_WITHIN_S)
    assert returncode == 130 and seconds < STOPS_WITHIN_S
    assert_one_line(err, "error: interrupted (SIGINT); every rank stopped, temporary files removed")
    assert os.listdir(run.tmp) == []
    return out


@pytest.mark.parametrize("how,code,message", [
    ("SIGINT to the job", 130, "error: interrupted (SIGINT); every rank stopped, temporary files removed"),
    ("SIGTERM to the launcher", 143, "error: terminated (SIGTERM); every rank stopped, temporary files removed"),
])
def test_ctrl_c_and_sigterm_stop_every_rank_and_clean_up(tmp_path, how, code, message):
    run = Run(tmp_path, *LONG_RUN)
    run.rank_pid(0)
    if how.startswith("SIGINT"):
        os.killpg(run.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    else:
        os.kill(run.proc.pid, signal.SIGTERM)
    returncode, out, err, seconds = run.finish(STOPS_WITHIN_S)
    assert returncode == code and seconds < STOPS_WITHIN_S
    assert_one_line(err, message)
    assert "Result:" not in out
    assert os.listdir(run.tmp) == []


@pytest.mark.parametrize("rank,sig", [(3, signal.SIGKILL), (2, signal.SIGTERM)])
def test_a_rank_that_dies_ends_the_run_naming_it(tmp_path, rank, sig):
    run = Run(tmp_path, *LONG_RUN)
    os.kill(run.rank_pid(rank), sig)
    returncode, out, err, seconds = run.finish(STOPS_WITHIN_S)
    assert returncode == 1 and seconds < STOPS_WITHIN_S
    assert_one_line(err, f"error: rank {rank} was killed by {sig.name}")
    assert os.listdir(run.tmp) == []


def test_a_rank_that_stops_responding_ends_the_run_within_the_timeout(tmp_path):
    timeout = int(muon_tools.MIN_TIMEOUT_S)  # the shortest a run takes (what its ranks may need to start)
    run = Run(tmp_path, *LONG_RUN, "--timeout", str(timeout))
    os.kill(run.rank_pid(1), signal.SIGSTOP)  # alive, but never runs again: its peers wait for it
    returncode, out, err, seconds = run.finish(timeout + STOPS_WITHIN_S)
    assert returncode == 1 and timeout <= seconds < timeout + STOPS_WITHIN_S
    assert_one_line(err, f"error: rank 1 stopped responding: no heartbeat for {timeout} s (--timeout {timeout})")
    assert os.listdir(run.tmp) == []


def test_ranks_end_themselves_when_the_launcher_is_killed(tmp_path):
    """SIGKILL cannot be caught: the ranks notice the launcher is gone, remove its temporary folders (the run's,
    where a rank that saw its peers go may have written rank<R>.error, and multiprocessing's) and exit."""
    run = Run(tmp_path, *LONG_RUN)
    run.rank_pid(0)
    assert {name.split("-")[0] for name in os.listdir(run.tmp)} >= {"distributed", "pymp"}
    os.kill(run.proc.pid, signal.SIGKILL)
    returncode, _, _, _ = run.finish(STOPS_WITHIN_S)  # asserts no rank is left
    assert returncode == -signal.SIGKILL
    assert os.listdir(run.tmp) == []


def test_a_launcher_killed_before_any_rank_starts_leaves_nothing(tmp_path):
    """SIGKILL to the launcher while its forkserver still imports torch, before any rank runs (no rank is there
    to clean up for it): its janitor removes the folders it had made; the forkserver ends by itself."""
    run = Run(tmp_path, *LONG_RUN)
    deadline = time.monotonic() + 60
    while not run.forkserver():
        assert time.monotonic() < deadline and run.proc.poll() is None, "no forkserver started"
        time.sleep(0.01)
    assert not [name for name in run.processes().values() if name.startswith("muon rank")]
    assert "pymp" in [name[:4] for name in os.listdir(run.tmp)]  # the forkserver's socket is in it
    os.kill(run.proc.pid, signal.SIGKILL)
    returncode, _, _, _ = run.finish(STOPS_WITHIN_S)  # asserts no process is left
    assert returncode == -signal.SIGKILL
    assert os.listdir(run.tmp) == []


def test_a_temporary_folder_too_long_for_the_forkservers_socket_is_one_line_and_exit_2(tmp_path):
    """The forkserver listens on a Unix socket in TMPDIR, whose path holds 107 bytes on Linux: a TMPDIR of more than
    about 75 characters (a pytest-xdist worker's tmp_path here) is refused in one line before any rank starts, not
    a traceback out of multiprocessing's bind; nothing is left."""
    run = Run(tmp_path, "--dp", "2", "--tp", "1", "--steps", "1", "--d-model", "64", tmp="t" * 80)
    returncode, out, err, _ = run.finish(60)
    assert returncode == 2 and out == ""
    assert_one_line(err, "error: the ranks' forkserver cannot listen in ")
    assert err.endswith(" (AF_UNIX path too long): set TMPDIR to a shorter folder\n"), err
    assert os.listdir(run.tmp) == []


FIRST_IMPORT_OF_TORCH = """
import importlib.abc, multiprocessing.forkserver, os, runpy, sys
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":  # the command's first import of torch: is its forkserver running yet?
            sys.meta_path.remove(self)
            pid = multiprocessing.forkserver._forkserver._forkserver_pid
            print("forkserver running at import torch:", pid is not None and os.path.exists(f"/proc/{pid}"),
                  file=sys.stderr)
sys.meta_path.insert(0, Watch())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("argv", [["--tp", "3"], ["--dp", "abc"]])  # exit_code's refusal, argparse's
def test_the_forkserver_starts_before_the_command_imports_torch_and_ends_with_it(tmp_path, argv):
    """The lesson's first lines start its ranks' forkserver (muon_forkserver.start_for_command) before the command
    imports torch, so that the two imports run at once on 2 cores. A command that starts no rank (a refusal, exit 2:
    the launcher's, or argparse's before exit_code runs) stops it on the way out: nothing left, no temporary folder."""
    run = Run(tmp_path, "-c", FIRST_IMPORT_OF_TORCH, SCRIPT, *argv, script=None)
    run.proc.wait(timeout=60)  # the command's end (its output is a few lines: the pipes do not fill)
    assert not run.forkserver()  # the command killed it (and reaped it) before it ended: not left to its import
    out, err = run.proc.communicate()  # which would also have waited for a forkserver holding the pipes
    returncode, _, _, _ = run.finish(10)  # and then nothing at all: the janitor ends too
    first, *rest = err.splitlines()
    assert returncode == 2 and first == "forkserver running at import torch: True"
    assert rest[0].startswith("error: ") and len(rest) == 1 and out == ""
    assert os.listdir(run.tmp) == []


@pytest.mark.parametrize("script", [TRAIN_GPT, SCRIPT], ids=["train_gpt", "the lesson"])
def test_ctrl_c_while_torch_imports_is_one_line_and_130(tmp_path, script):
    """Ctrl-C in the first seconds, while the command still imports torch: its first lines block SIGINT, so the
    signal waits (pending) until muon_tools.exit_code takes it, as it takes any Ctrl-C: exit 130, one line, not
    Python's traceback out of torch's import; no rank started, nothing left. (It ends once the imports are done:
    seconds, more on a loaded machine.)"""
    run = Run(tmp_path, "--dp", "1", "--tp", "1", "--steps", "1", script=script)
    deadline = time.monotonic() + 60
    while not run.sigint("SigBlk"):  # the script's first lines have run; torch takes seconds to import
        assert time.monotonic() < deadline and run.proc.poll() is None, "SIGINT was never blocked"
        time.sleep(0.005)
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.sigint("ShdPnd")  # it came before the command could take it: during the imports
    returncode, out, err, _ = run.finish(60)
    assert returncode == 130 and out == ""
    assert_one_line(err, "error: interrupted (SIGINT); every rank stopped, temporary files removed")
    assert os.listdir(run.tmp) == []


def test_ctrl_c_while_the_forkserver_imports_torch_is_one_line_and_130(tmp_path):
    """Ctrl-C while the forkserver the command started imports torch (seconds, before any rank): the forkserver,
    started with SIGINT ignored, prints nothing; the command ends as on any Ctrl-C."""
    run = Run(tmp_path, *LONG_RUN)
    deadline = time.monotonic() + 60
    while not run.forkserver():
        assert time.monotonic() < deadline and run.proc.poll() is None, "no forkserver started"
        time.sleep(0.01)
    time.sleep(0.3)
    assert not [name for name in run.processes().values() if name.startswith("muon rank")]  # it still imports
    os.killpg(run.proc.pid, signal.SIGINT)
    returncode, out, err, seconds = run.finish(STOPS_WITHIN_S)
    assert returncode == 130 and seconds < STOPS_WITHIN_S and "Result:" not in out
    assert_one_line(err, "error: interrupted (SIGINT); every rank stopped, temporary files removed")
    assert os.listdir(run.tmp) == []


@pytest.mark.parametrize("how", ["SIGINT to the job", "SIGKILL to the launcher"])
def test_a_benchmarks_own_workers_stop_with_it_and_leave_nothing(tmp_path, how):
    """A benchmark that starts its own workers (muon_tools.run_processes, not the lesson's launcher): Ctrl-C once
    they run ends it as any command (exit 130, one line); a launcher killed outright, its workers end themselves
    and remove its temporary folders. No worker and no temporary file is left either way."""
    # two_ranks.py's 2 workers step a tiny model a thousand times: they still run when the signal comes, however
    # fast the machine (a shorter benchmark's could end within the second this waits)
    run = Run(tmp_path, "--d", "64", "--layers", "1", "--rounds", "1000",
              script=os.path.join(ROOT, "benchmarks", "two_ranks.py"))
    deadline = time.monotonic() + 60
    while (server := run.forkserver()) is None or len(run.processes(parent=server)) < 2:  # its 2 workers, forked
        assert time.monotonic() < deadline and run.proc.poll() is None, run.processes()
        time.sleep(0.05)
    time.sleep(1)
    if how.startswith("SIGINT"):
        os.killpg(run.proc.pid, signal.SIGINT)
    else:
        assert {name[:3] for name in os.listdir(run.tmp)} == {"tmp", "pym"}  # its folder, and the forkserver's
        os.kill(run.proc.pid, signal.SIGKILL)
    returncode, out, err, seconds = run.finish(STOPS_WITHIN_S)  # asserts no process is left
    if how.startswith("SIGINT"):
        assert returncode == 130 and seconds < STOPS_WITHIN_S
        assert_one_line(err, "error: interrupted (SIGINT); every rank stopped, temporary files removed")
    else:
        assert returncode == -signal.SIGKILL
    assert os.listdir(run.tmp) == []


# Every command that ends through muon_tools (exit_code, or run_under_torchrun under torchrun): found by its text.
COMMANDS = sorted(os.path.relpath(path, ROOT) for folder in ("", "examples", "benchmarks", "tools")
                  for path in glob.glob(os.path.join(ROOT, folder, "*.py"))
                  if os.path.basename(path) != "muon_tools.py" and "__name__ == \"__main__\"" in open(path).read()
                  and any(call in open(path).read() for call in ("exit_code(", "run_under_torchrun(", "benchmark_main(",
                                                                 "muon_tools.main()", "main_under_torchrun(")))
# The commands that start no rank of their own (cost_model.py's --check-here aside: its default is a prediction):
# every other one starts its ranks' forkserver in its first lines, before its own import of torch.
NO_RANKS = {"benchmarks/batching.py", "benchmarks/cost_model.py", "benchmarks/cpu_vs_gpu_newton_schulz.py",
            "benchmarks/heap_stress.py", "benchmarks/newton_schulz_gflops.py", "benchmarks/ns_coefficients.py",
            "benchmarks/overlap.py", "benchmarks/peers_1gpu.py", "benchmarks/refresh.py", "benchmarks/torch_step.py",
            "tools/figures.py", "tools/gpu_twin.py", "tools/make_notebook.py"}
# Runs a command as `python COMMAND` would, until it first imports torch; prints whether its forkserver runs then
# (and stops it), and exits 0 if SIGINT is blocked then, 1 if not, 2 if it never imports torch. An audit hook sees
# the import before it begins: no torch is loaded.
BLOCKED_AT_TORCH = """
import multiprocessing.forkserver, os, runpy, signal, sys
def hook(event, args):
    if event == "import" and args[0] == "torch":
        blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        print("forkserver:", multiprocessing.forkserver._forkserver._forkserver_pid is not None, file=sys.stderr)
        if "muon_forkserver" in sys.modules:
            sys.modules["muon_forkserver"].stop_forkserver()  # not left to finish its import of torch: seconds
        os._exit(0 if blocked else 1)
sys.addaudithook(hook)
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(sys.argv[0])
runpy.run_path(sys.argv[0], run_name="__main__")
os._exit(2)
"""


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_blocks_ctrl_c_and_starts_its_forkserver_before_it_imports_torch(command):
    """What makes test_ctrl_c_while_torch_imports_is_one_line_and_130 true of every command, checked in a fraction of
    a second each: SIGINT is blocked when torch's import begins (muon_tools.exit_code takes it once torch is in).
    And a command that starts ranks has started their forkserver by then (the two imports of torch run at once)."""
    proc = subprocess.run([sys.executable, "-c", BLOCKED_AT_TORCH, os.path.join(ROOT, command)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr == f"forkserver: {command not in NO_RANKS}\n"


def kernels_of(tmp):
    """The pids of the Jupyter kernels whose connection file lies under `tmp` (a kernel runs in a session of its own:
    not in a Run's)."""
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"ipykernel_launcher" in argv and any(a.startswith(os.fsencode(tmp)) for a in argv):
            found.append(int(cmdline.split("/")[2]))
    return found


def test_ctrl_c_while_make_notebook_runs_a_notebook_is_one_line_and_130_and_leaves_no_kernel(tmp_path):
    """tools/make_notebook.py, interrupted while its kernel runs the cells (jupyter_client starts the kernel in a
    session of its own, which a terminal's Ctrl-C does not reach; it had gone on running cells, 51 lines printed):
    exit 130, one line, and nothing left: no kernel, no process, no temporary file (the kernel's connection file is in
    TMPDIR), no notebook written. It runs a copy of the files it reads and writes (its root is its own folder's
    parent), so that the checkout's notebooks stay as they are, whatever happens here."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_notebook

    copy = tmp_path / "checkout"
    notebooks = {name: open(os.path.join(ROOT, name), "rb").read() for name in make_notebook.NOTEBOOKS}
    for name in {n for pair, code in make_notebook.NOTEBOOKS.values() for n in (pair, *code)} | set(notebooks) | {
            *make_notebook.NEEDED, os.path.join("tools", "make_notebook.py")}:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes(open(os.path.join(ROOT, name), "rb").read())
    run = Run(tmp_path, str(copy / "tools" / "make_notebook.py"), "--all", script=None)
    deadline = time.monotonic() + 120
    while not kernels_of(run.tmp):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.proc.communicate()
        time.sleep(0.1)
    kernel = kernels_of(run.tmp)[0]
    time.sleep(2)  # into the cells
    os.killpg(run.proc.pid, signal.SIGINT)
    returncode, out, err, seconds = run.finish(STOPS_WITHIN_S)  # asserts no process of its session is left
    assert returncode == 130 and seconds < STOPS_WITHIN_S and out == ""
    assert_one_line(err, "error: interrupted (SIGINT)")
    assert not os.path.exists(f"/proc/{kernel}") or kernels_of(run.tmp) == []
    assert os.listdir(run.tmp) == []
    assert {name: (copy / name).read_bytes() for name in notebooks} == notebooks
