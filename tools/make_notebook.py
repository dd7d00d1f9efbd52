"""Make distributed_muon_cpu.ipynb, the read-along notebook, from its pair distributed_muon_cpu.nb.py, executed.

    python tools/make_notebook.py          # the cells from the .nb.py, run top to bottom, outputs saved
    python tools/make_notebook.py --check  # exit 1 if the saved outputs come from other code than today's

The notebook is committed with its outputs, so that a reader who opens it (in Colab, on GitHub) sees
what each cell printed and drew. Those outputs came from some version of the code: this writes a hash
of the cells' sources and of every file the notebook imports into the notebook's metadata, and
tests/test_notebook.py fails when the hash no longer matches: edit the lesson, or a cell, then run this
(about a minute here: the 8-process run of section 6 is the longest cell).
"""

import argparse
import hashlib
import json
import os
import sys

import jupytext
import nbformat
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(ROOT, "distributed_muon_cpu.nb.py")
NOTEBOOK = os.path.join(ROOT, "distributed_muon_cpu.ipynb")
# What the cells import and run: the lesson, its sections 7 and 8, the checks and the tooling.
CODE = ("distributed_muon_cpu.py", "muon_checks.py", "muon_owners.py", "muon_large_runs.py", "muon_tools.py")
KEY = "distributed_muon"  # the notebook metadata this writes: {"made_by": ..., "sources_sha256": ...}
TIMEOUT_S = 900  # one cell's limit: the 8-process run takes ~30 s on 2 busy cores


def sources_sha256(nb):
    """sha256 of the cells (type and source, in order) and of every file in CODE, as they are now."""
    digest = hashlib.sha256(json.dumps([(c.cell_type, c.source) for c in nb.cells]).encode())
    for name in CODE:
        with open(os.path.join(ROOT, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def check(path=NOTEBOOK):
    """None if the notebook at `path` holds outputs made from today's cells and code, else why not."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    if not all(c.get("outputs") for c in code):
        return f"{sum(not c.get('outputs') for c in code)} of {len(code)} code cells have no output"
    if any(o.get("output_type") == "error" for c in code for o in c.outputs):
        return "a cell's saved output is an error"
    if nb.metadata.get(KEY, {}).get("sources_sha256") != sources_sha256(nb):
        return "the saved outputs come from other cells or other code than today's: run python tools/make_notebook.py"
    return None


def make():
    nb = jupytext.read(PAIR)
    ExecutePreprocessor(timeout=TIMEOUT_S, kernel_name="python3").preprocess(nb, {"metadata": {"path": ROOT}})
    nb.metadata[KEY] = dict(made_by="python tools/make_notebook.py", sources_sha256=sources_sha256(nb))
    nbformat.write(nb, NOTEBOOK)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Execute distributed_muon_cpu.nb.py into distributed_muon_cpu.ipynb.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the saved outputs are not today's code's")
    args = parser.parse_args(argv)
    if args.check:
        problem = check()
        print(problem or "distributed_muon_cpu.ipynb's outputs come from today's cells and code")
        return 1 if problem else 0
    make()
    print("wrote distributed_muon_cpu.ipynb, executed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
