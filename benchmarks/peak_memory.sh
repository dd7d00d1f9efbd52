#!/bin/bash
# Peak memory of a run with all its processes: the command runs in its own session, sampled every 0.5 s;
# prints the peak of the summed RSS (counts pages shared between ranks once per rank) and of the
# summed PSS (shares them out: the memory the run really holds).
#   benchmarks/peak_memory.sh python examples/train_gpt.py
[ $# -gt 0 ] || { echo "error: no command to measure (benchmarks/peak_memory.sh COMMAND [ARGUMENT ...])" >&2; exit 2; }
case "$1" in
  -h|--help) echo "usage: benchmarks/peak_memory.sh COMMAND [ARGUMENT ...]"
    echo "Runs COMMAND in a session of its own and prints the peak of its processes' summed RSS and PSS"
    echo "(its output goes to \$PEAK_MEMORY_LOG, or nowhere)."
    exit 0 ;;
  -*) echo "error: peak_memory.sh: unknown option $1 (it takes a COMMAND to measure, then its arguments)" >&2; exit 2 ;;
esac
command -v "$1" > /dev/null || { echo "error: $1: no such command" >&2; exit 2; }
setsid "$@" > "${PEAK_MEMORY_LOG:-/dev/null}" 2>&1 &
sleep 0.5
SID=$!
prss=0; ppss=0
while kill -0 $SID 2>/dev/null; do
  rss=0; pss=0
  for p in $(ps -o pid= -s $SID); do
    read r s < <(awk '/^Rss:/{r=$2} /^Pss:/{s=$2} END{print r+0, s+0}' /proc/$p/smaps_rollup 2>/dev/null)
    rss=$((rss + ${r:-0})); pss=$((pss + ${s:-0}))
  done
  [ $rss -gt $prss ] && prss=$rss; [ $pss -gt $ppss ] && ppss=$pss
  sleep 0.5
done
echo "peak summed RSS $((prss/1024)) MiB, peak summed PSS $((ppss/1024)) MiB"
