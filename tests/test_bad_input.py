"""Every command of the project refuses bad input as a user meets it: exit 2, one line `error: ...` on stderr,
nothing on stdout, and no rank started. The table walks every entry point with argparse's own refusals (an
unknown flag, a value that is not a number, a choice not offered) and the checks each makes before starting a
rank (sizes a run cannot use among them).

Each row runs its script as `python SCRIPT ARGS` would, as __main__, in a process of its own with a timeout
(ROW_TIMEOUT_S): forked from one harness process that imported torch once (a fresh interpreter per row would
import torch again), as many rows at once as there are cores. In the row's process,
anything that would start a rank (a multiprocessing or subprocess start, joining a torch.distributed world) ends
it with exit 3 and says so.
Torchrun entry points run as torchrun starts each process (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE set; the parser runs before any rank joins): rank 0 prints the line, rank 3 nothing.
The shell scripts run as they are, with bash, all at once beside the harness.

A walker finds every entry point by listing the files (ENTRY_POINTS: a new command cannot be missed) and checks
what every command owes a user: --help (exit 0, the usage on stdout), an unknown flag (exit 2, one line), and,
for a command meant for python, one line under torchrun instead of a copy of the command per process.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_TIMEOUT_S = 20
ROWS_AT_ONCE = os.cpu_count() or 1  # each row is one process, mostly one core
TORCHRUN_ENV = dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4")
GLOO_CPU = ["--backend", "gloo", "--device", "cpu"]
TOO_BIG = ["--batch", "4096", "--context", "2048", "--d-model", "1024", "--layers", "24"]  # >= 0.8 TiB a rank

# (script, args, what the line says, launched by torchrun)
ROWS = [
    ("distributed_muon_cpu.py", ["--strategy", "foo"], "argument --strategy: invalid choice: 'foo'", False),
    ("distributed_muon_cpu.py", ["--dp", "abc"], "argument --dp: invalid int value: 'abc'", False),
    ("distributed_muon_cpu.py", ["--bogus"], "unrecognized arguments: --bogus", False),
    ("distributed_muon_cpu.py", ["--dp"], "argument --dp: expected one argument", False),
    ("distributed_muon_cpu.py", ["--tp", "3"], "TP 3 does not divide embed.weight dim 0", False),
    ("distributed_muon_cpu.py", ["--layers", "1000"], "--layers must be in [1, 24]", False),
    ("distributed_muon_cpu.py", ["--ns-blocks", "rows"], "argument --ns-blocks: invalid choice: 'rows'", False),
    ("distributed_muon_cpu.py", ["--ns-coefficients", "cubic"], "argument --ns-coefficients: invalid choice: 'cubic'",
     False),
    ("distributed_muon_cpu.py", ["--tp-newton-schulz", "ring"], "argument --tp-newton-schulz: invalid choice: 'ring'",
     False),
    ("distributed_muon_cpu.py", ["--tp-newton-schulz", "gram", "--strategy", "owner"],
     "--tp-newton-schulz gram applies to --strategy gather: strategy owner orthogonalizes each matrix whole", False),
    ("distributed_muon_cpu.py", ["--tp-newton-schulz", "gram", "--dp", "8", "--tp", "1"],
     "--tp-newton-schulz gram sums Newton-Schulz's Gram matrix over the TP ranks: with --tp 1 no matrix is split",
     False),
    ("distributed_muon_cpu.py", ["--qk-clip", "0"], "--qk-clip must be a number > 0 and finite (got 0.0)", False),
    ("distributed_muon_cpu.py", ["--qk-clip", "nan"], "--qk-clip must be a number > 0 and finite (got nan)", False),
    ("distributed_muon_cpu.py", ["--qk-clip", "100", "--model", "thin"],
     "--qk-clip: no fused QKV to act on with --model thin", False),
    ("distributed_muon_cpu.py", ["--ns-blocks", "heads", "--baseline"],
     "--ns-blocks: no fused QKV to act on with --model transformer --baseline", False),
    ("distributed_muon_cpu.py", ["--qk-clip", "100", "--dp", "1", "--tp", "16"],
     "TP 16 does not divide the 8 heads of a row layout", False),
    ("distributed_muon.py", ["--strategy", "foo"], "argument --strategy: invalid choice: 'foo'", True),
    ("distributed_muon.py", ["--backend", "mpi"], "argument --backend: invalid choice: 'mpi'", True),
    ("distributed_muon.py", ["--bogus"], "unrecognized arguments: --bogus", True),
    ("distributed_muon.py", ["--dp", "4", "--tp", "2", *GLOO_CPU], "world size 4 != DP 4 x TP 2 = 8", True),
    ("distributed_muon.py", ["--dp", "abc"], "argument --dp: invalid int value: 'abc'", False),  # outside torchrun
    ("distributed_muon.py", [], "RANK, WORLD_SIZE, LOCAL_RANK not set: launch with torchrun", False),
    ("dtensor_demo.py", ["--dp", "abc"], "argument --dp: invalid int value: 'abc'", False),
    ("dtensor_demo.py", ["--bogus"], "unrecognized arguments: --bogus", False),
    ("dtensor_demo.py", ["--steps", "0"], "--steps must be >= 1", False),
    ("dtensor_demo.py", ["--bogus", *GLOO_CPU], "unrecognized arguments: --bogus", True),
    ("dtensor_demo.py", ["--dp", "4", "--tp", "2", *GLOO_CPU], "world size 4 != DP 4 x TP 2 = 8", True),
    ("examples/train_gpt.py", ["--strategy", "foo"], "argument --strategy: invalid choice: 'foo'", False),
    ("examples/train_gpt.py", ["--dp", "abc"], "argument --dp: invalid int value: 'abc'", False),
    ("examples/train_gpt.py", ["--bogus"], "unrecognized arguments: --bogus", False),
    ("examples/train_gpt.py", ["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'", False),
    ("examples/train_gpt.py", ["--context", "100000", "--steps", "1"], "--val-windows 32 x (--context 100000 + 1)",
     False),
    ("examples/train_gpt.py", TOO_BIG, "--batch 4096 x --context 2048 with --d-model 1024 and --layers 24 needs "
                                       "at least", False),
    ("examples/train_gpt.py", ["--profile", "/proc/no-such-folder"],
     "--profile /proc/no-such-folder cannot be written: No such file or directory", False),
    ("examples/train_gpt.py", ["--bogus", *GLOO_CPU], "unrecognized arguments: --bogus", True),
    ("examples/train_gpt.py", ["--dp", "4", "--tp", "2", *GLOO_CPU], "world size 4 != DP 4 x TP 2 = 8", True),
    ("examples/train_gpt.py", ["--dp", "2", "--tp", "2", *GLOO_CPU, *TOO_BIG], "needs at least", True),
    ("examples/train_gpt_dtensor.py", ["--dp", "abc"], "argument --dp: invalid int value: 'abc'", False),
    ("examples/train_gpt_dtensor.py", ["--bogus"], "unrecognized arguments: --bogus", False),
    ("examples/train_gpt_dtensor.py", ["--resume", "/nonexistent"], "--resume /nonexistent: no torch.distributed",
     False),
    ("examples/train_gpt_dtensor.py", ["--dp", "2", "--tp", "2", *TOO_BIG], "needs at least", False),
    ("benchmarks/compare.py", ["--tp", "3"], "TP 3 does not divide embed.weight dim 0", False),
    ("benchmarks/gloo_collectives.py", ["--ranks", "abc"], "argument --ranks: invalid int value: 'abc'", False),
    ("benchmarks/gloo_collectives.py", ["--ranks", "1"], "--ranks must be in [2, 64] (got 1)", False),
    ("benchmarks/gloo_collectives.py", ["--ranks", "1000"], "--ranks must be in [2, 64] (got 1000)", False),
    ("benchmarks/gpt_lr_sweep.py", ["--schedules", "linear"], "argument --schedules: invalid choice: 'linear'",
     False),
    ("benchmarks/gpt_lr_sweep.py", ["--dp", "3"], "DP 3 does not divide --batch 16", False),
    ("benchmarks/gpt_lr_sweep.py", ["--schedules", "constant", "--warmup-steps", "3"],
     "--warmup-steps would be ignored: only warmup-cosine warms up, and --schedules leaves it out", False),
    ("benchmarks/gpt_lr_sweep.py", ["--from-json", "runs.json", "--st", "5", "--dp", "2"],
     "--steps, --dp would be ignored: --from-json reports the runs saved in runs.json, as they were trained", False),
    ("benchmarks/gpt_splits.py", ["--heads", "4"], "TP 8 does not divide --heads 4", False),
    ("benchmarks/gpt_splits.py", ["--steps", "x"], "argument --steps: invalid int value: 'x'", False),
    ("benchmarks/gpt_step.py", ["--dp", "3"], "DP 3 does not divide --batch 16", False),
    ("benchmarks/gpt_step.py", ["--json", "/nonexistent/step.json"], "--json /nonexistent/step.json: the folder",
     False),
    ("benchmarks/overlap.py", ["--ranks", "1"], "--ranks must be in [2, 64]", False),
    ("benchmarks/overlap.py", ["--d", "x"], "argument --d: invalid int value: 'x'", False),
    ("benchmarks/scaling.py", ["--ranks", "0"], "--ranks must be in [1, 64] (got 0)", False),
    ("benchmarks/scaling.py", ["--ranks", "1", "100"], "--ranks must be in [1, 64] (got 1 100)", False),
    ("benchmarks/peers.py", ["--ranks", "3"], "--ranks must be powers of two", False),
    ("benchmarks/peers.py", ["--d", "6", "--ranks", "4"], "--d 6 must be divisible by every --ranks", False),
    ("benchmarks/peers.py", ["--peers", "nope"], "argument --peers: invalid choice: 'nope'", False),
    ("benchmarks/peers.py", ["--d", "65536"], "--d 65536 x --layers 4 on 2 processes needs at least", False),
    ("benchmarks/scaling.py", ["--d", "65536"], "--d 65536 x --layers 4 on 2 processes needs at least", False),
    ("benchmarks/overlap.py", ["--d", "65536"], "--d 65536 x --layers 4 on 2 processes needs at least", False),
    ("benchmarks/batching.py", ["--bogus"], "unrecognized arguments: --bogus", False),
    ("benchmarks/at_scale.py", ["--builds", "0"], "--builds must be >= 1 (got 0)", False),
    ("benchmarks/at_scale.py", ["--steps", "-1"], "--steps must be >= 0 (got -1)", False),
    ("benchmarks/at_scale.py", ["--interleave", "--steps", "0"],
     "--interleave times construction alone: --steps 0 would change nothing", False),
    ("benchmarks/at_scale.py", ["--plan-only", "--interleave"],
     "--plan-only builds no optimizer: --interleave would change nothing", False),
    ("benchmarks/at_scale.py", ["--fresh"], "--fresh is a way to --interleave: give both", False),
    ("benchmarks/at_scale.py", ["--plan-only", "--blocks", "32"],
     "--plan-only plans Llama 3's shapes: --blocks 32 would change nothing", False),
    ("benchmarks/sweep.py", ["--bogus"], "unrecognized arguments: --bogus", False),
    ("benchmarks/cpu_vs_gpu_newton_schulz.py", ["--bogus"], "unrecognized arguments: --bogus", False),
    ("benchmarks/newton_schulz_gflops.py", ["96x"],
     "argument ROWSxCOLS: '96x' is not ROWSxCOLS with two positive whole numbers", False),
    ("benchmarks/newton_schulz_gflops.py", ["--device", "cpu", "--repeats", "0", "8x8"], "--repeats 0: at least 1",
     False),
    ("benchmarks/torch_step.py", ["/nonexistent.json"], "/nonexistent.json: No such file or directory", False),
    ("benchmarks/peers_1gpu.py", ["--device", "tpu"], "argument --device: invalid choice: 'tpu'", False),
    ("benchmarks/peers_1gpu.py", ["--device", "cpu", "--rounds", "0"], "--d, --layers and --rounds must be >= 1",
     False),
    ("benchmarks/peers_1gpu.py", ["--device", "cpu", "--d", "65536"],
     "--d 65536 x --layers 8 on 1 processes needs at least", False),
    ("benchmarks/on_gpu.sh", ["--frobnicate"], "on_gpu.sh: unknown option --frobnicate", False),
    ("benchmarks/on_gpu.sh", ["--out"], "on_gpu.sh: --out needs a value", False),
    ("benchmarks/on_gpu.sh", ["--cpu-only", "--out", "/nonexistent"], "on_gpu.sh: --out /nonexistent is not a folder",
     False),
    ("benchmarks/heap_stress.py", ["--runs", "0"], "--runs must be >= 1 and --busy >= 0 (got 0, ", False),
    ("benchmarks/heap_stress.py", ["--checkout", "/nonexistent"],
     "--checkout /nonexistent: it has no examples/train_gpt_dtensor.py", False),
    ("benchmarks/peak_memory.sh", [], "no command to measure", False),
    ("benchmarks/peak_memory.sh", ["no-such-command-xyz"], "no-such-command-xyz: no such command", False),
    ("benchmarks/refresh.sh", ["--bogus"], "unrecognized arguments: --bogus", False),
    ("benchmarks/refresh.sh", ["--only", "nope"], "--only: no part nope (see --list)", False),
    ("benchmarks/refresh.sh", ["--quick", "--out", "/nonexistent"], "--out /nonexistent is not a folder", False),
]
# Output paths are checked by creating them (as root, os.access says yes to /proc); an empty value (an unset shell
# variable) is refused for every flag; a flag that changes nothing without another, or that a command cannot honour
# (--backend nccl without torchrun), is refused, never ignored.
PROC = "/proc/x.json"
ROWS += [
    ("distributed_muon_cpu.py", ["--json", PROC], f"--json {PROC} cannot be written: No such file or directory", False),
    ("distributed_muon_cpu.py", ["--json", ""], "argument --json: an empty value", False),
    ("distributed_muon_cpu.py", ["--json="], "argument --json: an empty value", False),
    ("distributed_muon_cpu.py", ["--baseline", "--momentum", "0.9"],
     "--baseline runs AdamW for every parameter: --momentum 0.9 would change nothing", False),
    ("distributed_muon_cpu.py", ["--baseline", "--ns-coefficients", "polar_express"],
     "--ns-coefficients polar_express would change nothing", False),
    ("distributed_muon_cpu.py", ["--model", "thin", "--layers", "3"], "--layers sizes --model transformer", False),
    ("distributed_muon_cpu.py", ["--model", "lopsided", "--d-model", "64"], "--d-model sizes --model transformer", False),
    ("distributed_muon.py", ["--json", PROC, *GLOO_CPU], f"--json {PROC} cannot be written", True),
    ("dtensor_demo.py", ["--backend", "nccl"], "--backend nccl needs torchrun", False),
    ("dtensor_demo.py", ["--device", "cuda"], "--device cuda needs torchrun", False),
    ("dtensor_demo.py", ["--json", PROC], f"--json {PROC} cannot be written", False),
    ("dtensor_demo.py", ["--json", ""], "argument --json: an empty value", False),
    ("dtensor_demo.py", ["--dp", "2", "--tp", "2", "--json", PROC, *GLOO_CPU], f"--json {PROC} cannot be written",
     True),
    ("examples/train_gpt.py", ["--backend", "nccl"], "--backend nccl needs torchrun", False),
    ("examples/train_gpt.py", ["--backend", "gloo", "--device", "cuda"], "--device cuda needs torchrun", False),
    ("examples/train_gpt.py", ["--json", PROC], f"--json {PROC} cannot be written", False),
    ("examples/train_gpt.py", ["--profile", ""], "argument --profile: an empty value", False),
    ("examples/train_gpt.py", ["--warmup-steps", "5"], "--warmup-steps 5 applies to --schedule warmup-cosine", False),
    ("examples/train_gpt.py", ["--optimizer", "adamw", "--momentum", "0.9"], "--optimizer adamw takes no --momentum",
     False),
    ("examples/train_gpt.py", ["--dp", "2", "--tp", "2", "--json", PROC, *GLOO_CPU], f"--json {PROC} cannot be written",
     True),
    ("examples/train_gpt_dtensor.py", ["--save-step", "3"], "--save-step 3 applies to --save: give the folder", False),
    ("examples/train_gpt_dtensor.py", ["--resume-step", "2"], "--resume-step 2 applies to --resume: give the folder",
     False),
    ("examples/train_gpt_dtensor.py", ["--save", "/proc/ckpt", "--save-step", "2"],
     "--save /proc/ckpt cannot be written: No such file or directory", False),
    ("examples/train_gpt_dtensor.py", ["--save", ""], "argument --save: an empty value", False),
    ("benchmarks/compare.py", ["--strategy", "owner"], "unrecognized arguments: --strategy owner", False),
    ("benchmarks/compare.py", ["--baseline"], "unrecognized arguments: --baseline", False),
    ("benchmarks/compare.py", ["--json", PROC], f"--json {PROC} cannot be written", False),
    ("benchmarks/compare.py", ["--tp-newton-schulz-bytes", "--dp", "2"],
     "--tp-newton-schulz-bytes runs nothing: it takes --ns-steps alone (got --dp)", False),
    ("benchmarks/compare.py", ["--tp-newton-schulz", "gram", "--tp", "1", "--dp", "8"],
     "--tp-newton-schulz gram sums Newton-Schulz's Gram matrix over the TP ranks", False),
    ("examples/train_gpt_moe.py", ["--json", PROC], f"--json {PROC} cannot be written", False),
    ("examples/train_gpt_moe.py", ["--figure", ""], "argument --figure: an empty value", False),
    ("examples/train_gpt_moe.py", ["--resume-step", "1"], "--resume-step 1 applies to --resume: give the folder",
     False),
    ("benchmarks/gpt_step.py", ["--figure", "/proc/x.png"], "--figure /proc/x.png cannot be written", False),
    ("benchmarks/scaling.py", ["--figure", "/proc/x.png"], "--figure /proc/x.png cannot be written", False),
    ("benchmarks/gpt_step.py", ["--traces", "/proc/traces"], "--traces /proc/traces cannot be written", False),
    ("examples/train_gpt_moe.py", ["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'", False),
    ("examples/train_gpt_moe.py", ["--optimizer", "adamw", "--momentum", "0.9"], "--optimizer adamw takes no --momentum",
     False),
    ("examples/train_gpt_moe.py", ["--experts-lr", "0.003"],
     "--experts-lr applies to --optimizer adamw-experts (got --optimizer muon)", False),
    ("examples/train_gpt_moe.py", ["--optimizer", "adamw-experts", "--experts-lr", "inf"],
     "--experts-lr must be > 0 and finite (got inf)", False),
    ("benchmarks/moe_optimizers.py", ["--optimizers", "sgd"], "argument --optimizers: invalid choice: 'sgd'", False),
    ("benchmarks/moe_optimizers.py", ["--adamw-lrs", "0"], "--adamw-lrs must be > 0 and finite (got 0.0)", False),
    ("benchmarks/moe_optimizers.py", ["--optimizers", "muon", "--adamw-lrs", "0.01"],
     "--adamw-lrs would be ignored: --optimizers leaves adamw out", False),
    ("benchmarks/moe_optimizers.py", ["--seeds", "0", "0"], "--seeds 0 0: each seed once", False),
    ("benchmarks/moe_optimizers.py", ["--optimizers", "adamw-experts"],
     "--optimizers adamw-experts trains its other groups at muon's best lr: give muon too", False),
]
# The numbers a step cannot survive, refused up front (muon_tools.check_step_numbers, check_launch); what a command
# writes may not be one of its inputs, nor the code it runs (check_not_input), nor another of its outputs; combinations
# that would ignore a flag; the tools as the rest.
ROWS += [
    ("distributed_muon_cpu.py", ["--lr", "1e308"],
     "--lr 1e+308 overflows float32 in the step: AdamW's first step size lr / (1 - beta1 0.9) is 10 x lr = inf", False),
    ("distributed_muon_cpu.py", ["--lr", "1e38", "--weight-decay", "0"], "10 x lr = 1e+39, more than float32's", False),
    ("distributed_muon_cpu.py", ["--baseline", "--lr", "2e38", "--weight-decay", "0"], "10 x lr = 2e+39", False),
    ("distributed_muon_cpu.py", ["--lr", "11"],
     "--lr 11 x --weight-decay 0.1 = 1.1 is >= 1: every step multiplies each weight by 1 - lr x weight_decay = -0.1",
     False),
    ("distributed_muon_cpu.py", ["--lr", "1", "--weight-decay", "1"], "= 1 is >= 1", False),
    ("distributed_muon_cpu.py", ["--timeout", "0.001"], "--timeout 0.001 is below the 5 s the ranks may need to start",
     False),
    ("distributed_muon_cpu.py", ["--timeout", "1e30"], "--timeout 1e+30 is above 1e+09 s (31 years)", False),
    ("examples/train_gpt.py", ["--seed", "-1"], "--seed must be in [0, 2**32) (got -1)", False),
    ("distributed_muon_cpu.py", ["--json", "muon_tools/cli.py"], "--json muon_tools/cli.py is a file of the code this "
                                                                  "command runs", False),
    ("distributed_muon.py", ["--lr", "1e308", *GLOO_CPU], "--lr 1e+308 overflows float32 in the step", True),
    ("distributed_muon.py", ["--timeout", "0.001", "--dp", "2", "--tp", "2", *GLOO_CPU],
     "--timeout 0.001 is below the 5 s", True),
    ("distributed_muon.py", ["--json", "distributed_muon.py", *GLOO_CPU], "is a file of the code this command runs",
     True),
    ("dtensor_demo.py", ["--lr", "20"], "--lr 20 x --weight-decay 0.1 = 2 is >= 1", False),
    ("dtensor_demo.py", ["--lr", "1e308", "--dp", "2", "--tp", "2", *GLOO_CPU], "overflows float32 in the step", True),
    ("dtensor_demo.py", ["--timeout", "1"], "--timeout 1 is below the 5 s", False),
    ("examples/train_gpt.py", ["--lr", "1e38", "--weight-decay", "0"], "--lr 1e+38 overflows float32 in the step",
     False),
    ("examples/train_gpt.py", ["--lr", "10"], "--lr 10 x --weight-decay 0.1 = 1 is >= 1", False),
    ("examples/train_gpt.py", ["--timeout", "0.5", "--dp", "2", "--tp", "2", *GLOO_CPU], "--timeout 0.5 is below",
     True),
    ("examples/train_gpt_dtensor.py", ["--lr", "1e308"], "--lr 1e+308 overflows float32 in the step", False),
    ("examples/train_gpt_dtensor.py", ["--timeout", "1"], "--timeout 1 is below the 5 s", False),
    ("examples/train_gpt_dtensor.py", ["--save", "/proc/ck", "--save-step", "2", "--resume", "/proc/ck/",
                                       "--resume-step", "1"],
     "--save /proc/ck is --resume's checkpoint, which this command reads: it would write over its own input", False),
    ("benchmarks/gpt_lr_sweep.py", ["--muon-lrs", "0.02", "1e308"], "--muon-lrs 1e+308: --lr 1e+308 overflows", False),
    ("benchmarks/gpt_lr_sweep.py", ["--adamw-lrs", "20"], "--adamw-lrs 20: --lr 20 x --weight-decay 0.1", False),
    ("benchmarks/gpt_lr_sweep.py", ["--from-json", PROC, "--json", PROC],
     f"--json {PROC} is --from-json's runs, which this command reads", False),
    ("benchmarks/gpt_step.py", ["--json", PROC, "--figure", PROC], f"--figure {PROC} is also --json {PROC}", False),
    ("benchmarks/scaling.py", ["--json", PROC, "--figure", PROC], f"--figure {PROC} is also --json {PROC}", False),
    ("benchmarks/ns_coefficients.py", ["--lr", "1e308"], "--lr 1e+308 overflows float32 in the step", False),
    ("tools/gpu_twin.py", ["--twin", "/nonexistent-folder/twin.py"],
     "--twin /nonexistent-folder/twin.py: the folder /nonexistent-folder does not exist", False),
    ("tools/gpu_twin.py", ["--twin", "distributed_muon_cpu.py"],
     "--twin distributed_muon_cpu.py is the lesson, which this command reads: it would write over its own input",
     False),
    ("tools/gpu_twin.py", ["--twin", "notes/06-gpus.md"],
     "is the chapter that shows the diff, which this command reads", False),
    ("tools/gpu_twin.py", ["--check", "--twin", "/nonexistent/twin.py"], "--twin /nonexistent/twin.py: no such file to "
                                                                        "check", False),
    ("tools/gpu_twin.py", ["--twin"], "argument --twin: expected one argument", False),
    ("tools/make_notebook.py", ["--check", "--all"], "--check makes no notebook: --all (make both) would be ignored",
     False),
    ("tools/figures.py", ["--out-dir", "/proc/figures"], "--out-dir /proc/figures cannot be written", False),
    ("benchmarks/on_gpu.sh", ["--cpu-only", "--out", "/proc"], "on_gpu.sh: --out /proc cannot be written", False),
    ("benchmarks/on_gpu.sh", ["--cpu-only", "--name", "a/b"], "on_gpu.sh: --name a/b: letters, digits", False),
    ("benchmarks/peak_memory.sh", ["-x"], "peak_memory.sh: unknown option -x", False),
]
# Good input, run by the same harness: each gets as far as starting a rank, which the harness stops (exit 3). Its
# output paths, under {tmp} (a fresh folder), were created to check them and removed at once: nothing is left there.
CONTROLS = [("distributed_muon_cpu.py", ["--dp", "1", "--tp", "1", "--steps", "1", "--json", "{tmp}/run.json"], {}),
            ("distributed_muon.py", ["--dp", "2", "--tp", "2", *GLOO_CPU], TORCHRUN_ENV),
            ("examples/train_gpt_dtensor.py", ["--dp", "1", "--tp", "1", "--save", "{tmp}/a/ckpt", "--save-step", "1"],
             {}),
            ("benchmarks/compare.py", ["--overlap", "2", "--tp-newton-schulz", "gram", "--json", "{tmp}/compare.json"],
             {})]




def entry_points():
    """Every command of the repository, found by listing its folders: each Python file of the top level, examples/,
    benchmarks/ and tools/ with a `if __name__ == "__main__":` block, and each shell script there."""
    found = []
    for folder in ("", "examples", "benchmarks", "tools"):
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "*.py"))
                           + glob.glob(os.path.join(ROOT, folder, "*.sh"))):
            with open(path) as f:
                if path.endswith(".sh") or 'if __name__ == "__main__":' in f.read():
                    found.append(os.path.relpath(path, ROOT))
    return found


ENTRY_POINTS = entry_points()
# The commands with a torchrun mode (a rank per process); every other Python command is meant for python, and under
# torchrun says so in one line (muon_tools.exit_code) instead of running a copy of itself in every process.
TORCHRUN_MODE = {"distributed_muon.py", "dtensor_demo.py", "examples/train_gpt.py"}
FOR_PYTHON = [s for s in ENTRY_POINTS if s.endswith(".py") and s not in TORCHRUN_MODE]
UNKNOWN_FLAG = "--no-such-flag"
WALKS = [(script, [flag], {}) for flag in ("--help", UNKNOWN_FLAG) for script in ENTRY_POINTS]
WALKS += [(script, [], env) for script in FOR_PYTHON for env in (TORCHRUN_ENV, dict(TORCHRUN_ENV, RANK="3",
                                                                                    LOCAL_RANK="3"))]


def row_id(script, args, torchrun):
    return f"{script} {' '.join(args)}{' (torchrun)' if torchrun else ''}".strip()


def cases():
    for script, args, message, torchrun in ROWS:
        yield pytest.param(script, args, message, torchrun, id=row_id(script, args, torchrun))


@pytest.fixture(scope="module")
def controls_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("outputs")


@pytest.fixture(scope="module")
def outcomes(controls_folder):
    """{(script, args, rank): (exit code, stdout, stderr)} of every row and walk (rank 3 too under torchrun): the
    Python ones run by one harness process (this file as a script), the shell scripts with bash meanwhile, all at
    once. The CONTROLS' {tmp} is controls_folder."""
    jobs = [(script, args, env) for script, args, _, torchrun in ROWS
            for env in ([TORCHRUN_ENV, dict(TORCHRUN_ENV, RANK="3", LOCAL_RANK="3")] if torchrun else [{}])]
    jobs += [(script, [a.format(tmp=controls_folder) for a in args], env) for script, args, env in CONTROLS]
    jobs = [json.loads(job) for job in dict.fromkeys(json.dumps(job) for job in jobs + WALKS)]  # each once
    shell = [job for job in jobs if job[0].endswith(".sh")]
    jobs = [job for job in jobs if not job[0].endswith(".sh")]
    scripts = [subprocess.Popen(["bash", os.path.join(ROOT, script), *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT) for script, args, _ in shell]
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(jobs), capture_output=True, text=True,
                          timeout=60 + ROW_TIMEOUT_S * len(jobs) // 4, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = {(script, tuple(a.replace(str(controls_folder), "{tmp}") for a in args), env.get("RANK")): tuple(out)
           for (script, args, env), out in zip(jobs, json.loads(proc.stdout))}
    for (script, args, _), p in zip(shell, scripts):
        out, err = p.communicate(timeout=ROW_TIMEOUT_S)
        ran[script, tuple(args), None] = (p.returncode, out, err)
    return ran


@pytest.mark.parametrize("script,args,message,torchrun", cases())
def test_bad_input_is_one_line_exit_2_and_starts_no_rank(outcomes, script, args, message, torchrun):
    code, out, err = outcomes[script, tuple(args), "0" if torchrun else None]
    assert (code, out) == (2, ""), (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert message in err, err
    if torchrun:  # every process parses the same flags: the others exit as rank 0 does, silently
        assert outcomes[script, tuple(args), "3"] == (2, "", "")


@pytest.mark.parametrize("script,args,env", CONTROLS, ids=[c[0] for c in CONTROLS])
def test_the_harness_stops_a_run_that_starts_a_rank(outcomes, controls_folder, script, args, env):
    """The rows' "no rank started" can fail: good input reaches a rank's start (a process, or joining the world).
    What it was to write was created and removed before: the run then stopped, and left nothing behind."""
    code, out, err = outcomes[script, tuple(args), env.get("RANK")]
    assert code == 3 and err.endswith("a rank was started\n"), (code, out, err)
    assert os.listdir(controls_folder) == []


def test_help_is_argparses_own(outcomes):
    """OneLineParser changes how a refusal ends, not --help: the usage and every option, exit 0."""
    code, out, err = outcomes["examples/train_gpt.py", ("--help",), None]
    assert code == 0 and err == ""
    assert out.startswith("usage: train_gpt.py [-h]") and "--context CONTEXT" in out


def test_the_walker_finds_every_kind_of_entry_point():
    """The listing finds the commands of each folder and kind (a file it missed would go unchecked)."""
    assert {"distributed_muon_cpu.py", "distributed_muon.py", "examples/train_gpt.py", "benchmarks/compare.py",
            "benchmarks/on_gpu.sh", "tools/gpu_twin.py", "tools/make_notebook.py"} <= set(ENTRY_POINTS)
    assert "muon_tools.py" not in ENTRY_POINTS and "examples/gpt.py" not in ENTRY_POINTS  # modules, not commands


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_every_command_s_help_is_its_usage_on_stdout(outcomes, script):
    """--help works for every command, whatever else it needs (torchrun, a GPU, a positional argument): the usage
    on stdout, nothing on stderr, exit 0, no rank started."""
    code, out, err = outcomes[script, ("--help",), None]
    assert (code, err) == (0, "") and out.startswith("usage: "), (code, out[:500], err[-3000:])


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_every_command_refuses_an_unknown_flag_in_one_line(outcomes, script):
    """An unknown flag: exit 2, one line `error: ...` on stderr (argparse's usage line left out), nothing on stdout,
    no rank started."""
    code, out, err = outcomes[script, (UNKNOWN_FLAG,), None]
    assert (code, out) == (2, ""), (code, out[:500], err[-3000:])
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), err


@pytest.mark.parametrize("script", FOR_PYTHON)
def test_a_command_for_python_says_so_under_torchrun(outcomes, script):
    """A command meant for python (it starts its own ranks, or none) started by torchrun: rank 0 says so in one line,
    every process exits 2, and none runs the command (a copy per process, each starting its own ranks)."""
    code, out, err = outcomes[script, (), "0"]
    assert (code, out) == (2, ""), (code, out[:500], err[-3000:])
    name = os.path.basename(script)
    assert err == (f"error: {name} runs with python, not under torchrun (RANK, WORLD_SIZE and LOCAL_RANK are set): "
                   f"torchrun would run a copy of the whole command in each of its processes; run python {name}"
                   + ("; under torchrun, run distributed_muon.py, the lesson's twin for torchrun"
                      if script == "distributed_muon_cpu.py" else "") + "\n"), err
    assert outcomes[script, (), "3"] == (2, "", "")


# The harness: reads [(script, args, env)] as JSON on stdin, runs each in a forked process, prints
# [(exit code, stdout, stderr)] as JSON.
def run_row(script, args, env, out_path, err_path):
    """In the forked child: stdout and stderr to files, every way of starting a rank refused, then the script as
    __main__; never returns."""
    import multiprocessing.process
    import runpy
    import signal

    import torch.distributed

    import muon_forkserver

    out, err = os.open(out_path, os.O_WRONLY), os.open(err_path, os.O_WRONLY)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.update(env)

    class Started(BaseException):  # not an Exception: no command's own handler swallows it
        pass

    def started(*_, **__):  # raised, not os._exit: the command's finally blocks still remove its temporary folder
        os.write(2, b"a rank was started\n")
        raise Started()

    multiprocessing.process.BaseProcess.start = started
    subprocess.Popen.__init__ = started
    # A command's first lines start its ranks' forkserver (no rank: test_interrupts checks, on real commands, that
    # it ends with the refusal); here, where every process start is refused, they only block SIGINT.
    muon_forkserver.start_command = lambda spawns_ranks=True: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    torch.distributed.init_process_group = started
    path = os.path.join(ROOT, script)
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(path)
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except Started:
        code = 3
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def harness():
    import signal
    import tempfile
    import time

    import torch  # noqa: F401  (imported once, before the forks)

    sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
    import distmuon.dtensor  # noqa: F401
    import distributed_muon  # noqa: F401
    import dtensor_demo  # noqa: F401
    import nbformat  # noqa: F401  (tools/make_notebook.py's, a second a row otherwise)
    from examples import train_gpt  # noqa: F401

    jobs = list(enumerate(json.load(sys.stdin)))
    results = [None] * len(jobs)
    running = {}  # pid: (row, deadline, its output files)
    with tempfile.TemporaryDirectory() as folder:
        while jobs or running:
            while jobs and len(running) < ROWS_AT_ONCE:
                i, (script, args, env) = jobs.pop(0)
                paths = [os.path.join(folder, f"{i}.{name}") for name in ("out", "err")]
                for p in paths:
                    open(p, "w").close()
                pid = os.fork()
                if pid == 0:
                    run_row(script, args, env, *paths)
                running[pid] = (i, time.monotonic() + ROW_TIMEOUT_S, paths)
            time.sleep(0.01)
            for pid, (i, deadline, paths) in list(running.items()):
                done = os.waitpid(pid, os.WNOHANG)
                if done[0] == 0 and time.monotonic() < deadline:
                    continue
                if done[0] == 0:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    code = f"timed out after {ROW_TIMEOUT_S} s"
                else:
                    code = os.waitstatus_to_exitcode(done[1])
                results[i] = [code, *(open(p).read() for p in paths)]
                del running[pid]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    harness()
