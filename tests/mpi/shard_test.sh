#!/usr/bin/env bash
# train --shard-optimizer (ZeRO stage 1) as a user runs it, on 3 ranks (parts of unequal tensors):
# with the shm allreduce, AdamW and no clipping the arithmetic is that of the unsharded run, so
# every model file must be bit-identical to the unsharded run's (fp32, and fp16 with its scaler):
#   sharded 4 steps; sharded 2 + resume 2 (shards -> shards); sharded 2 + resume unsharded
#   (shards -> one file); unsharded 2 + resume sharded (one file -> shards).
# A missing shard file is a clear error on resume.
source "$(dirname "$0")/prepared_run.sh"
run() {  # run NAME [flags...]
  local name=$1
  shift
  timeout 300 mpiexec -np 3 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$BT" train \
    --model-config "$ROOT/configs/bert-tiny.json" --data "$TMP/data/*.tfrecord" --output "$TMP/$name" \
    --batch-size 2 --seq-len 64 --max-predictions 10 --steps "${STEPS:-4}" --optimizer adamw --max-grad-norm 0 \
    --allreduce shm --bucket-mb 1 "$@" >> "$TMP/log_$name" 2>&1
}
final() { echo "$TMP/$1/checkpoint-000004/model.safetensors"; }
same() {  # same NAME: its final model equals the unsharded run's
  cmp "$(final plain)" "$(final "$1")" || { cat "$TMP/log_$1"; echo "FAIL: $1 differs from the unsharded run"; exit 1; }
}
run plain || { cat "$TMP/log_plain"; echo "FAIL: unsharded run"; exit 1; }
run sharded --shard-optimizer --timeline "$TMP/trace.json" || { cat "$TMP/log_sharded"; echo "FAIL: sharded run"; exit 1; }
same sharded
grep -q "optimizer state sharded" "$TMP/log_sharded" || { cat "$TMP/log_sharded"; echo "FAIL: no sharding in the banner"; exit 1; }
ls "$TMP/sharded/checkpoint-000004/" | grep -q "optimizer.rank-00002-of-00003.safetensors" \
  || { ls "$TMP/sharded/checkpoint-000004/"; echo "FAIL: no shard files"; exit 1; }
grep -q "reduce-scatter bucket" "$TMP/trace.json" && grep -q "allgather parameters" "$TMP/trace.json" \
  || { echo "FAIL: no reduce-scatter / allgather spans in the timeline"; exit 1; }
# fp16 (the loss scaler's finite check runs on the parts' summed norms): also bit-identical.
run plain16 --precision fp16 || { cat "$TMP/log_plain16"; echo "FAIL: unsharded fp16 run"; exit 1; }
run sharded16 --precision fp16 --shard-optimizer || { cat "$TMP/log_sharded16"; echo "FAIL: sharded fp16 run"; exit 1; }
cmp "$(final plain16)" "$(final sharded16)" || { echo "FAIL: fp16 sharded differs from unsharded"; exit 1; }
for pair in "s2s --shard-optimizer:--shard-optimizer" "s2w --shard-optimizer:" "w2s :--shard-optimizer"; do
  name=${pair%% *}
  flags=${pair#* }
  first=${flags%%:*}
  second=${flags#*:}
  # shellcheck disable=SC2086
  run "$name" $first --stop-after-steps 2 || { cat "$TMP/log_$name"; echo "FAIL: $name first half"; exit 1; }
  # shellcheck disable=SC2086
  run "$name" $second --resume || { cat "$TMP/log_$name"; echo "FAIL: $name resumed"; exit 1; }
  grep -q "resumed from" "$TMP/log_$name" || { cat "$TMP/log_$name"; echo "FAIL: $name did not resume"; exit 1; }
  same "$name"
done
# A shard lost from the checkpoint: the resume names the gap instead of starting from zeros.
rm "$TMP/s2s/checkpoint-000004/optimizer.rank-00001-of-00003.safetensors"
STEPS=5 run s2s --shard-optimizer --resume && { echo "FAIL: resumed without a shard"; exit 1; }
grep -q "a shard file is missing" "$TMP/log_s2s" || { cat "$TMP/log_s2s"; echo "FAIL: no clear error for the missing shard"; exit 1; }
echo ok
