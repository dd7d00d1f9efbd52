"""distributed_muon.py, the NCCL/GPU sibling: the lesson's twin (made by tools/gpu_twin.py, never by hand), run
on CPUs under torchrun (Gloo, 4 ranks)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SCRIPT, SUITE_D_MODEL
import muon_tools

SIBLING = os.path.join(ROOT, "distributed_muon.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_twin  # noqa: E402


# One strategy (the one with the most collectives): the algorithm is the CPU script's, tested there for
# every strategy; what this checks is the torchrun launcher around it.
@pytest.mark.parametrize("strategy", ["comm-free"])
def test_under_torchrun_on_cpu_matches_torch_and_the_cpu_script(tmp_path, run_grid, strategy):
    path = tmp_path / "run.json"
    proc = torchrun(tmp_path, "--dp", "2", "--tp", "2", "--strategy", strategy, "--d-model", str(SUITE_D_MODEL),
                    "--json", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(path.read_text())
    assert results["passed"] and all(c["identical"] for c in results["checks"])
    assert results["launcher"] == dict(backend="gloo", device="cpu", gpu=None)
    assert "4 CPU ranks over Gloo, DP=2 x TP=2" in proc.stdout
    # The same algorithm as the CPU script's own launcher: the same bytes, FLOPs and layout.
    assert results["config"]["d_model"] == SUITE_D_MODEL
    spawned = run_grid(2, 2, steps=results["config"]["steps"], strategy=strategy)
    assert results["bytes_per_step"] == spawned["bytes_per_step"]
    assert results["ns_flops"] == spawned["ns_flops"]
    assert results["buckets"] == json.loads(json.dumps(spawned["buckets"]))  # tuples became lists
    assert results["owners"] == spawned["owners"] and results["state_bytes"] == spawned["state_bytes"]


def torchrun(tmp_path, *argv, timeout=180):
    """The sibling on 4 Gloo CPU ranks under torchrun, whose own log folders go to tmp_path."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           SIBLING, "--backend", "gloo", "--device", "cpu", *argv],
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, TMPDIR=str(tmp_path)))


def test_an_error_on_any_rank_is_reported_by_that_rank(tmp_path):
    proc = torchrun(tmp_path, "--dp", "2", "--tp", "2", "--fail-rank", "3")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "error: rank 3 failed: RuntimeError: injected failure on rank 3 at step 1 (--fail-rank)" in errors
    assert "Result:" not in proc.stdout


# One torchrun process's whole life, in a world of one Gloo rank: body registers an atexit handler, which runs
# only if the interpreter shuts down; then the joined rank ends (finish's code 3) or its body fails (1).
ONE_RANK = """
import atexit, sys
import muon_tools

def body(cfg, rank, device):
    atexit.register(print, "interpreter shut down")
    if sys.argv[1] == "fail":
        raise RuntimeError("body failed")
    return rank

def finish(cfg, gathered, device, seconds):
    print(f"finish saw {gathered}")
    return 3

sys.exit(muon_tools.run_under_torchrun("gloo", "cpu", lambda world: muon_tools.RunConfig(dp=1, tp=1), body, finish))
"""


def test_a_joined_rank_ends_without_interpreter_shutdown():
    """A torchrun rank exits after destroy_process_group without Python's interpreter shutdown: Gloo worker
    threads outlive destroy_process_group (DTensor's caches hold the mesh's groups), and one that frees its last
    work's tensors while the interpreter shuts down aborts the rank ("terminate called without an active
    exception", exit -6; seen on ranks 1-3 of the DTensor demo under load). Whether that race is lost depends on
    the scheduler; that the shutdown never runs does not, so it is what this checks, on both ways out."""
    procs = {how: subprocess.Popen([sys.executable, "-c", ONE_RANK, how], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(muon_tools.free_port())))
             for how in ("finish", "fail")}
    (out, err), code = procs["finish"].communicate(timeout=120), procs["finish"].returncode
    assert (code, out) == (3, "finish saw [0]\n"), err
    (out, err), code = procs["fail"].communicate(timeout=120), procs["fail"].returncode
    assert (code, out) == (1, ""), err
    assert "error: rank 0 failed: RuntimeError: body failed\n" in err


def test_help_shows_what_the_sibling_accepts_with_real_defaults():
    proc = subprocess.run([sys.executable, SIBLING, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "--compare" not in proc.stdout and "None" not in proc.stdout
    help_text = " ".join(proc.stdout.split())
    assert "--dp DP data-parallel size (default: processes / TP)" in help_text
    assert "--backend {nccl,gloo} (default nccl)" in help_text and "--timeout SECONDS" in help_text


def test_outside_torchrun_says_how_to_launch():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, SIBLING], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: RANK, WORLD_SIZE, LOCAL_RANK not set: launch with torchrun "
                                   "--standalone --nproc-per-node N distributed_muon.py")


def test_the_twin_is_the_lesson_with_its_gpu_hunks_and_nothing_else():
    """The committed twin is what tools/gpu_twin.py makes from the lesson, and `diff distributed_muon_cpu.py
    distributed_muon.py` is short: every line it shows is one of the declared hunks'."""
    with open(SCRIPT) as f:
        lesson = f.read()
    with open(SIBLING) as f:
        twin = f.read()
    assert twin == gpu_twin.make_twin(lesson), "distributed_muon.py was edited by hand: run python tools/gpu_twin.py"
    changed = gpu_twin.diff_lines(lesson, twin)
    assert 0 < len(changed) <= gpu_twin.MAX_DIFF_LINES
    declared = {line for cpu, gpu in gpu_twin.HUNKS for line in cpu.splitlines() + gpu.splitlines()}
    assert {line[2:] for line in changed} <= declared
    diff = gpu_twin.diff_text(SCRIPT, SIBLING)  # the card's own command
    assert sum(line[:1] in "<>" for line in diff.splitlines() if line) == len(changed)
    for cpu, gpu in gpu_twin.HUNKS[2:]:  # code hunks (after the docstring's two): each says why, in a comment
        assert "#" in gpu
    for document in ("README.md", os.path.join("notes", "06-gpus.md")):  # the count they state is today's
        with open(os.path.join(ROOT, document)) as f:
            assert f"{len(changed)} lines" in f.read(), document


def test_chapter_6_shows_todays_diff():
    with open(gpu_twin.CHAPTER) as f:
        chapter = f.read()
    assert chapter == gpu_twin.with_diff(chapter, gpu_twin.diff_text(SCRIPT, SIBLING)), "run python tools/gpu_twin.py"


def test_the_twin_check_fails_on_a_hand_edit(tmp_path):
    edited = tmp_path / "distributed_muon.py"
    with open(SIBLING) as f:
        edited.write_text(f.read().replace("torch.cuda.synchronize()", "pass"))
    assert gpu_twin.main(["--check", "--twin", SIBLING]) == 0
    assert gpu_twin.main(["--check", "--twin", str(edited)]) == 1
    with pytest.raises(ValueError, match="found 0 times, not once"):  # a lesson edit that breaks a hunk is caught
        gpu_twin.make_twin(gpu_twin.make_twin(open(SCRIPT).read()))


def test_under_torchrun_a_rank_without_its_gpu_says_so_itself(monkeypatch, capsys):
    """The launch checks every torchrun entry point shares (run_under_torchrun): an error that is the same on
    every rank is printed by rank 0 alone (the refusal tests of each entry point); a rank whose own GPU is
    missing prints its own line, and does not join."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a machine with 2 GPUs, 4 ranks started on it
    monkeypatch.setattr(muon_tools.torchrun, "join_world", lambda *a: pytest.fail("joined the world"))
    for name, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3").items():
        monkeypatch.setenv(name, value)
    assert muon_tools.run_under_torchrun("nccl", "cuda", lambda world: muon_tools.RunConfig(dp=4, tp=1), None,
                                         None) == 2
    assert capsys.readouterr().err == ("error: rank 3: no CUDA device for LOCAL_RANK 3 here (2 GPUs): use "
                                       "--backend gloo --device cpu\n")
