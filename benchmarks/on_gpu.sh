#!/bin/bash
# Everything that needs the GPU machine, in one command under 12 minutes (issue 22), each part time-boxed:
#   1. the GPU sibling (distributed_muon.py) on 1 GPU under torchrun: bit-identity to torch.optim.Muon /
#      AdamW on CUDA, and its step time against torch's own step on the same GPU, same model, same steps;
#   2. Newton-Schulz GFLOP/s against one bf16 matmul of the same shapes (X @ X.T, the first product of each
#      iteration) on the GPU, and whether CPU and GPU agree bit for bit (cpu_vs_gpu_newton_schulz.py);
#   3. the DTensor optimizer (dtensor_demo.py, distmuon/dtensor/) on one CUDA device under torchrun;
#   4. the CPU scaling of benchmarks/scaling.py --ranks 1 2 4 8 at d = 768 on that machine's cores
#      (issue 22's goal: owner and comm-free >= 0.85 N x on N ranks up to 8);
#   5. torch.optim.Muon, DTensorMuon, microsoft/dion's Muon (compiled and eager) and torchtitan's DistMuon (whole
#      matrices, Owned; per head, BlockShard) on 1 GPU at d = 4096, 8 layers, in a one-rank NCCL group: step times,
#      bits against torch, Newton-Schulz's measured rate beside the cost model's 594 TFLOP/s (benchmarks/
#      peers_1gpu.py, with $PEERS_PYTHON if set: the Python that has dion and torchtitan, else "not installed").
#      The lent machine reaches no registry: carry each as a wheel made here (`pip wheel --no-deps -w DIR
#      git+https://github.com/microsoft/dion.git@<commit>` and `git+https://github.com/pytorch/torchtitan.git@<commit>`,
#      the commits in benchmarks/requirements-peers.txt) and `pip install --no-deps` them there first.
# Figures go to notes/measured/*_<gpu name>.* (e.g. sibling_1gpu_h100.txt), each with its command and commit on
# top, and their rows to notes/measured/INDEX.md (benchmarks/refresh.py --record);
# a summary of every part (status, seconds, its key line) is printed at the end.
#
#   bash benchmarks/on_gpu.sh                      # on the GPU machine, from the repository root
#   bash benchmarks/on_gpu.sh --cpu-only           # any machine: parts 1-3 and 5 skipped (and said so), part 4 runs
#   bash benchmarks/on_gpu.sh --cpu-only --quick --out /tmp/x   # seconds: tiny sizes (the test's run; part 5 then
#                                                               # runs its tiny form on the CPU)
#   bash benchmarks/on_gpu.sh 2>&1 | tee $OUT/on_gpu.log; tar czf $OUT/measured.tgz notes/measured/*_h100*.* \
#     notes/measured/INDEX.md   # on this workplace's lent machine: its copy has git, its only Python is python3
#     (found below; never write a `python` over a link to it), and at most 8 files come back from $OUT; its git
#     HEAD is the session's first commit, so a later tree's files say <that>+dirty: commit first, then name the
#     commit whose tree was sent in their headers and rows (`git status` there lists the files that differ)
# Options: --cpu-only, --quick (tiny sizes: a plumbing check, not figures), --out DIR (default notes/measured),
# --name NAME (file suffix; default the GPU's model, e.g. h100, or "cpu" with --cpu-only).
set -u
cd "$(dirname "$0")/.."
CPU_ONLY=0; QUICK=0; OUT=notes/measured; NAME=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) echo "usage: bash benchmarks/on_gpu.sh [--cpu-only] [--quick] [--out DIR] [--name NAME]"
      echo "Everything that needs the GPU machine, each part time-boxed (the comments at the top of this file)."
      echo "  --cpu-only   skip the CUDA parts (1-3), run the CPU scaling (4)"
      echo "  --quick      tiny sizes: a plumbing check, not figures"
      echo "  --out DIR    the folder to write the files into (default notes/measured)"
      echo "  --name NAME  the files' suffix (default the GPU's model, e.g. h100, or cpu with --cpu-only)"
      exit 0 ;;
    --cpu-only) CPU_ONLY=1 ;;
    --quick) QUICK=1 ;;
    --out|--name) [ $# -gt 1 ] || { echo "error: on_gpu.sh: $1 needs a value" >&2; exit 2; }
      if [ "$1" = --out ]; then OUT=$2; else NAME=$2; fi; shift ;;
    *) echo "error: on_gpu.sh: unknown option $1 (--cpu-only, --quick, --out DIR, --name NAME)" >&2; exit 2 ;;
  esac
  shift
done
[ -d "$OUT" ] || { echo "error: on_gpu.sh: --out $OUT is not a folder" >&2; exit 2; }
# writable: made and removed, as muon_tools.check_writable does (as root, test -w says yes even to /proc)
PROBE="$OUT/.on_gpu-probe-$$"
( : > "$PROBE" ) 2>/dev/null && rm -f "$PROBE" || { echo "error: on_gpu.sh: --out $OUT cannot be written" >&2; exit 2; }
case "$NAME" in
  *[!A-Za-z0-9._-]*)
    echo "error: on_gpu.sh: --name $NAME: letters, digits, '.', '_' and '-' only (it ends file names)" >&2; exit 2 ;;
esac
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
  STEPS=3; NS_SHAPES="96x32 32x96"; SCALING="--ranks 1 --d 32 --layers 1 --rounds 1"; PEERS="--d 32 --layers 1 --rounds 1"
else
  STEPS=10; NS_SHAPES="2304x768 768x768 3072x768 768x3072 8192x8192"; SCALING="--ranks 1 2 4 8 --d 768 --rounds 3"
  PEERS="--d 4096 --layers 8 --rounds 5"
fi
PEERS_PY=${PEERS_PYTHON:-$PY}  # part 5: the Python that has dion and torchtitan (benchmarks/requirements-peers.txt)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -n "$(git status --porcelain 2>/dev/null)" ] && COMMIT="$COMMIT+dirty"  # as benchmarks/refresh.sh writes it
START=$SECONDS
SUMMARY=()
WRITTEN=()  # the files this run's parts wrote, and only those, get their rows in INDEX.md

# part TITLE SECONDS FILE KEY_PATTERN COMMAND...: runs COMMAND under `timeout`, writes its command, the
# commit and its output to FILE (and the terminal), and adds a line to the summary.
part() {
  local title=$1 limit=$2 file=$3 key=$4; shift 4
  local t0=$SECONDS rc arg shown=("$@")
  [ "${shown[0]}" = "$PY" ] && shown[0]=python  # the file shows `python`, not this interpreter's path ($PYTHON)
  WRITTEN+=("$file")
  for arg in "$@"; do [[ "$arg" == "$OUT"/* ]] && WRITTEN+=("$arg"); done  # --json, --figure (1b's input: 1's)
  echo; echo "=== $title (at most ${limit} s) ==="
  { echo "\$ ${shown[*]}"; echo "# commit $COMMIT, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, time-boxed to ${limit} s by benchmarks/on_gpu.sh"
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

if [ "$CPU_ONLY" = 1 ]; then
  skip "1. sibling on 1 GPU vs torch.optim.Muon"
  skip "2. Newton-Schulz GFLOP/s vs bf16 matmul"
  skip "3. DTensor optimizer on 1 CUDA device"
else
  part "1. sibling on 1 GPU vs torch.optim.Muon" 60 "$OUT/sibling_1gpu_$NAME.txt" "^Result" \
    torchrun --standalone --nproc-per-node 1 distributed_muon.py --steps "$STEPS" --json "$OUT/sibling_1gpu_$NAME.json"
  if [ -s "$OUT/sibling_1gpu_$NAME.json" ]; then
    part "1b. torch.optim.Muon's step on the GPU" 45 "$OUT/sibling_vs_torch_1gpu_$NAME.txt" "^run / torch" \
      $PY benchmarks/torch_step.py "$OUT/sibling_1gpu_$NAME.json"
  fi
  part "2. Newton-Schulz GFLOP/s vs bf16 matmul" 45 "$OUT/ns_gflops_$NAME.txt" "^ *[0-9]+x[0-9]+ " \
    $PY benchmarks/newton_schulz_gflops.py $NS_SHAPES
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
# part 5 on the GPU; with --cpu-only, its tiny form (--quick) on the CPU, which checks its plumbing, or nothing
if [ "$CPU_ONLY" = 0 ]; then
  part "5. torch, ours, dion, DistMuon, 1 GPU" 180 "$OUT/peers_1gpu_$NAME.txt" "^ours: DTensorMuon " \
    $PEERS_PY benchmarks/peers_1gpu.py $PEERS
elif [ "$QUICK" = 1 ]; then
  part "5. torch, ours, dion, DistMuon, 1 device" 90 "$OUT/peers_1gpu_$NAME.txt" "^ours: DTensorMuon " \
    $PEERS_PY benchmarks/peers_1gpu.py --device cpu $PEERS
else
  skip "5. torch, ours, dion, DistMuon, 1 GPU"
fi

echo; echo "=== Summary: $((SECONDS - START)) s in all (goal: under 720 s), files in $OUT, suffix $NAME ==="
printf '%s\n' "${SUMMARY[@]}"
[ "$CPU_ONLY" = 1 ] && echo "CUDA parts (1-3) were SKIPPED (--cpu-only): no GPU figure was measured by this run." \
  && echo "Part 5 $([ "$QUICK" = 1 ] && echo "ran its tiny form on the CPU" || echo "was SKIPPED") (--cpu-only)."
# their rows in $OUT/INDEX.md (the command and commit of each file, from its header: tests/test_measured.py)
FILES=()
for f in "${WRITTEN[@]}"; do [ -s "$f" ] && FILES+=("$f"); done
[ ${#FILES[@]} -gt 0 ] && $PY benchmarks/refresh.py --record "${FILES[@]}" | tail -1
! printf '%s\n' "${SUMMARY[@]}" | grep -q "FAILED\|TIMED OUT"
