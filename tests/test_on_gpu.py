"""benchmarks/on_gpu.sh on a machine without a GPU: --cpu-only skips the CUDA parts and says so, the CPU
part writes its figures with their command on top, part 5 (benchmarks/peers_1gpu.py) runs its tiny form on the
CPU, and the scripts of the CUDA parts run on the CPU. Part 5's peers (dion, torchtitan's DistMuon) run where
$PEERS_PYTHON has them (PEERS_PYTHON=/work/peers-venv/bin/python pytest tests/test_on_gpu.py), and are refused in
one line each where it has not (the suite's Python, the default)."""

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import distributed_muon_cpu  # noqa: E402
import muon_tools  # noqa: E402
import peers  # noqa: E402
import peers_torchtitan  # noqa: E402

ON_GPU = os.path.join(ROOT, "benchmarks", "on_gpu.sh")


def run(*flags):
    return subprocess.run(["bash", ON_GPU, *flags], capture_output=True, text=True, timeout=300, cwd=ROOT)


def installed_in(python):
    """{distribution: peers.installed's version, or None} for part 5's peers, as the Python `python` sees them."""
    code = ("import json, peers; print(json.dumps({p.distribution: peers.installed(p) for p in peers.PEERS "
            "if p.distribution in ('dion', 'torchtitan')}))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks")]))
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


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
    # part 5's tiny form, on the CPU: torch.optim.Muon, DTensorMuon (bit for bit) and dion, or "not installed"
    assert re.search(r"^5\. torch, ours, dion, DistMuon, 1 device +ok +\d+ s +ours: DTensorMuon ", summary, re.M)
    assert "Part 5 ran its tiny form on the CPU (--cpu-only)." in summary
    check_peers_1gpu((tmp_path / "peers_1gpu_cpu.txt").read_text().splitlines())


def check_peers_1gpu(lines):
    """benchmarks/peers_1gpu.py's output as part 5 writes it: its command and commit on top, its rows' ratios to
    torch's step, DTensorMuon bit for bit, dion's rows and DistMuon's (bit for bit, each against its reference, with
    the CPU's patches), or one line each saying why not, and Newton-Schulz's rates adding up."""
    assert lines[0].endswith("benchmarks/peers_1gpu.py --device cpu --d 32 --layers 1 --rounds 1"), lines[0]
    assert lines[1].startswith("# commit ") and lines[-1] == "exit status 0"
    head = next(line for line in lines if line.startswith("this CPU, 1 thread, torch "))
    assert "1 layers at d = 32 (Muon's matrices only: 4," in head
    rows = {line[:m.start()].strip(): m.groups() for line in lines
            if (m := re.search(r"  +([0-9.]+)  +([0-9.]+)  +([0-9.]+)  +(.+?) *$", line))
            and line.startswith(("torch.optim.Muon ", "ours: ", "dion ", "torchtitan "))}
    torch_ms = float(rows["torch.optim.Muon"][0])
    assert rows["torch.optim.Muon"][3] == "(the reference)" and rows["ours: DTensorMuon"][3] == "bit-identical"
    for median, least, ratio, _ in rows.values():  # medians printed to 0.1 ms: the ratio within that rounding
        assert 0 < float(least) <= float(median)
        assert float(ratio) == pytest.approx(float(median) / torch_ms, abs=0.01 + 0.06 * float(median) / torch_ms)
    versions = installed_in(os.environ.get("PEERS_PYTHON") or sys.executable)  # the Python part 5 ran
    for distribution, version in versions.items():
        peer_rows = [p for p in peers.PEERS if p.distribution == distribution and p.algorithm != "normuon"]
        status = [line for line in lines if line.startswith(f"  {distribution}: ")]
        if version is None:
            assert status == [f"  {distribution}: {peers.NOT_INSTALLED} ({peer_rows[0].note})"], status
            assert not any(r.startswith(f"{distribution} ") for r in rows)
            continue
        assert sorted(r for r in rows if r.startswith(f"{distribution} ")) == sorted(
            p.label.format(v=version) for p in peer_rows)
        assert len(status) == 1 and "failed" not in status[0], status
    if versions["torchtitan"] is not None:  # both layouts bit for bit, the CPU's three patches named
        for p in peers.PEERS:
            if p.distribution == "torchtitan":
                assert rows[p.label.format(v=versions["torchtitan"])][3] == "bit-identical"
        status = next(line for line in lines if line.startswith("  torchtitan: "))
        assert status.count("; ") == 2 and "entered without its __init__.py" in status
        assert "_validate_parameter_storage" in status and "Stream: the device keyword dropped" in status
        assert (f"  the per-head rows against {peers.REFERENCES[peers_torchtitan.PER_HEAD][0]} ({peers_torchtitan.head_dim(32)} rows)"
                in lines)
    ns = [line.split() for line in lines if re.match(r"^ *\d+ x \d+  ", line)]
    assert [(int(r[0]), int(r[2])) for r in ns] == [(96, 32), (32, 32), (128, 32), (32, 128)]
    assert all(r[3] == "1" for r in ns)
    assumed = importlib.import_module("peers_1gpu").ASSUMED_TFLOPS  # the cost model's H100 rate
    for rows_, _, cols, _, ms, tflops, share in ns:  # each to 3 significant digits
        rate = distributed_muon_cpu.newton_schulz_flops((int(rows_), int(cols)), distributed_muon_cpu.NS_STEPS) / float(ms) / 1e9
        assert float(tflops) == pytest.approx(rate, rel=0.01)
        assert float(share) == pytest.approx(float(tflops) / assumed, rel=0.01)
    total = next(line for line in lines if line.startswith("All 4 matrices: "))
    measured = float(re.search(r", ([0-9.]+) ms at the measured rates", total)[1])
    assert measured == pytest.approx(sum(float(r[4]) for r in ns), rel=0.01)


def test_distmuon_on_a_gpu_is_patched_only_where_its_package_is_entered(monkeypatch):
    """Part 5 on a GPU runs DistMuon as shipped (its CUDA check, CUDA's stream) but for entering torchtitan.distributed
    without its __init__.py; on the CPU the check and the stream are patched too. On stand-in modules (the suite's
    Python has no torchtitan), whose attributes show what each device's patch replaced."""
    def modules():
        check, runtime_torch = object(), object()
        fake = {peers_torchtitan.FLEX_SHARD: types.ModuleType(peers_torchtitan.FLEX_SHARD),
                f"{peers_torchtitan.FLEX_SHARD}.dist_muon": types.SimpleNamespace(
                    DistMuon=type("DistMuon", (), dict(_validate_parameter_storage=check))),
                f"{peers_torchtitan.FLEX_SHARD}._optimizer_reshard_runtime": types.SimpleNamespace(
                    torch=runtime_torch, __name__=f"{peers_torchtitan.FLEX_SHARD}._optimizer_reshard_runtime"),
                "torchtitan.distributed": types.ModuleType("torchtitan.distributed")}
        for name, module in fake.items():
            monkeypatch.setitem(sys.modules, name, module)
        return fake, check, runtime_torch

    fake, check, runtime_torch = modules()
    dist_muon, runtime = fake[f"{peers_torchtitan.FLEX_SHARD}.dist_muon"], fake[f"{peers_torchtitan.FLEX_SHARD}._optimizer_reshard_runtime"]
    lines = peers_torchtitan.patch("cuda")
    assert len(lines) == 1 and lines[0].startswith("torchtitan.distributed: entered without its __init__.py")
    assert dist_muon.DistMuon._validate_parameter_storage is check and runtime.torch is runtime_torch
    lines = peers_torchtitan.patch("cpu")
    assert len(lines) == 3 and lines[0].startswith("torchtitan.distributed: entered without its __init__.py")
    assert dist_muon.DistMuon._validate_parameter_storage is peers_torchtitan.storage_on_one_device
    assert isinstance(runtime.torch, peers_torchtitan.CpuStreamKeywords)


def test_refuses_bad_options_and_a_missing_gpu(tmp_path):
    proc = run("--frobnicate")
    assert proc.returncode == 2 and proc.stderr == (
        "error: on_gpu.sh: unknown option --frobnicate (--cpu-only, --quick, --out DIR, --name NAME)\n")
    proc = run("--cpu-only", "--out", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "is not a folder" in proc.stderr
    if not torch.cuda.is_available():
        proc = run("--out", str(tmp_path))
        assert proc.returncode == 2 and "no CUDA GPU here" in proc.stderr and "--cpu-only" in proc.stderr


def test_the_cuda_parts_own_scripts_run_on_the_cpu(tmp_path, capsys):
    """Parts 1b and 2 (benchmarks/torch_step.py, newton_schulz_gflops.py) cannot run on a GPU here: run on this
    CPU (--device cpu, tiny sizes), in this process, their figures must add up, and without a GPU the default
    device is refused in one line."""
    ns_gflops = importlib.import_module("newton_schulz_gflops")
    torch_step = importlib.import_module("torch_step")
    assert ns_gflops.main(["--device", "cpu", "--repeats", "2", "96x32", "32x96"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("this CPU, 1 thread, torch ") and lines[0].endswith("median of 2 after one warm-up")
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[3:]}
    assert list(rows) == ["96x32", "32x96"]
    ns_flops, mm_flops = distributed_muon_cpu.newton_schulz_flops((96, 32)), 2 * 32 * 32 * 96  # X @ X.T of the wide (32, 96)
    for ns_ms, ns_rate, mm_ms, mm_rate, ratio in rows.values():  # ms printed to 3 decimals: 10 % covers it
        assert ns_ms > 0 and mm_ms > 0
        assert ns_rate == pytest.approx(ns_flops / ns_ms / 1e6, rel=0.1, abs=1)
        assert mm_rate == pytest.approx(mm_flops / mm_ms / 1e6, rel=0.1, abs=1)
        assert ratio == pytest.approx(ns_flops / ns_ms / (mm_flops / mm_ms), rel=0.1)

    cfg = muon_tools.RunConfig(dp=2, tp=1, steps=2, model="thin", ns_coefficients="polar_express")
    step_ms = []  # what torch_step.py times is the run's own reference, its options included, bit for bit
    timed, _ = muon_tools.torch_reference_steps(tuple(muon_tools.demo_specs(cfg)), cfg, "cpu", step_ms)
    reference = muon_tools.reference_params(muon_tools.demo_specs(cfg), cfg)
    assert len(step_ms) == 2 and all(t > 0 for t in step_ms)
    assert timed.keys() == reference.keys() and all(torch.equal(timed[n], reference[n]) for n in reference)
    run = tmp_path / "run.json"
    run.write_text(json.dumps(dict(config=dataclasses.asdict(cfg), timings=dict(step_ms_median=30.0), passed=True)))
    assert torch_step.main(["--device", "cpu", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    m = re.fullmatch(r"torch.optim.Muon \+ AdamW on this CPU, 1 thread, same model and 2 steps: "
                     r"median step ([0-9.]+) ms \(min ([0-9.]+)\)", out[0])
    assert m and 0 < float(m[2]) <= float(m[1]), out
    theirs = float(m[1])
    r = re.fullmatch(r"run / torch step time: ([0-9.]+) \(30\.0 against ([0-9.]+) ms\); "
                     r"bit-identical to torch \(the run passed\): True", out[1])
    assert r and float(r[2]) == theirs, out
    # the ratio is of the unrounded median, printed to 0.1 ms: it lies between the bounds that rounding allows
    assert 30.0 / (theirs + 0.05) - 0.005 <= float(r[1]) <= 30.0 / (theirs - 0.05) + 0.005, out
    if not torch.cuda.is_available():
        for script, args in ((ns_gflops, ["8x8"]), (torch_step, [str(run)])):
            with pytest.raises(ValueError, match=r"^no CUDA GPU here .*; --device cpu runs on this CPU$"):
                script.main(args)
