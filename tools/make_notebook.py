"""Make the two notebooks from their pairs, executed: distributed_muon_cpu.ipynb (the read-along) from
distributed_muon_cpu.nb.py, distributed_muon_runs.ipynb (the runs) from distributed_muon_runs.nb.py.

    python tools/make_notebook.py              # every notebook whose saved outputs are not today's code's
    python tools/make_notebook.py --all        # both, whatever their outputs
    python tools/make_notebook.py --check      # exit 1 if a notebook's saved outputs come from other code (--check
                                               # --all is refused: --check makes nothing)

Both notebooks are committed with their outputs, so that a reader who opens one (in Colab, on GitHub) sees
what each cell printed and drew. Those outputs came from some version of the code: this writes a hash of
the cells' sources and of every file the notebook runs into the notebook's metadata, and
tests/test_notebook.py fails when the hash no longer matches: edit the lesson, an example or a cell, then
run this. It executes each notebook as the README runs it, headless, in a temporary folder holding only
those files (what a clone has that the notebook needs), so nothing else can slip in. On this project's
2-core machine the read-along takes about a minute (the 8-process run of section 6), the runs about three
(every grid of 8 ranks, compare.py, two trainings).

Ctrl-C (or SIGTERM) at any moment ends it as every command of the project ends (muon_tools.exit_code: one line,
exit 130 or 143): the kernel, which runs in a session of its own (jupyter_client starts it so) where a terminal's
Ctrl-C does not reach it, is interrupted, and a command a cell runs with it (stop_kernel); then the kernel is
stopped and its connection file removed, the temporary folder too, and no notebook is written (each is written
whole, or not at all).
"""

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

if __name__ == "__main__":  # first, before torch loads (muon_tools imports it): a Ctrl-C waits for the runner
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import nbformat  # noqa: E402

import muon_tools  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_files(package):
    """The .py files of a package folder, sorted, relative to the repository."""
    return tuple(sorted(os.path.relpath(os.path.join(folder, name), ROOT)
                        for folder, _, names in os.walk(os.path.join(ROOT, package)) for name in names
                        if name.endswith(".py")))


LIBRARY = python_files("distmuon")  # the library: the lesson's sections 7 and 8, its checks, DTensorMuon
LESSON = ("distributed_muon_cpu.py", "muon_forkserver.py", os.path.join("tools", "figures.py")) + python_files(
    "muon_tools") + LIBRARY
# {notebook: (its pair, what its cells import and run)}. The read-along runs the lesson, the library (its sections
# 7 and 8, the checks), the runner and the figures; the runs notebook runs commands too: compare.py and the trainings.
NOTEBOOKS = {
    "distributed_muon_cpu.ipynb": ("distributed_muon_cpu.nb.py", LESSON),
    "distributed_muon_runs.ipynb": ("distributed_muon_runs.nb.py", LESSON + (
        os.path.join("benchmarks", "compare.py"), "dtensor_demo.py", "dtensor_run.py", "dtensor_verify.py",
        "dtensor_accounting.py", "collective_counter.py",
        os.path.join("examples", "gpt_verify.py"), os.path.join("examples", "gpt_hyperparameters.py"),
        os.path.join("examples", "gpt.py"), os.path.join("examples", "stdlib_text.py"),
        os.path.join("examples", "train_gpt.py"), os.path.join("examples", "train_gpt_dtensor.py"),
        os.path.join("examples", "gpt_moe.py"), os.path.join("examples", "train_gpt_moe.py"))),
}
NEEDED = ("requirements.txt",)  # what the setup cells read (muon_tools.notebook_requirements), beside the code
KEY = "distributed_muon"  # the notebook metadata this writes: {"made_by": ..., "sources_sha256": ...}
TIMEOUT_S = 900  # one cell's limit: the longest, the GPT's --verify or the 8-process run, takes ~1 minute here
# After Ctrl-C, how long the kernel's process group gets to end by itself (a command a cell runs stops its ranks and
# removes its temporary files: within seconds, tests/test_interrupts.py) before it is killed.
STOP_S = 10


def sources_sha256(nb, code):
    """sha256 of the cells (type and source, in order) and of every file in `code`, as they are now."""
    digest = hashlib.sha256(json.dumps([(c.cell_type, c.source) for c in nb.cells]).encode())
    for name in code:
        with open(os.path.join(ROOT, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def check(notebook, path=None):
    """None if the notebook (its saved copy at `path`, by default the repository's) holds outputs made from
    today's cells and code, else why not."""
    nb = nbformat.read(path or os.path.join(ROOT, notebook), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    if not all(c.get("outputs") for c in code):
        return f"{notebook}: {sum(not c.get('outputs') for c in code)} of {len(code)} code cells have no output"
    if any(o.get("output_type") == "error" for c in code for o in c.outputs):
        return f"{notebook}: a cell's saved output is an error"
    if nb.metadata.get(KEY, {}).get("sources_sha256") != sources_sha256(nb, NOTEBOOKS[notebook][1]):
        return (f"{notebook}: the saved outputs come from other cells or other code than today's: "
                "run python tools/make_notebook.py")
    return None


def executor():
    """nbconvert's ExecutePreprocessor, its kernel's own output discarded: its log ('Kernel is running over TCP
    without encryption', 'Parent appears to have exited') would reach the terminal; the cells' output, their
    errors included, is in the notebook, and a failing cell or a dead kernel raises here."""
    from jupyter_core.utils import run_sync
    from nbconvert.preprocessors import ExecutePreprocessor

    class Executor(ExecutePreprocessor):
        async def async_start_new_kernel(self, **kwargs):
            await super().async_start_new_kernel(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)

        start_new_kernel = run_sync(async_start_new_kernel)

    return Executor(timeout=TIMEOUT_S, kernel_name="python3")


def group_members(pgid):
    """The live processes of a process group (Linux's /proc)."""
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state, parent, process group, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(pid))
    return members


def stop_kernel(ep):
    """After Ctrl-C or SIGTERM, in this process's main thread while the kernel runs a cell in another: SIGINT to the
    kernel's process group (its own session): the kernel interrupts the cell, and a command the cell runs ends as on
    any Ctrl-C, its ranks stopped and its temporary files removed; once only the kernel is left, or after STOP_S,
    SIGKILL to the group; then the kernel's connection file is removed. A kernel not started yet has nothing to
    stop (one that starts after this ends by itself once this process is gone: ipykernel polls its parent)."""
    ep.log.disabled = True  # the notebook's thread meets the dead kernel: nothing to say (exit_code says why)
    km = getattr(ep, "km", None)
    process = getattr(getattr(km, "provisioner", None), "process", None)
    if process is None:
        return
    pgid = process.pid  # jupyter_client starts the kernel in a session of its own: its group is its pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGINT)
        deadline = time.monotonic() + STOP_S
        while set(group_members(pgid)) - {pgid} and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        process.wait()
    with contextlib.suppress(OSError, TypeError):
        os.remove(km.connection_file)


def execute(notebook, folder):
    """The notebook's cells from its pair, run top to bottom in `folder`, which gets a copy of what they need;
    returns the executed notebook (not written anywhere). The cells run in a thread of their own, nbclient's
    (which then adds no signal handler of its own: an interrupted notebook's kernel went on running cells), while
    this thread waits, to stop the kernel on Ctrl-C or SIGTERM (stop_kernel)."""
    import jupytext  # its import runs pandoc: here, after the command line is checked

    pair, code = NOTEBOOKS[notebook]
    for name in code + NEEDED:
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), os.path.join(folder, name))
    nb = jupytext.read(os.path.join(ROOT, pair))
    ep = executor()
    outcome = {}

    def run():
        try:
            ep.preprocess(nb, {"metadata": {"path": folder}})
        except BaseException as e:  # raised again in the main thread
            outcome["error"] = e

    # The folder first on every path, the kernel's and the commands' it starts: the checkout's own copies (which
    # requirements.txt's editable install puts on the path too) never stand in for a file the folder lacks.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = folder + (os.pathsep + path if path else "")
    cells = threading.Thread(target=run, daemon=True, name="notebook")
    try:
        cells.start()
        while cells.is_alive():
            cells.join(0.1)
    except BaseException:
        stop_kernel(ep)
        raise
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path
    if "error" in outcome:
        raise outcome["error"]
    return nb


def make(notebook):
    with tempfile.TemporaryDirectory(prefix="distributed-muon-notebook-") as folder:
        nb = execute(notebook, folder)
    nb.metadata[KEY] = dict(made_by="python tools/make_notebook.py", sources_sha256=sources_sha256(nb, NOTEBOOKS[notebook][1]))
    muon_tools.write_atomically(os.path.join(ROOT, notebook), lambda f: f.write(nbformat.writes(nb).encode()))


def build_parser():
    p = muon_tools.OneLineParser(description="Execute the notebooks' pairs into the committed notebooks.")
    p.add_argument("--check", action="store_true", help="exit 1 if a notebook's saved outputs are not today's code's")
    p.add_argument("--all", action="store_true", help="make both notebooks, whatever their saved outputs")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

    def work():
        if args.check and args.all:
            raise ValueError("--check makes no notebook: --all (make both) would be ignored")
        stale = {name: check(name) for name in NOTEBOOKS}
        if args.check:
            for name, problem in stale.items():
                print(problem or f"{name}'s outputs come from today's cells and code")
            return 1 if any(stale.values()) else 0
        for name in NOTEBOOKS:
            if args.all or stale[name]:
                make(name)
                print(f"wrote {name}, executed", flush=True)
            else:
                print(f"{name}: its outputs come from today's cells and code already", flush=True)
        return 0

    return muon_tools.exit_code(work)


if __name__ == "__main__":
    sys.exit(main())
