"""Every figure of README.md and notes/ from its command: rewrites notes/measured/ (run by benchmarks/refresh.sh).

    bash benchmarks/refresh.sh                  # every part this machine can run (hours: each part's time in INDEX.md)
    bash benchmarks/refresh.sh --quick          # a smoke run: tiny sizes, a temporary folder
    bash benchmarks/refresh.sh --only default_4x2 gpt_default_4x2    # some parts
    bash benchmarks/refresh.sh --list           # the parts, their files and commands

A part runs its commands from the repository root, one after the other, and writes its text file
only when every command succeeded (a failed part leaves the file it had): first the commands
(`$ ...`), then `# commit <git rev-parse --short HEAD>[+dirty], <UTC time>, <cores> cores, <seconds> s,
benchmarks/refresh.sh`, then the output (each command's under its own `$` line when there are
several). The .json and .png its commands write cannot hold that header: notes/measured/INDEX.md
maps every file of the folder to the command and the commit that made it; refresh.sh rewrites the
rows of the files it makes. The commit is taken once, before the first part, so the files a run
writes do not make the next part's "+dirty".

Parts that cannot run here are skipped, and said so: the GPU's (bash benchmarks/on_gpu.sh, on a
machine with one; then `refresh.sh --record FILE ...` adds its files' rows to the index from their headers),
and the peers' (benchmarks/peers.py needs its own virtual environment: set PEERS_PYTHON to its python).
--quick runs the parts that have tiny sizes (a plumbing check, not figures) into a temporary folder (or --out DIR),
and skips the others, saying so.
"""

import dataclasses
import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import muon_tools  # noqa: E402

MEASURED = os.path.join(ROOT, "notes", "measured")
INDEX = "INDEX.md"
PART_LIMIT_S = 4 * 3600  # a part that runs longer than this has hung (several times the longest in INDEX.md)
QUICK_LIMIT_S = 60
TINY_GPT = "--steps 2 --batch 2 --context 16 --d-model 16 --layers 1 --heads 1 --val-windows 2 --log-every 1"


@dataclasses.dataclass(frozen=True)
class Part:
    """`text`: the file the commands' output goes to; `data`: the other files they write ({out}/NAME in
    the commands); `quick`: the commands of --quick (None: skipped by --quick); `needs`: an environment
    variable without which it is skipped. {out} is the output folder, {tmp} a scratch folder, {python}
    the interpreter, {peers_python} $PEERS_PYTHON."""
    text: str
    commands: tuple
    data: tuple = ()
    quick: tuple = None
    needs: str = ""
    env: tuple = ()

    @property
    def name(self):
        return self.text.rsplit(".", 1)[0]


def compare(*flags):
    return f"{{python}} benchmarks/compare.py {' '.join(flags)}".rstrip()


def train_gpt(flags):
    return f"{{python}} examples/train_gpt.py {flags}".rstrip()


VERIFY_SETTINGS = ("--dp 2 --tp 2 --lr 0.1 --steps 8 --verify",
                   "--dp 1 --tp 2 --lr 0.1 --strategy gather --steps 8 --verify",
                   "--dp 1 --tp 2 --optimizer adamw --lr 0.03 --seed 1 --steps 8 --verify",
                   "--dp 2 --tp 2 --optimizer adamw --lr 0.01 --seed 2 --steps 8 --verify",
                   "--dp 4 --tp 1 --steps 8 --verify",
                   "--dp 1 --tp 4 --lr 0.1 --steps 8 --verify",
                   "--dp 1 --tp 4 --optimizer adamw --lr 0.03 --seed 1 --steps 8 --verify",
                   "--dp 2 --tp 4 --optimizer adamw --lr 0.01 --seed 2 --steps 8 --verify")
NS_SHAPES = ("{python} -c \"import time, statistics, torch, distributed_muon_cpu as dm; torch.set_num_threads(1); "
             "[print(f'{r}x{c}: {statistics.median([(lambda t: (dm.newton_schulz(m), time.perf_counter() - t)[1])"
             "(time.perf_counter()) for _ in range(5)]) * 1e3:.1f} ms, {dm.newton_schulz_flops((r, c)) / 1e6:.1f} "
             "MFLOP') for r, c in [(512, 128), (128, 512), (384, 128), (128, 128)] for m in [torch.randn(r, c)]]\"")
SWEEP = "--json {out}/gpt_lr_sweep_2core.json --figure {out}/gpt_lr_sweep_2core.png"
# NorMuon beside Muon (and AdamW's target): grids around the five-seed sweep's bests, three seeds
NORMUON_SWEEP = ("--normuon-lrs 0.01 0.02 0.03 0.05 --muon-lrs 0.01 0.02 0.03 0.05 --adamw-lrs 0.001 0.0014 0.002 "
                 "--seeds 0 1 2 --json {out}/gpt_normuon_sweep_2core.json --figure {out}/gpt_normuon_sweep_2core.png")

# In the order of the notes' chapters; the cheap ones first within each. The files named for the machine that
# made them (*_nobf16.txt: a CPU without bf16 matrix units; h100*: the GPU machine) are not rewritten here.
PARTS = (
    Part("default_4x2.txt", ("{python} distributed_muon_cpu.py",),
         quick=("{python} distributed_muon_cpu.py --dp 2 --tp 1 --steps 1",)),
    Part("explain_3x2.txt", ("{python} distributed_muon_cpu.py --dp 3 --tp 2 --explain",)),
    Part("sweep_2core.txt", ("{python} benchmarks/sweep.py",)),
    Part("compare_4x2.txt", (compare(),)),
    Part("compare_4x2_8layers.txt", (compare("--layers", "8", "--steps", "5"),)),
    Part("compare_8x1_8layers.txt", (compare("--dp", "8", "--tp", "1", "--layers", "8", "--steps", "5"),)),
    Part("compare_lopsided_4x2.txt", (compare("--model", "lopsided", "--steps", "5"),)),
    Part("gloo_collectives_2core.txt", ("{python} benchmarks/gloo_collectives.py",)),
    Part("gloo_collectives_2rank_2core.txt", ("{python} benchmarks/gloo_collectives.py --ranks 2",)),
    Part("batching_2core.txt", ("{python} benchmarks/batching.py",)),
    Part("ns_shapes_2core.txt", (NS_SHAPES,), quick=(NS_SHAPES,)),  # seconds as it is
    Part("overlap_2rank_2core.txt", ("{python} benchmarks/overlap.py",)),
    Part("scaling_2core.txt", ("{python} benchmarks/scaling.py --json {out}/scaling_2core.json "
                               "--figure {out}/scaling_2core.png",), data=("scaling_2core.json", "scaling_2core.png"),
         quick=("{python} benchmarks/scaling.py --ranks 1 --d 32 --layers 1 --rounds 1 --json {out}/scaling_2core.json "
                "--figure {out}/scaling_2core.png",)),
    Part("scaling_d128_2core.txt",
         ("{python} benchmarks/scaling.py --d 128 --rounds 9 --json {out}/scaling_d128_2core.json"
                                    " --figure {out}/scaling_d128_2core.png",),
         data=("scaling_d128_2core.json", "scaling_d128_2core.png")),
    Part("scaling_without_ns_d768_2core.txt", ("{python} benchmarks/scaling.py --without-ns --ranks 1 2 --rounds 15 "
                                               "--json {out}/scaling_without_ns_d768_2core.json",),
         data=("scaling_without_ns_d768_2core.json",)),
    Part("peers_2core.txt", ("{peers_python} benchmarks/peers.py --rounds 7 --ranks 1 2 4",), needs="PEERS_PYTHON"),
    # the same on a CPU without bf16 units, where d = 768 would take hours (its first line says which CPU it ran on)
    Part("peers_d128_2core.txt", ("{peers_python} benchmarks/peers.py --ranks 1 2 4 --d 128 --rounds 7",),
         needs="PEERS_PYTHON"),
    # everything but Newton-Schulz (each contender's replaced by its bf16 cast), at d = 768 on any CPU
    Part("peers_without_ns_2core.txt", ("{peers_python} benchmarks/peers.py --ranks 1 2 4 --without-ns --rounds 7",),
         needs="PEERS_PYTHON"),
    # DTensorMuon beside the two peers practitioners compare it with, microsoft/dion and torchtitan's DistMuon (its
    # per-head and by-layers rows beside DistMuon's layouts), at d = 768 and 128, with and without Newton-Schulz
    Part("peers_dion_torchtitan_2core.txt",
         ("{peers_python} benchmarks/peers.py --peers dion torchtitan --ranks 1 2 4 --rounds 7",), needs="PEERS_PYTHON"),
    Part("peers_dion_torchtitan_without_ns_2core.txt",
         ("{peers_python} benchmarks/peers.py --peers dion torchtitan --ranks 1 2 4 --rounds 7 --without-ns",),
         needs="PEERS_PYTHON"),
    Part("peers_dion_torchtitan_d128_2core.txt",
         ("{peers_python} benchmarks/peers.py --peers dion torchtitan --ranks 1 2 4 --rounds 7 --d 128",
          "{peers_python} benchmarks/peers.py --peers dion torchtitan --ranks 1 2 4 --rounds 7 --d 128 --without-ns"),
         needs="PEERS_PYTHON"),
    Part("gpt_default_4x2.txt", (train_gpt(""),), quick=(train_gpt(f"--dp 1 --tp 1 {TINY_GPT}"),)),
    Part("gpt_verify_2x2.txt", (train_gpt(VERIFY_SETTINGS[0]),)),
    Part("gpt_verify_settings.txt", tuple(train_gpt(s) for s in VERIFY_SETTINGS),
         quick=(train_gpt(f"--dp 2 --tp 1 {TINY_GPT} --verify"),)),
    Part("gpt_splits_2core.txt", ("{python} benchmarks/gpt_splits.py --json {out}/gpt_splits_2core.json "
                                  "--figure {out}/gpt_splits_2core.png",),
         data=("gpt_splits_2core.json", "gpt_splits_2core.png")),
    Part("gpt_step_4x2_2core.txt", ("{python} benchmarks/gpt_step.py --json {out}/gpt_step_4x2_2core.json "
                                    "--figure {out}/gpt_step_4x2_2core.png",),
         data=("gpt_step_4x2_2core.json", "gpt_step_4x2_2core.png")),
    Part("gpt_lr_sweep_2core.txt", (f"{{python}} benchmarks/gpt_lr_sweep.py {SWEEP}",),
         data=("gpt_lr_sweep_2core.json", "gpt_lr_sweep_2core.png")),
    Part("gpt_normuon_sweep_2core.txt", (f"{{python}} benchmarks/gpt_lr_sweep.py {NORMUON_SWEEP}",),
         data=("gpt_normuon_sweep_2core.json", "gpt_normuon_sweep_2core.png")),
    Part("dtensor_default_4x2.txt", ("{python} dtensor_demo.py",)),
    Part("dtensor_batched_4x2.txt", ("{python} dtensor_demo.py --batched-ns",)),
    Part("dtensor_compare_4x2.txt", ("{python} dtensor_demo.py --compare",)),
    Part("dtensor_torchrun_2x2_gloo.txt", ("{python} -m torch.distributed.run --standalone --nproc-per-node 4 "
                                           "dtensor_demo.py --dp 2 --tp 2 --backend gloo --device cpu",),
         env=(("OMP_NUM_THREADS", "1"),)),  # set, torchrun prints no banner about it
    Part("dtensor_training_4x2.txt", ("{python} dtensor_demo.py --train",)),
    Part("dtensor_train_gpt_4x2.txt", ("{python} examples/train_gpt_dtensor.py --verify",
                                       "{python} examples/train_gpt_dtensor.py --verify --steps 8 --lr 0.1",
                                       "{python} examples/train_gpt_dtensor.py")),
    Part("dtensor_train_gpt_resume.txt", (
        train_gpt("--steps 40 --log-every 10"),
        "{python} examples/train_gpt_dtensor.py --dp 2 --tp 2 --save {tmp}/gptckpt --save-step 20",
        "{python} examples/train_gpt_dtensor.py --dp 4 --tp 1 --resume {tmp}/gptckpt --resume-step 20",
        "{python} examples/train_gpt_dtensor.py --dp 1 --tp 4 --resume {tmp}/gptckpt --resume-step 20")),
    # Chapter 9: the large runs' options
    Part("large_runs_gram_4x2.txt", ("{python} distributed_muon_cpu.py --tp-newton-schulz gram",)),
    Part("large_runs_options_4x2.txt", ("{python} distributed_muon_cpu.py --ns-coefficients polar_express "
                                        "--ns-blocks blocks --qk-clip 100",)),
    Part("ns_coefficients_gpt_2core.txt", ("{python} benchmarks/ns_coefficients.py --steps 8",)),
    Part("gpt_qk_clip_4x2.txt", (train_gpt("--qk-clip 5"),)),
    Part("tp_newton_schulz_bytes.txt", (compare("--tp-newton-schulz-bytes"),)),
    Part("gpt_tp_newton_schulz_4x2.txt", (train_gpt("--strategy gather --steps 40"),
                                          train_gpt("--strategy gather --steps 40 --tp-newton-schulz gram"))),
    Part("gpt_large_options_verify_2x2.txt",
         (train_gpt("--dp 2 --tp 2 --lr 0.1 --steps 8 --qk-clip 1 --ns-blocks heads "
                                                        "--ns-coefficients polar_express --verify"),)),
    # Chapter 12: the cost model, its tables at cluster scale and its times against this machine's
    Part("cost_model_h100.txt", ("{python} benchmarks/cost_model.py --chapter --json {out}/cost_model_h100.json "
                                 "--figure {out}/cost_model_h100.png",),
         data=("cost_model_h100.json", "cost_model_h100.png")),
    Part("cost_model_check_2core.txt", ("{python} benchmarks/cost_model.py --check-here",)),
    # Chapter 13: the MoE GPT's three --optimizer values, each at its best lr over seeds
    Part("moe_optimizers_2core.txt", ("{python} benchmarks/moe_optimizers.py --json {out}/moe_optimizers_2core.json "
                                      "--figure {out}/moe_optimizers_2core.png",),
         data=("moe_optimizers_2core.json", "moe_optimizers_2core.png")),
)
NOT_HERE = ("the GPU's files (h100_*; sibling_*, ns_gflops_* and the rest of benchmarks/on_gpu.sh's): "
            "bash benchmarks/on_gpu.sh on a machine with a GPU")


def commit():
    """git rev-parse --short HEAD, with "+dirty" when the tree has changes (untracked files too)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def fill(command, **values):
    """The command with {python}, {out}, ... replaced (only those: a command may hold Python's own braces)."""
    for key, value in values.items():
        command = command.replace("{" + key + "}", value)
    return command


def shown(command, out_dir=MEASURED):
    """A command as the files and the index show it: python, not this interpreter's path; the output folder
    relative to the repository when it is inside it."""
    inside = os.path.commonpath([ROOT, out_dir]) == ROOT
    return fill(command, python="python", peers_python="$PEERS_PYTHON",
                out=os.path.relpath(out_dir, ROOT) if inside else out_dir)


def run_command(command, limit_s, env):
    """(exit status or "timed out", output) of one shell command, in its own process group: a timeout,
    Ctrl-C or SIGTERM stops all of it (ranks included) before this returns or raises."""
    proc = subprocess.Popen(command, shell=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return f"timed out after {limit_s} s", out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_part(part, commands, out_dir, made_by, limit_s):
    """Run the part's commands; write its text file with the header on success. (status, seconds)."""
    python = shlex.quote(sys.executable)
    env = dict(os.environ, **dict(part.env))
    t0 = time.monotonic()
    outputs = []
    with tempfile.TemporaryDirectory(prefix="refresh-") as scratch:
        for command in commands:
            line = fill(command, python=python, peers_python=os.environ.get(part.needs, ""), out=out_dir, tmp=scratch)
            status, out = run_command(line, limit_s, env)
            outputs.append(out)
            if status != 0:
                return f"FAILED: `{shown(command, out_dir)}` exit {status}: {' | '.join(out.strip().splitlines()[-2:])}", \
                    time.monotonic() - t0
    seconds = time.monotonic() - t0
    lines = [f"$ {shown(c, out_dir)}" for c in commands]
    lines.append(f"# commit {made_by}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
                 f"{os.cpu_count()} cores, {seconds:.0f} s, benchmarks/refresh.sh")
    if len(commands) == 1:
        body = outputs[0]
    else:
        body = "".join(f"\n$ {shown(c, out_dir)}\n{out}" for c, out in zip(commands, outputs))
    muon_tools.write_atomically(os.path.join(out_dir, part.text),
                                lambda f: f.write(("\n".join(lines) + "\n" + body).encode()))
    return "ok", seconds


# notes/measured/INDEX.md: one row per file, `| file | command | commit | how |`.
INDEX_HEADER = """# notes/measured: the command and the commit that made each file

`bash benchmarks/refresh.sh` rewrites every file it can make on the machine at hand, and the rows of those
files here ("refresh.sh"): its text files begin with the same command(s) and commit. Rows "before
refresh.sh existed" are files made before it: the commit is the last one that changed the file (git log),
not necessarily the code that ran it, and the command is the one the file or the notes state (in
brackets: where); their figures are as measured then. `+dirty`: the tree had uncommitted changes.

| file | command | commit | how |
|---|---|---|---|
"""
BEFORE = "before refresh.sh existed (git log: the last commit that changed the file)"
RECORDED = "recorded from its header (refresh.sh --record)"
HEADER_COMMIT = re.compile(r"# commit ([0-9a-f]{7,40}(?:\+dirty)?)[, ]")
ROW = re.compile(r"^\| `([^`]+)` \| (.*) \| `([0-9a-f]{7,40}(?:\+dirty)?)` \| (.*) \|$")


def read_index(path):
    """{file: (command, commit, how)} of an INDEX.md."""
    if not os.path.exists(path):
        return {}
    rows = {}
    with open(path) as f:
        for line in f:
            m = ROW.match(line.rstrip("\n"))
            if m:
                rows[m[1]] = (m[2], m[3], m[4])
    return rows


def write_index(path, rows):
    text = INDEX_HEADER + "".join(f"| `{name}` | {command} | `{made}` | {how} |\n"
                                  for name, (command, made, how) in sorted(rows.items()))
    muon_tools.write_atomically(path, lambda f: f.write(text.encode()))


def header_of(path):
    """(commands, commit) of a text file that begins with `$ command` lines and then `# commit <commit>, ...`
    (refresh.sh's and on_gpu.sh's files); None for another."""
    commands = []
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("$ "):
                commands.append(line[2:].rstrip("\n"))
                continue
            m = HEADER_COMMIT.match(line)
            return (commands, m[1]) if m and commands else None
    return None


def record(paths):
    """--record: the INDEX.md rows of files another command wrote with a header (benchmarks/on_gpu.sh's),
    a .json or .png taking its .txt's; ValueError for a file without one, before any row is written."""
    rows_of = {}  # INDEX.md -> {name: row}
    for path in paths:
        folder, name = os.path.split(os.path.abspath(path))
        text = os.path.join(folder, name.rsplit(".", 1)[0] + ".txt")
        header = header_of(text) if os.path.exists(text) else None
        if header is None:
            raise ValueError(f"--record {path}: {os.path.basename(text)} does not begin with `$ command` lines "
                             f"and `# commit ...`")
        rows_of.setdefault(os.path.join(folder, INDEX), {})[name] = (
            " ; ".join(f"`{c}`" for c in header[0]), header[1], RECORDED)
    for index, new in rows_of.items():
        write_index(index, {**read_index(index), **new})
        for name, (command, made, _) in sorted(new.items()):
            print(f"{index}: {name} made by {command} at {made}")


def command_cell(commands, out_dir=MEASURED):
    return " ; ".join(f"`{shown(c, out_dir)}`" for c in commands)


def build_parser():
    p = muon_tools.OneLineParser(description="Rewrite notes/measured/ from the commands that make its files.")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes of the parts that have them, into a temporary folder (a smoke run)")
    p.add_argument("--out", metavar="DIR", help="the folder to write (default notes/measured, or a new temporary "
                                                "folder with --quick)")
    p.add_argument("--only", nargs="+", metavar="PART", help="run these parts only (names as --list prints them)")
    p.add_argument("--list", action="store_true", help="print the parts, their files and commands, and exit")
    p.add_argument("--record", nargs="+", metavar="FILE",
                   help="add the INDEX.md rows of files made elsewhere with a header (on_gpu.sh's), and exit")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    names = [p.name for p in PARTS]
    unknown = [n for n in args.only or () if n not in names]
    if unknown:
        print(f"error: --only: no part {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    if args.out and not os.path.isdir(args.out):
        print(f"error: --out {args.out} is not a folder", file=sys.stderr)
        return 2
    if args.record:
        record(args.record)
        return 0
    if args.list:
        for p in PARTS:
            print(f"{p.name}: {', '.join((p.text,) + p.data)}{'' if p.quick else '  (not in --quick)'}"
                  + (f"  (needs {p.needs})" if p.needs else ""))
            for c in p.commands:
                print(f"    $ {shown(c)}")
        return 0
    out_dir = os.path.abspath(args.out or (tempfile.mkdtemp(prefix="refresh-quick-") if args.quick else MEASURED))
    made_by = commit()
    limit_s = QUICK_LIMIT_S if args.quick else PART_LIMIT_S
    print(f"benchmarks/refresh.sh{' --quick' if args.quick else ''}: writing {out_dir}, commit {made_by}, "
          f"{os.cpu_count()} cores", flush=True)
    index_path = os.path.join(out_dir, INDEX)
    rows = read_index(index_path)
    summary, failed = [], False
    for part in PARTS:
        if args.only and part.name not in args.only:
            continue
        commands = part.quick if args.quick else part.commands
        if commands is None:
            summary.append([part.name, "skipped: no tiny sizes (--quick)", "", ""])
            continue
        if part.needs and not os.environ.get(part.needs):
            summary.append([part.name, f"skipped: {part.needs} is not set", "", ""])
            continue
        print(f"  {part.name} ...", flush=True)
        status, seconds = run_part(part, commands, out_dir, made_by, limit_s)
        failed |= status != "ok"
        summary.append([part.name, status, f"{seconds:.0f}", ", ".join((part.text,) + part.data)])
        if status == "ok":
            for name in (part.text,) + part.data:
                rows[name] = (command_cell(commands, out_dir), made_by,
                              f"refresh.sh{' --quick' if args.quick else ''}, "
                              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, {seconds:.0f} s")
            write_index(index_path, rows)
    print("\n" + muon_tools.format_table(["part", "status", "s", "files"], summary, ["<", "<", ">", "<"]))
    print(f"Not made here: {NOT_HERE}.")
    print(f"Index: {index_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
