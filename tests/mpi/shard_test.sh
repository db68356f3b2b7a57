#!/usr/bin/env bash
# train --shard-optimizer (ZeRO stage 1) as a user runs it, on 3 ranks (parts of unequal tensors):
# with the shm allreduce, AdamW and no clipping the arithmetic is that of the unsharded run, so
# every model file must be bit-identical to the unsharded run's (fp32, fp16 with its scaler, and
# bf16 with the fp32 master weights sharded):
#   sharded 4 steps; sharded 2 + resume 2 (shards -> shards); sharded 2 + resume unsharded
#   (shards -> one file); unsharded 2 + resume sharded (one file -> shards).
# A missing shard file is a clear error on resume.
source "$(dirname "$0")/prepared_run.sh"
run() {  # run NAME [flags...]
  local name=$1
  shift
  timeout 300 mpiexec -np "${NP:-3}" --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$BT" train \
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
# bf16: the fp32 master weights of the matmuls are sharded too (each rank holds its part, the
# bf16 copy and the fp32-read tensors are all-gathered, model.safetensors is assembled from the
# shards' "master" parts): the arithmetic is still the unsharded run's, bit for bit.
# CPUs without oneDNN's bf16 matmul (AVX2 only) skip this part, with the reason.
bf16=yes
if ! "$BT" bench --model-config "$ROOT/configs/bert-tiny.json" --batch-size 2 --seq-len 16 --max-predictions 2 \
  --steps 1 --warmup 0 --precision bf16 > /dev/null 2> "$TMP/bf16_probe"; then
  grep -q "needs AVX-512" "$TMP/bf16_probe" || { cat "$TMP/bf16_probe"; echo "FAIL: bf16 bench"; exit 1; }
  echo "bf16 part skipped: $(cat "$TMP/bf16_probe")"
  bf16=no
fi
if [ $bf16 = yes ]; then
  run plainbf --precision bf16 || { cat "$TMP/log_plainbf"; echo "FAIL: unsharded bf16 run"; exit 1; }
  run shardedbf --precision bf16 --shard-optimizer || { cat "$TMP/log_shardedbf"; echo "FAIL: sharded bf16 run"; exit 1; }
  cmp "$(final plainbf)" "$(final shardedbf)" || { echo "FAIL: bf16 sharded master differs from unsharded"; exit 1; }
  grep -q "fp32 master weights sharded" "$TMP/log_shardedbf" || { cat "$TMP/log_shardedbf"; echo "FAIL: no master sharding in the banner"; exit 1; }
fi
resume_pairs() {  # resume_pairs PREFIX [flags of both halves...]: shards -> shards, shards -> one file, one file -> shards
  local prefix=$1
  shift
  for pair in "s2s --shard-optimizer:--shard-optimizer" "s2w --shard-optimizer:" "w2s :--shard-optimizer"; do
    name=$prefix${pair%% *}
    flags=${pair#* }
    first=${flags%%:*}
    second=${flags#*:}
    # shellcheck disable=SC2086
    run "$name" $first "$@" --stop-after-steps 2 || { cat "$TMP/log_$name"; echo "FAIL: $name first half"; exit 1; }
    # shellcheck disable=SC2086
    run "$name" $second "$@" --resume || { cat "$TMP/log_$name"; echo "FAIL: $name resumed"; exit 1; }
    grep -q "resumed from" "$TMP/log_$name" || { cat "$TMP/log_$name"; echo "FAIL: $name did not resume"; exit 1; }
  done
}
resume_pairs ""
for name in s2s s2w w2s; do same "$name"; done
if [ $bf16 = yes ]; then
  resume_pairs bf --precision bf16
  for name in s2s s2w w2s; do
    cmp "$(final plainbf)" "$(final "bf$name")" || { cat "$TMP/log_bf$name"; echo "FAIL: bf16 $name differs from the unsharded run"; exit 1; }
  done
  # The sharded master's checkpoint (a whole model.safetensors, 3 optimizer shards) continues on
  # 2 ranks, each holding its new part.
  NP=2 STEPS=6 run bfs2s --precision bf16 --shard-optimizer --resume \
    || { cat "$TMP/log_bfs2s"; echo "FAIL: bf16 sharded 3 -> 2 ranks"; exit 1; }
  grep -q "fp32 master weights sharded" "$TMP/log_bfs2s" && [ -f "$TMP/bfs2s/checkpoint-000006/model.safetensors" ] \
    || { cat "$TMP/log_bfs2s"; echo "FAIL: bf16 sharded 3 -> 2 ranks did not train on"; exit 1; }
fi
# A shard lost from the checkpoint: the resume names the gap instead of starting from zeros.
rm "$TMP/s2s/checkpoint-000004/optimizer.rank-00001-of-00003.safetensors"
STEPS=5 run s2s --shard-optimizer --resume && { echo "FAIL: resumed without a shard"; exit 1; }
grep -q "a shard file is missing" "$TMP/log_s2s" || { cat "$TMP/log_s2s"; echo "FAIL: no clear error for the missing shard"; exit 1; }
echo ok
