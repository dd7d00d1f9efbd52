"""benchmarks/on_gpu.sh on a machine without a GPU: --cpu-only skips the CUDA parts and says so, the CPU
part writes its figures with their command on top, and the Python the CUDA parts run at least compiles."""

import json
import os
import re
import subprocess

import torch

from conftest import ROOT

ON_GPU = os.path.join(ROOT, "benchmarks", "on_gpu.sh")


def run(*flags):
    return subprocess.run(["bash", ON_GPU, *flags], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_cpu_only_quick_skips_cuda_parts_and_writes_the_scaling_figures(tmp_path):
    proc = run("--cpu-only", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    summary = proc.stdout[proc.stdout.index("=== Summary: "):]
    for part in ("1. sibling on 1 GPU", "2. Newton-Schulz GFLOP/s", "3. DTensor optimizer on 1 CUDA device"):
        assert re.search(rf"^{re.escape(part)}.*SKIPPED \(--cpu-only\)", summary, re.M)
    assert "CUDA parts (1-3) were SKIPPED (--cpu-only): no GPU figure was measured" in summary
    cores = os.cpu_count()
    assert re.search(rf"^4\. CPU scaling, {cores} cores +ok +\d+ s +1  comm-free ", summary, re.M)
    text = (tmp_path / f"scaling_{cores}core_cpu.txt").read_text().splitlines()
    assert text[0].startswith("$ python benchmarks/scaling.py --ranks 1 --d 32 ") and text[-1] == "exit status 0"
    assert text[1].startswith("# commit ")
    figures = json.loads((tmp_path / f"scaling_{cores}core_cpu.json").read_text())
    assert figures["d"] == 32 and list(figures["runs"]) == ["1"]
    assert (tmp_path / f"scaling_{cores}core_cpu.png").stat().st_size > 0


def test_refuses_bad_options_and_a_missing_gpu(tmp_path):
    proc = run("--frobnicate")
    assert proc.returncode == 2 and proc.stderr == (
        "error: on_gpu.sh: unknown option --frobnicate (--cpu-only, --quick, --out DIR, --name NAME)\n")
    proc = run("--cpu-only", "--out", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "is not a folder" in proc.stderr
    if not torch.cuda.is_available():
        proc = run("--out", str(tmp_path))
        assert proc.returncode == 2 and "no CUDA GPU here" in proc.stderr and "--cpu-only" in proc.stderr


def test_the_python_of_the_cuda_parts_compiles():
    """They cannot run here (no GPU); a syntax error would otherwise first show on the lent machine."""
    script = open(ON_GPU).read()
    bodies = re.findall(r"^([A-Z_]+)='\n(.*?)\n'$", script, re.M | re.S)
    assert [name for name, _ in bodies] == ["TORCH_STEP", "NS_GFLOPS"]
    for name, body in bodies:
        compile(body, name, "exec")
