#!/bin/bash
# Everything that needs the GPU machine, in one command under 9 minutes (issue 22), each part time-boxed:
#   1. the GPU sibling (distributed_muon.py) on 1 GPU under torchrun: bit-identity to torch.optim.Muon /
#      AdamW on CUDA, and its step time against torch's own step on the same GPU, same model, same steps;
#   2. Newton-Schulz GFLOP/s against one bf16 matmul of the same shapes (X @ X.T, the first product of each
#      iteration) on the GPU, and whether CPU and GPU agree bit for bit (cpu_vs_gpu_newton_schulz.py);
#   3. the DTensor optimizer (distributed_muon_dtensor.py) on one CUDA device under torchrun;
#   4. the CPU scaling of benchmarks/scaling.py --ranks 1 2 4 8 at d = 768 on that machine's cores
#      (issue 22's goal: owner and comm-free >= 0.85 N x on N ranks up to 8).
# Figures go to notes/measured/*_<gpu name>.* (e.g. sibling_1gpu_h100.txt), each with its command and commit on
# top, and their rows to notes/measured/INDEX.md (benchmarks/refresh.py --record);
# a summary of every part (status, seconds, its key line) is printed at the end.
#
#   bash benchmarks/on_gpu.sh                      # on the GPU machine, from the repository root
#   bash benchmarks/on_gpu.sh --cpu-only           # any machine: parts 1-3 skipped (and said so), part 4 runs
#   bash benchmarks/on_gpu.sh --cpu-only --quick --out /tmp/x   # seconds: tiny sizes (the test's run)
#   bash benchmarks/on_gpu.sh 2>&1 | tee $OUT/on_gpu.log; tar czf $OUT/measured.tgz notes/measured/*_h100*.* \
#     notes/measured/INDEX.md   # on this workplace's lent machine: its copy has git, its only Python is python3
#     (found below; never write a `python` over a link to it), and at most 8 files come back from $OUT
# Options: --cpu-only, --quick (tiny sizes: a plumbing check, not figures), --out DIR (default notes/measured),
# --name NAME (file suffix; default the GPU's model, e.g. h100, or "cpu" with --cpu-only).
set -u
cd "$(dirname "$0")/.."
CPU_ONLY=0; QUICK=0; OUT=notes/measured; NAME=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-only) CPU_ONLY=1 ;;
    --quick) QUICK=1 ;;
    --out|--name) [ $# -gt 1 ] || { echo "error: on_gpu.sh: $1 needs a value" >&2; exit 2; }
      if [ "$1" = --out ]; then OUT=$2; else NAME=$2; fi; shift ;;
    *) echo "error: on_gpu.sh: unknown option $1 (--cpu-only, --quick, --out DIR, --name NAME)" >&2; exit 2 ;;
  esac
  shift
done
[ -d "$OUT" ] || { echo "error: on_gpu.sh: --out $OUT is not a folder" >&2; exit 2; }
# The Python with torch: $PYTHON, else `python`, else `python3` (the device machine lent here has only python3).
PY=${PYTHON:-$(command -v python >/dev/null && echo python || echo python3)}
if [ "$CPU_ONLY" = 0 ] && ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "error: on_gpu.sh: no CUDA GPU here (torch.cuda.is_available() is False); run with --cpu-only" >&2; exit 2
fi
if [ -z "$NAME" ]; then
  if [ "$CPU_ONLY" = 1 ]; then NAME=cpu
  else NAME=$($PY -c "import torch; print(torch.cuda.get_device_name(0))" | tr 'A-Z' 'a-z' | sed 's/nvidia //' | awk '{print $1}'); fi
fi
# Sizes: the sibling's steps, Newton-Schulz's shapes (d = 768's four and a large square) and scaling.py's run.
if [ "$QUICK" = 1 ]; then
  STEPS=3; NS_SHAPES="96x32 32x96"; SCALING="--ranks 1 --d 32 --layers 1 --rounds 1"
else
  STEPS=10; NS_SHAPES="2304x768 768x768 3072x768 768x3072 8192x8192"; SCALING="--ranks 1 2 4 8 --d 768 --rounds 3"
fi
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -n "$(git status --porcelain 2>/dev/null)" ] && COMMIT="$COMMIT+dirty"  # as benchmarks/refresh.sh writes it
START=$SECONDS
SUMMARY=()

# part TITLE SECONDS FILE KEY_PATTERN COMMAND...: runs COMMAND under `timeout`, writes its command, the
# commit and its output to FILE (and the terminal), and adds a line to the summary.
part() {
  local title=$1 limit=$2 file=$3 key=$4; shift 4
  local t0=$SECONDS rc
  echo; echo "=== $title (at most ${limit} s) ==="
  { echo "\$ $*"; echo "# commit $COMMIT, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, time-boxed to ${limit} s by benchmarks/on_gpu.sh"
    timeout --kill-after=10 "$limit" "$@" 2>&1; echo "exit status $?"; } | tee "$file"
  rc=$(tail -1 "$file" | awk '{print $3}')
  local status="ok"
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && status="TIMED OUT after ${limit} s"
  [ "$status" = ok ] && [ "$rc" != 0 ] && status="FAILED (exit $rc)"
  SUMMARY+=("$(printf '%-40s %-24s %4d s  %s' "$title" "$status" $((SECONDS - t0)) "$(grep -E "$key" "$file" | tail -1 | cut -c1-110)")")
}

skip() {
  echo; echo "=== $1: SKIPPED (--cpu-only: needs a CUDA GPU) ==="
  SUMMARY+=("$(printf '%-40s %-24s' "$1" "SKIPPED (--cpu-only)")")
}

# 1. The sibling on one GPU, then torch's own step on the same GPU, model and gradients (its median step).
TORCH_STEP='
import json, statistics, sys, time, torch
import distributed_muon_cpu as dm
import muon_tools as mt
run = json.load(open(sys.argv[1]))
cfg = mt.RunConfig(**run["config"])
specs = mt.demo_specs(cfg)
torch.set_num_threads(1)
params = {n: t.cuda() for n, t in dm.initial_params(specs, cfg.seed).items()}
optimizers = mt.torch_optimizers([dict(h, params=[params[s.name] for s in specs if s.group == g])
                                  for g, h in mt.group_hyperparameters(cfg).items()])
ms = []
for step in range(1, cfg.steps + 1):
    grads = mt.total_grads(specs, cfg.seed, step, cfg.dp, cfg.missing_grads)
    for s in specs:
        params[s.name].grad = None if grads[s.name] is None else grads[s.name].cuda()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for o in optimizers:
        o.step()
    torch.cuda.synchronize()
    ms.append((time.perf_counter() - t0) * 1e3)
ours, theirs, passed = run["timings"]["step_ms_median"], statistics.median(ms), run["passed"]
print(f"torch.optim.Muon + AdamW on {torch.cuda.get_device_name(0)}, same model and {cfg.steps} steps: "
      f"median step {theirs:.1f} ms (min {min(ms):.1f})")
print(f"sibling / torch step time: {ours / theirs:.2f} ({ours:.1f} against {theirs:.1f} ms); "
      f"bit-identical to torch (the sibling run passed): {passed}")
'
# 2. Newton-Schulz (torch's own, bf16) against one bf16 matmul X @ X.T of the same shape, on the GPU.
NS_GFLOPS='
import statistics, sys, time, torch
from torch.optim._muon import _zeropower_via_newtonschulz as ns
import distributed_muon_cpu as dm

def ms(f, repeats=10):
    f(); torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); f(); torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3

print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; median of 10 after one warm-up")
print("{:>12}  {:>8}  {:>10}  {:>8}  {:>14}  {:>11}".format(
    "shape", "NS ms", "NS GFLOP/s", "X@X.T ms", "matmul GFLOP/s", "NS / matmul"))
for text in sys.argv[1:]:
    shape = tuple(int(v) for v in text.split("x"))
    g = torch.randn(shape, device="cuda")
    x = g.bfloat16() if shape[0] <= shape[1] else g.bfloat16().T.contiguous()
    m, n = x.shape
    t_ns = ms(lambda: ns(g, dm.NS_COEFFICIENTS, dm.NS_STEPS, dm.NS_EPS))
    t_mm = ms(lambda: x @ x.T)
    ns_rate, mm_rate = dm.newton_schulz_flops(shape) / t_ns / 1e6, 2 * m * m * n / t_mm / 1e6
    print(f"{text:>12}  {t_ns:8.3f}  {ns_rate:10.0f}  {t_mm:8.3f}  {mm_rate:14.0f}  {ns_rate / mm_rate:11.2f}")
'

if [ "$CPU_ONLY" = 1 ]; then
  skip "1. sibling on 1 GPU vs torch.optim.Muon"
  skip "2. Newton-Schulz GFLOP/s vs bf16 matmul"
  skip "3. DTensor optimizer on 1 CUDA device"
else
  part "1. sibling on 1 GPU vs torch.optim.Muon" 60 "$OUT/sibling_1gpu_$NAME.txt" "^Result" \
    torchrun --standalone --nproc-per-node 1 distributed_muon.py --steps "$STEPS" --json "$OUT/sibling_1gpu_$NAME.json"
  if [ -s "$OUT/sibling_1gpu_$NAME.json" ]; then
    part "1b. torch.optim.Muon's step on the GPU" 45 "$OUT/sibling_vs_torch_1gpu_$NAME.txt" "^sibling / torch" \
      $PY -c "$TORCH_STEP" "$OUT/sibling_1gpu_$NAME.json"
  fi
  part "2. Newton-Schulz GFLOP/s vs bf16 matmul" 45 "$OUT/ns_gflops_$NAME.txt" "x" $PY -c "$NS_GFLOPS" $NS_SHAPES
  part "2b. Newton-Schulz bits, CPU vs GPU" 30 "$OUT/cpu_vs_gpu_newton_schulz_$NAME.txt" "4096, 1024" \
    $PY benchmarks/cpu_vs_gpu_newton_schulz.py
  part "3. DTensor optimizer on 1 CUDA device" 60 "$OUT/dtensor_1gpu_$NAME.txt" "^Result|PASS|FAIL" \
    torchrun --standalone --nproc-per-node 1 dtensor_demo.py --dp 1 --tp 1 --steps "$STEPS" \
    --json "$OUT/dtensor_1gpu_$NAME.json"
fi
HOST=$([ "$CPU_ONLY" = 1 ] && echo "$NAME" || echo "${NAME}host")
part "4. CPU scaling, $(nproc) cores" 270 "$OUT/scaling_$(nproc)core_$HOST.txt" "^ +[0-9]+  comm-free  " \
  $PY benchmarks/scaling.py $SCALING --json "$OUT/scaling_$(nproc)core_$HOST.json" \
  --figure "$OUT/scaling_$(nproc)core_$HOST.png"

echo; echo "=== Summary: $((SECONDS - START)) s in all (goal: under 540 s), files in $OUT, suffix $NAME ==="
printf '%s\n' "${SUMMARY[@]}"
[ "$CPU_ONLY" = 1 ] && echo "CUDA parts (1-3) were SKIPPED (--cpu-only): no GPU figure was measured by this run."
# their rows in $OUT/INDEX.md (the command and commit of each file, from its header: tests/test_measured.py)
FILES=$(ls "$OUT"/*_"$NAME".* "$OUT"/*_"$HOST".* 2>/dev/null | sort -u)
[ -n "$FILES" ] && $PY benchmarks/refresh.py --record $FILES | tail -1
! printf '%s\n' "${SUMMARY[@]}" | grep -q "FAILED\|TIMED OUT"
