"""Make distributed_muon.py, the lesson's GPU twin, from distributed_muon_cpu.py and the hunks below.

    python tools/gpu_twin.py          # write distributed_muon.py, and the diff into notes/06-gpus.md
    python tools/gpu_twin.py --check  # exit 1 if the committed distributed_muon.py is not what this makes
    diff distributed_muon_cpu.py distributed_muon.py   # what changes on GPUs, and only that

The twin is never edited by hand: change the lesson, or a hunk here, then run this. Each hunk is a
stretch of the lesson, found exactly once, and what it becomes on GPUs: the backend, the device and
set_device, torchrun's environment instead of our launcher, a synchronization before reading the
clock. Everything else, the algorithm and the run, is the lesson's text, line for line.
tests/test_gpu_sibling.py checks that the committed twin is what this makes and that the diff stays
within MAX_DIFF_LINES.
"""

import difflib
import os
import subprocess
import sys

if __name__ == "__main__":  # first, before torch loads (muon_tools imports it): a Ctrl-C waits for the runner
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import muon_tools  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LESSON = os.path.join(ROOT, "distributed_muon_cpu.py")
TWIN = os.path.join(ROOT, "distributed_muon.py")
CHAPTER = os.path.join(ROOT, "notes", "06-gpus.md")  # shows the diff itself, in its one ```diff block
MAX_DIFF_LINES = 40  # lines of `diff distributed_muon_cpu.py distributed_muon.py` that start with < or >

# (the lesson's text, the twin's): each a whole stretch of lines.
HUNKS = [
    ('''"""Distributed Muon, ZeRO-1 x tensor parallel, on 8 CPU processes over Gloo.
''', '''"""Distributed Muon, ZeRO-1 x tensor parallel, on GPUs over NCCL: one process per GPU, started by torchrun.
(Made from distributed_muon_cpu.py by tools/gpu_twin.py, never by hand: diff the two to see what GPUs change.)
'''),
    ('''Launch recipes
--------------
    python distributed_muon_cpu.py                      # 8 ranks, DP=4 x TP=2, 3 steps
    python distributed_muon_cpu.py --dp 2 --tp 4 --explain   # print the virtual buffer map too
    python distributed_muon_cpu.py --dp 8 --tp 1 --steps 5 --json run.json
    python distributed_muon_cpu.py --help               # every flag, the other strategies' and options' too
''', '''Launch recipes (DP = processes / TP unless --dp says otherwise)
--------------
    torchrun --standalone --nproc-per-node 8 distributed_muon.py --tp 2       # 8 GPUs, DP=4 x TP=2
    torchrun --standalone --nproc-per-node 8 distributed_muon.py --tp 2 --strategy owner --explain
    torchrun --standalone --nproc-per-node 4 distributed_muon.py --backend gloo --device cpu --tp 2  # no GPU
    python distributed_muon.py --help                   # every flag, the other strategies' and options' too
'''),
    ('''    device = torch.device("cpu")  # every tensor in this process's memory
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))  # over TCP
''', '''    # One GPU per process, cuda:LOCAL_RANK (torchrun sets it), set once. Rank 0 runs torch's reference on its
    # GPU too: tensor cores round bf16 matmuls otherwise than a CPU, so bit-identity holds device against device.
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NCCL runs the collectives on the GPUs themselves (NVLink, InfiniBand); device_id binds it to this GPU.
    dist.init_process_group(cfg.backend, timeout=datetime.timedelta(seconds=cfg.timeout_s),
                            device_id=device if device.type == "cuda" else None)
'''),
    ('''        opt.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
''', '''        opt.step()
        if device.type == "cuda":  # kernels and NCCL return before they finish: wait, then read the clock
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t0) * 1e3)
'''),
    ('''if __name__ == "__main__":  # a command: the runner checks the flags, starts DP x TP ranks that run section 6, reports
''', '''if __name__ == "__main__":  # torchrun started this process, one of DP x TP: the runner checks the flags, runs run_rank
'''),
    ('''    raise SystemExit(muon_tools.main())
''', '''    raise SystemExit(muon_tools.main_under_torchrun("distributed_muon"))  # this file's run_rank, the GPUs' lesson
'''),
]


def make_twin(lesson_text):
    """The twin's text: the lesson's, each hunk's lesson stretch (found exactly once) replaced."""
    for cpu, gpu in HUNKS:
        if lesson_text.count(cpu) != 1:
            raise ValueError(f"a hunk's lesson text is found {lesson_text.count(cpu)} times, not once: "
                             f"{cpu.splitlines()[0]!r}")
        lesson_text = lesson_text.replace(cpu, gpu)
    return lesson_text


def diff_lines(a, b):
    """The lines `diff a b` prints that start with < or >: lines of one side only."""
    return [line for line in difflib.ndiff(a.splitlines(), b.splitlines()) if line[:2] in ("- ", "+ ")]


def diff_text(lesson_path, twin_path):
    """What `diff lesson twin` prints (the `diff` command of the card; difflib would print it otherwise)."""
    return subprocess.run(["diff", lesson_path, twin_path], capture_output=True, text=True).stdout


def with_diff(chapter, diff):
    """The chapter's text with its ```diff block replaced by `diff`."""
    start = chapter.index("```diff\n") + len("```diff\n")
    return chapter[:start] + diff + chapter[chapter.index("```", start):]


# What this reads: the twin it writes may be none of them (--twin distributed_muon_cpu.py would replace the lesson).
INPUTS = {"the lesson": LESSON, "the chapter that shows the diff": CHAPTER,
          "this tool": os.path.abspath(__file__)}


def check_twin(path, check):
    """--twin, before anything is read or written (ValueError, one line): with --check a file to read; else a
    file this can write that is none of its inputs."""
    if check:
        if not os.path.isfile(path):
            raise ValueError(f"--twin {path}: no such file to check")
    else:
        muon_tools.check_writable(path, "--twin", inputs=INPUTS)


def main(argv=None):
    parser = muon_tools.OneLineParser(description="Make distributed_muon.py from distributed_muon_cpu.py.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed twin differs")
    parser.add_argument("--twin", default=TWIN, help="the twin's path (default %(default)s)")
    args = parser.parse_args(argv)
    return muon_tools.exit_code(lambda: make_or_check(args))


def make_or_check(args):
    check_twin(args.twin, args.check)
    with open(LESSON) as f:
        twin = make_twin(f.read())
    if args.check:
        with open(args.twin) as f:
            same = f.read() == twin
        with open(CHAPTER) as f:
            chapter = f.read()
        shown = chapter == with_diff(chapter, diff_text(LESSON, args.twin))
        name = os.path.basename(args.twin)
        print(f"{name} is what tools/gpu_twin.py makes" if same else
              f"{name} differs from what tools/gpu_twin.py makes: edit the lesson or a hunk, then run "
              f"python tools/gpu_twin.py")
        if not shown:
            print("notes/06-gpus.md shows another diff than today's: run python tools/gpu_twin.py")
        return 0 if same and shown else 1
    with open(LESSON) as f:
        changed = len(diff_lines(f.read(), twin))
    with open(CHAPTER) as f:
        chapter = f.read()
    # each file whole or not at all (an interrupted write leaves the one before); the chapter's diff is the
    # lesson's against the twin as written
    muon_tools.write_atomically(args.twin, lambda f: f.write(twin.encode()))
    chapter = with_diff(chapter, diff_text(LESSON, args.twin))
    muon_tools.write_atomically(CHAPTER, lambda f: f.write(chapter.encode()))
    print(f"wrote {os.path.relpath(args.twin)} ({changed} lines differ from distributed_muon_cpu.py) and its diff into "
          f"notes/06-gpus.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
