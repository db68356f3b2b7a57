#!/bin/bash
# `bertrain doctor` names a real input-bound run: the training data is a named pipe that a
# writer refills 2 s after each epoch has read it (a slow network file system, a starved
# reader): every epoch's first step waits for data, about 1.1 s against 0.9 s of compute per
# epoch. The same data from a regular file must show no input finding.
# usage: input_bound.sh <bertrain binary>
set -euo pipefail
BT=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DATA=$ROOT/tests/data/tfrecord/bert_pretrain_sample_text.tfrecord  # 60 records: 15 steps of 4
WORK=$(mktemp -d /tmp/bertrain-doctor.XXXXXX)
WRITER=""
trap '[ -n "$WRITER" ] && kill $WRITER 2>/dev/null; [ -z "${KEEP:-}" ] && rm -rf "$WORK"' EXIT
train() {  # data, output dir
  "$BT" train --model-config "$ROOT/configs/bert-tiny.json" --data "$1" --output "$2" \
    --steps 45 --log-every 1 --batch-size 4 --seq-len 128 --max-predictions 20 --threads 1 \
    > "$2.log" 2>&1 || { cat "$2.log"; exit 1; }
}
train "$DATA" "$WORK/file"
"$BT" doctor "$WORK/file" > "$WORK/file.txt"
if grep -q "find  input-bound" "$WORK/file.txt"; then
  echo "input_bound: reported on a run from a regular file:"; cat "$WORK/file.txt"; exit 1
fi
mkfifo "$WORK/slow.tfrecord"
(for _ in $(seq 1 10); do sleep 2; cat "$DATA" > "$WORK/slow.tfrecord" || exit 0; done) &
WRITER=$!
train "$WORK/slow.tfrecord" "$WORK/pipe"
"$BT" doctor "$WORK/pipe" | tee "$WORK/pipe.txt" | sed -n '/doctor: run/,$p'
grep -q "find  input-bound" "$WORK/pipe.txt" ||
  { echo "input_bound: not named"; grep "step time" "$WORK/pipe.log"; exit 1; }
grep -q -- "--readers" "$WORK/pipe.txt" || { echo "input_bound: the fix names no flag"; exit 1; }
echo "input_bound: ok ($(grep -o 'input wait [0-9.]*%' "$WORK/pipe.log") from the starved pipe;" \
  "$(grep -o 'input wait [0-9.]*%' "$WORK/file.log") from the file)"
