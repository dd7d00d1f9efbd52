"""Make the two notebooks from their pairs, executed: distributed_muon_cpu.ipynb (the read-along) from
distributed_muon_cpu.nb.py, distributed_muon_runs.ipynb (the runs) from distributed_muon_runs.nb.py.

    python tools/make_notebook.py              # every notebook whose saved outputs are not today's code's
    python tools/make_notebook.py --all        # both, whatever their outputs
    python tools/make_notebook.py --check      # exit 1 if a notebook's saved outputs come from other code

Both notebooks are committed with their outputs, so that a reader who opens one (in Colab, on GitHub) sees
what each cell printed and drew. Those outputs came from some version of the code: this writes a hash of
the cells' sources and of every file the notebook runs into the notebook's metadata, and
tests/test_notebook.py fails when the hash no longer matches: edit the lesson, an example or a cell, then
run this. It executes each notebook as the README runs it, headless, in a temporary folder holding only
those files (what a clone has that the notebook needs), so nothing else can slip in. On this project's
2-core machine the read-along takes about a minute (the 8-process run of section 6), the runs about three
(every grid of 8 ranks, compare.py, two trainings).
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile

import jupytext
import nbformat
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = tuple(sorted(os.path.relpath(os.path.join(folder, name), ROOT)
                      for folder, _, names in os.walk(os.path.join(ROOT, "distmuon")) for name in names
                      if name.endswith(".py")))  # the library: the lesson's sections 7 and 8, its checks, DTensorMuon
LESSON = ("distributed_muon_cpu.py", "muon_forkserver.py", "muon_tools.py", os.path.join("tools", "figures.py")) + LIBRARY
# {notebook: (its pair, what its cells import and run)}. The read-along runs the lesson, the library (its sections
# 7 and 8, the checks), the runner and the figures; the runs notebook runs commands too: compare.py and the trainings.
NOTEBOOKS = {
    "distributed_muon_cpu.ipynb": ("distributed_muon_cpu.nb.py", LESSON),
    "distributed_muon_runs.ipynb": ("distributed_muon_runs.nb.py", LESSON + (
        os.path.join("benchmarks", "compare.py"), "dtensor_demo.py",
        os.path.join("examples", "gpt.py"), os.path.join("examples", "stdlib_text.py"),
        os.path.join("examples", "train_gpt.py"), os.path.join("examples", "train_gpt_dtensor.py"),
        os.path.join("examples", "gpt_moe.py"), os.path.join("examples", "train_gpt_moe.py"))),
}
NEEDED = ("requirements.txt",)  # what the setup cells read (mt.notebook_requirements), beside the code
KEY = "distributed_muon"  # the notebook metadata this writes: {"made_by": ..., "sources_sha256": ...}
TIMEOUT_S = 900  # one cell's limit: the longest, the GPT's --verify or the 8-process run, takes ~1 minute here


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


def execute(notebook, folder):
    """The notebook's cells from its pair, run top to bottom in `folder`, which gets a copy of what they need;
    returns the executed notebook (not written anywhere)."""
    pair, code = NOTEBOOKS[notebook]
    for name in code + NEEDED:
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), os.path.join(folder, name))
    nb = jupytext.read(os.path.join(ROOT, pair))
    # The folder first on every path, the kernel's and the commands' it starts: the checkout's own copies (which
    # requirements.txt's editable install puts on the path too) never stand in for a file the folder lacks.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = folder + (os.pathsep + path if path else "")
    try:
        ExecutePreprocessor(timeout=TIMEOUT_S, kernel_name="python3").preprocess(nb, {"metadata": {"path": folder}})
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path
    return nb


def make(notebook):
    with tempfile.TemporaryDirectory(prefix="distributed-muon-notebook-") as folder:
        nb = execute(notebook, folder)
    nb.metadata[KEY] = dict(made_by="python tools/make_notebook.py", sources_sha256=sources_sha256(nb, NOTEBOOKS[notebook][1]))
    nbformat.write(nb, os.path.join(ROOT, notebook))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Execute the notebooks' pairs into the committed notebooks.")
    parser.add_argument("--check", action="store_true", help="exit 1 if a notebook's saved outputs are not today's code's")
    parser.add_argument("--all", action="store_true", help="make both notebooks, whatever their saved outputs")
    args = parser.parse_args(argv)
    stale = {name: check(name) for name in NOTEBOOKS}
    if args.check:
        for name, problem in stale.items():
            print(problem or f"{name}'s outputs come from today's cells and code")
        return 1 if any(stale.values()) else 0
    for name in NOTEBOOKS:
        if args.all or stale[name]:
            make(name)
            print(f"wrote {name}, executed")
        else:
            print(f"{name}: its outputs come from today's cells and code already")
    return 0


if __name__ == "__main__":
    sys.exit(main())
