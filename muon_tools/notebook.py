"""The notebooks' helpers: their setup, running a command, showing a function's source, and running a function
of the lesson on thread ranks."""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import os
import subprocess
import sys
import threading
from dataclasses import replace

import torch
import torch.distributed as dist

from distributed_muon_cpu import plan_grid
from muon_tools.settings import TIMEOUT_S


# The notebooks' helpers.
def notebook_requirements():
    """The notebooks' setup: install requirements.txt when this torch has no torch.optim.Muon (the
    reference, torch >= 2.9) or matplotlib is missing. A torch already imported stays loaded until
    the kernel restarts, so a new one asks for a restart."""
    if hasattr(torch.optim, "Muon") and importlib.util.find_spec("matplotlib") is not None:
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", "requirements.txt"], check=True)
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Muon (torch >= 2.9): a newer torch was "
                           "installed from requirements.txt; restart the kernel and run the notebook again.")


def run_program(program, *args):
    """The notebooks' way to run a script of this repository: with this interpreter, its output printed
    as it comes; CalledProcessError if it fails. (Ranks spawned from a notebook's kernel would re-import
    its __main__, which a notebook does not have, so a run is a process of its own.)"""
    cmd = [sys.executable, "-u", program, *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="")
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def show_source(*objects):
    """Print each function's, method's or class's source as its file has it, under the file's name and the
    lines: what a notebook runs next is the script's own code, not a copy."""
    for obj in objects:
        lines, first = inspect.getsourcelines(obj)
        print(f"# {os.path.basename(inspect.getsourcefile(obj))}, lines {first}-{first + len(lines) - 1}")
        print("".join(lines))


def on_thread_ranks(dp, tp, fn, timeout_s=TIMEOUT_S):
    """[fn(grid) for every rank of a DP x TP world, in rank order], each rank a thread of this process and
    each axis of its grid a real Gloo process group, made from one in-memory store (no torch.distributed
    world is joined): how a notebook runs a function of the lesson that every rank calls at once, the
    gather flow among them. The first error of any rank is raised."""
    store, results, errors = dist.HashStore(), [None] * (dp * tp), []

    def rank(r):
        try:
            plan = plan_grid(dp, tp, r)
            group = {a.name: dist.ProcessGroupGloo(dist.PrefixStore(f"{a.name} {a.ranks}", store), a.rank, a.size,
                                                   datetime.timedelta(seconds=timeout_s))
                     for a in (plan.dp, plan.tp, plan.world)}
            results[r] = fn(replace(plan, dp=replace(plan.dp, group=group["DP"]),
                                    tp=replace(plan.tp, group=group["TP"]),
                                    world=replace(plan.world, group=group["world"])))
        except Exception as e:  # noqa: BLE001  (raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank {r}") for r in range(dp * tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
