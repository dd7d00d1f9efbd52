"""A long run's end: its outputs written whole or not at all (muon_tools.write_atomically, which every command's
--json, --figure and rank files go through), a closed stdout ending the command quietly, and a --resume checkpoint
checked against its own metadata (files, step, sizes) before any rank starts."""

import errno
import os
import resource
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
import muon_tools
from examples import train_gpt_dtensor  # noqa: E402

OLD = b"the results of an earlier run\n" * 2000  # 60,000 bytes


def files_in(folder):
    return sorted(os.listdir(folder))


def test_a_failed_write_leaves_the_file_there_before_as_it_was(tmp_path):
    """A write that fails half-way (the disk full) raises WriteError, one line, and changes nothing in the folder;
    one that succeeds replaces the file whole, with its permissions, through a link to it."""
    path = tmp_path / "run.json"
    path.write_bytes(OLD)
    path.chmod(0o640)

    def half_then_full(f):
        f.write(b"{\"half\": ")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(muon_tools.WriteError) as e:
        muon_tools.write_atomically(str(path), half_then_full)
    assert str(e.value) == f"{path} could not be written: No space left on device; the file there before is unchanged"
    assert path.read_bytes() == OLD and files_in(tmp_path) == ["run.json"]
    (tmp_path / "link.json").symlink_to(path)
    muon_tools.write_json(str(tmp_path / "link.json"), {"new": 1})
    assert path.read_text() == '{\n "new": 1\n}' and (path.stat().st_mode & 0o777) == 0o640
    assert (tmp_path / "link.json").is_symlink() and files_in(tmp_path) == ["link.json", "run.json"]
    new = tmp_path / "new.json"
    muon_tools.write_json(str(new), [1])
    assert new.read_text() == "[\n 1\n]" and (new.stat().st_mode & 0o777) == 0o666 & ~muon_tools.umask()
    piped = subprocess.run([sys.executable, "-c", "import muon_tools; muon_tools.write_json('/dev/stdout', [2])"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (piped.returncode, piped.stdout) == (0, "[\n 2\n]"), piped.stderr[-2000:]  # not a file: written through
    with pytest.raises(muon_tools.WriteError, match="^/dev/full could not be written: No space left on device$"):
        muon_tools.write_json("/dev/full", [3])


def limit_file_size(limit):
    """A child's preexec_fn: no file of it may grow past `limit` bytes (the kernel refuses, as a full disk would)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_figure_that_cannot_be_written_after_a_real_run_is_one_line_and_keeps_the_old_one(tmp_path):
    """benchmarks/scaling.py runs its ranks, then its --figure (a PNG of tens of kB) meets a file-size limit of
    16 kB: one line, exit 1, the file that was there byte for byte as it was, no temporary file left."""
    figure = tmp_path / "scaling.png"
    figure.write_bytes(OLD)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scaling.py"), "--ranks", "1", "--d", "32",
                           "--layers", "1", "--rounds", "1", "--figure", str(figure)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, preexec_fn=limit_file_size(16_384))
    assert (proc.returncode, proc.stderr) == (1, f"error: {figure} could not be written: File too large; the file "
                                                 f"there before is unchanged\n"), proc.stderr[-3000:]
    assert "comm-free" in proc.stdout  # the run's table was printed: the write failed after the run
    assert figure.read_bytes() == OLD and files_in(tmp_path) == ["scaling.png"]


def test_stdout_closed_by_its_reader_ends_quietly_with_141():
    """`python distributed_muon_cpu.py | head -1`: the first line read, the pipe closed while the ranks run; the
    command ends as one that SIGPIPE ended (128 + 13) and says nothing: no 'rank 0 failed', no traceback."""
    proc = subprocess.Popen([sys.executable, "distributed_muon_cpu.py", "--dp", "2", "--tp", "1", "--steps", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("Distributed Muon: 2 CPU ranks")
    proc.stdout.close()
    assert (proc.wait(timeout=300), proc.stderr.read()) == (141, "") and muon_tools.CLOSED_STDOUT == 141


def test_stdout_closed_before_the_first_line_ends_quietly_with_141():
    """`python benchmarks/refresh.py --list | true`: the launcher's own first print finds the reader gone."""
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([sys.executable, "benchmarks/refresh.py", "--list"], cwd=ROOT, stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


TRAIN = os.path.join(ROOT, "examples", "train_gpt_dtensor.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of examples/train_gpt_dtensor.py's small GPT, saved after step 2 of 3, and the flags it was
    trained with."""
    folder = str(tmp_path_factory.mktemp("ckpt") / "after2")
    flags = ["--dp", "2", "--tp", "1", "--steps", "3", "--batch", "4", "--context", "16", "--d-model", "16",
             "--layers", "1", "--heads", "2", "--val-windows", "4"]
    proc = subprocess.run([sys.executable, TRAIN, *flags, "--save", folder, "--save-step", "2"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, flags


def refusal(capsys, monkeypatch, argv):
    """(exit code, stderr) of examples/train_gpt_dtensor.py's main(argv), which must start no rank."""
    monkeypatch.setattr(train_gpt_dtensor.muon_tools, "spawn_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    code = train_gpt_dtensor.main(argv)
    return code, capsys.readouterr().err


def test_a_resume_is_checked_against_the_checkpoint_before_any_rank_starts(checkpoint, capsys, monkeypatch,
                                                                           tmp_path):
    """--resume-step against the step the checkpoint's optimizer counted, its files whole, its model's sizes: each
    one line, exit 2, before any rank; the checkpoint as it was saved passes the same checks."""
    folder, flags = checkpoint
    resume = [*flags, "--resume", folder]
    largest = max(os.listdir(folder), key=lambda n: os.path.getsize(os.path.join(folder, n)))
    size = os.path.getsize(os.path.join(folder, largest))
    cut = tmp_path / "cut"  # a copy that stopped half-way through its largest file
    cut.mkdir()
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            (cut / name).write_bytes(f.read(size // 2 if name == largest else None))
    for argv, message in [
        ([*resume, "--resume-step", "1"], f"--resume-step 1: {folder} was saved after step 2 (its optimizer's step "
                                          f"counters): resume with --resume-step 2"),
        ([*flags, "--resume", str(cut), "--resume-step", "2"],
         f"--resume {cut}: its file {largest} holds {size // 2:,} bytes, its .metadata says {size:,} at least: a "
         f"copy or a save that did not finish"),
        ([*resume, "--resume-step", "2", "--d-model", "32", "--heads", "4"],
         f"--resume {folder}: its checkpoint's wte is (256, 16), this run's (256, 32): resume with the sizes it was "
         f"saved with"),
        ([*resume, "--resume-step", "2", "--layers", "2"],
         f"--resume {folder}: its checkpoint has no blocks.1.ln1.weight: it was saved from another model"),
    ]:
        code, err = refusal(capsys, monkeypatch, argv)
        assert (code, err.count("\n"), err.startswith("error: ")) == (2, 1, True), (argv, err)
        assert message in err, err
    args = train_gpt_dtensor.build_parser().parse_args([*resume, "--resume-step", "2"])
    train_gpt_dtensor.validate(train_gpt_dtensor.config_from_args(args))  # passes


def test_a_save_that_fails_leaves_the_checkpoint_there_before_as_it_was(checkpoint, tmp_path):
    """--save over a checkpoint (saved after step 2) after step 1, its ranks' files refused past 64 kB as a full disk
    would refuse them: the run fails, and the folder holds the checkpoint it held, byte for byte, read whole; the
    same save without the limit replaces it whole, nothing left beside it."""
    folder, flags = checkpoint
    kept = tmp_path / "kept"
    shutil.copytree(folder, kept)
    before = {n: (kept / n).read_bytes() for n in os.listdir(kept)}
    assert max(len(b) for b in before.values()) > 65_536  # a rank's file is larger than the limit
    save = [sys.executable, TRAIN, *flags, "--save", str(kept), "--save-step", "1"]
    proc = subprocess.run(save, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size(65_536))
    assert proc.returncode == 1 and proc.stderr.startswith("error: rank ") and proc.stderr.count("\n") == 1, proc.stderr
    assert {n: (kept / n).read_bytes() for n in os.listdir(kept)} == before
    muon_tools.read_checkpoint(str(kept), 2)
    proc = subprocess.run(save, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    muon_tools.read_checkpoint(str(kept), 1)  # the new one, saved after step 1
    assert files_in(tmp_path) == ["kept"]
