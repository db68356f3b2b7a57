#!/bin/bash
# `bertrain doctor` names a real straggler: 2 ranks, one thread each, bound to cores 0 and 1,
# while a busy loop shares core 1 with rank 1. Rank 1 computes at about half speed (rank 0
# waits for it in the allreduce); doctor must report rank 1 as the straggler, and a run without
# the hog must show no straggler.
# usage: straggler.sh <bertrain binary>
set -euo pipefail
BT=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if [ "$(nproc)" -lt 2 ] || ! command -v taskset >/dev/null; then
  echo "straggler: SKIPPED, needs 2 cores and taskset"
  exit 0
fi
WORK=$(mktemp -d /tmp/bertrain-doctor.XXXXXX)
HOG=""
trap '[ -n "$HOG" ] && kill $HOG 2>/dev/null; [ -z "${KEEP:-}" ] && rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
train() {  # output dir
  mpirun -np 2 --oversubscribe --bind-to core -x OMP_NUM_THREADS=1 "$BT" train \
    --model-config "$ROOT/configs/bert-tiny.json" \
    --data "$ROOT/tests/data/tfrecord/bert_pretrain_sample_text.tfrecord" --output "$1" \
    --steps 24 --log-every 4 --batch-size 8 --seq-len 128 --max-predictions 20 --threads 1 \
    --allreduce ring > "$1.log" 2>&1 || { cat "$1.log"; exit 1; }
}
train "$WORK/even"
"$BT" doctor "$WORK/even" > "$WORK/even.txt"
if grep -q "find  straggler" "$WORK/even.txt"; then
  echo "straggler: reported on an even run:"; cat "$WORK/even.txt"; exit 1
fi
taskset -c 1 sh -c 'while :; do :; done' &
HOG=$!
train "$WORK/slow"
kill $HOG; HOG=""
"$BT" doctor "$WORK/slow" | tee "$WORK/slow.txt" | sed -n '/doctor: run/,$p'
grep -q "find  straggler  rank 1 takes" "$WORK/slow.txt" || { echo "straggler: rank 1 not named"; exit 1; }
echo "straggler: ok (rank 1 named with a hog on its core; nothing on the even run)"
