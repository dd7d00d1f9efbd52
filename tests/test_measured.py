"""notes/measured/: each file names the command and the commit that made it (its row in INDEX.md; the header of
each text file benchmarks/refresh.sh writes), and refresh.sh --quick runs as a smoke test into a temporary
folder, leaving notes/measured/ as it was."""

import hashlib
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import refresh  # noqa: E402

MEASURED = refresh.MEASURED


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def full_commit(short):
    return git("rev-parse", "--verify", short.removesuffix("+dirty") + "^{commit}")


def assert_header(path, commands, made):
    """A text file refresh.sh wrote: its commands, one `$` line each, then `# commit <made>, ...`."""
    with open(path) as f:
        head = [f.readline().rstrip("\n") for _ in range(len(commands) + 1)]
    assert head[:-1] == [f"$ {c}" for c in commands], (path, head)
    assert head[-1].startswith(f"# commit {made}, ") and head[-1].endswith(", benchmarks/refresh.sh"), head


def commands_of(cell):
    return [c.strip().strip("`") for c in cell.split(" ; ")]


def test_every_file_names_its_command_and_commit():
    rows = refresh.read_index(os.path.join(MEASURED, refresh.INDEX))
    assert set(rows) == set(os.listdir(MEASURED)) - {refresh.INDEX}  # every file has a row; no row outlives its file
    for name, (command, made, how) in rows.items():
        assert command.strip(), name
        commit = full_commit(made)  # a commit of this repository
        if how == refresh.BEFORE:  # honest history: the commit that last changed the file
            assert commit == git("log", "-1", "--format=%H", "--", os.path.join(MEASURED, name)), name
        else:  # refresh.sh's (never --quick's) or on_gpu.sh's: the text file's header says the same
            assert how.startswith("refresh.sh, ") or how == refresh.RECORDED, (name, how)
            text = name.rsplit(".", 1)[0] + ".txt"
            assert rows[text][:2] == (command, made), name  # a .json or .png: its text file's command and commit
            assert refresh.header_of(os.path.join(MEASURED, text)) == (commands_of(command), made), name
            if how != refresh.RECORDED:
                assert_header(os.path.join(MEASURED, text), commands_of(command), made)


def test_files_made_elsewhere_are_recorded_from_their_headers(tmp_path):
    """on_gpu.sh's files (it calls refresh.py --record): a text file's header, and a .json beside it, become
    rows; a file without a header is refused, and then no row of that call is written."""
    (tmp_path / "x_h100.txt").write_text("$ python a.py --json x_h100.json\n# commit 1234567+dirty, 2026-11-25\nout\n")
    (tmp_path / "x_h100.json").write_text("{}")
    (tmp_path / "bare.txt").write_text("no header\n")
    refresh.record([str(tmp_path / "x_h100.txt"), str(tmp_path / "x_h100.json")])
    row = ("`python a.py --json x_h100.json`", "1234567+dirty", refresh.RECORDED)
    assert refresh.read_index(str(tmp_path / refresh.INDEX)) == {"x_h100.txt": row, "x_h100.json": row}
    (tmp_path / "y_h100.txt").write_text("$ python b.py\n# commit 89abcde, 2026-11-26\nout\n")
    with pytest.raises(ValueError, match="bare.txt does not begin with"):
        refresh.record([str(tmp_path / "y_h100.txt"), str(tmp_path / "bare.txt")])
    assert refresh.read_index(str(tmp_path / refresh.INDEX)) == {"x_h100.txt": row, "x_h100.json": row}  # none


def test_every_part_writes_files_the_index_knows():
    rows = refresh.read_index(os.path.join(MEASURED, refresh.INDEX))
    for part in refresh.PARTS:
        assert {part.text, *part.data} <= set(rows), part.name
        assert all(f"{{out}}/{name}" in " ".join(part.commands) for name in part.data), part.name


def digest(folder):
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()


def test_quick_refresh_writes_headers_and_an_index_into_its_own_folder(tmp_path):
    before = digest(MEASURED)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "refresh.sh"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert digest(MEASURED) == before
    head = git("rev-parse", "--short", "HEAD")
    made = {p.name: p for p in refresh.PARTS if p.quick}
    skipped = [p.name for p in refresh.PARTS if not p.quick]
    assert made and skipped
    rows = refresh.read_index(str(tmp_path / refresh.INDEX))
    assert set(rows) == {name for p in made.values() for name in (p.text, *p.data)}
    assert set(os.listdir(tmp_path)) == set(rows) | {refresh.INDEX}
    for p in made.values():
        command, commit, how = rows[p.text]
        assert commit.removesuffix("+dirty") == head and how.startswith("refresh.sh --quick, ")
        assert commands_of(command) == [refresh.shown(c, str(tmp_path)) for c in p.quick]
        assert_header(tmp_path / p.text, commands_of(command), commit)
        assert all(rows[name][:2] == (command, commit) and (tmp_path / name).stat().st_size > 0 for name in p.data)
    lines = proc.stdout.splitlines()
    for name in skipped:  # said so
        assert any(line.split()[:1] == [name] and "skipped: no tiny sizes (--quick)" in line for line in lines), name
    assert any(line.startswith("Not made here: the GPU's files") for line in lines)


def test_the_suite_can_run_as_without_bf16_units():
    """timings.md's seventh round ran the suite with tools/without_bf16_units on its path: every interpreter started
    so has torch's oneDNN off (where bf16 matmuls are fast), and only those."""
    probe = [sys.executable, "-c", "import torch; print(torch.backends.mkldnn.enabled)"]
    hooked = subprocess.run(probe, capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tools", "without_bf16_units")))
    plain = subprocess.run(probe, capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert (hooked.stdout, plain.stdout) == ("False\n", "True\n"), (hooked.stderr[-2000:], plain.stderr[-2000:])
