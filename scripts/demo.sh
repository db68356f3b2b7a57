#!/usr/bin/env bash
# The main job, end to end as far as bertrain goes today:
#   1. set up and build (installs missing Debian packages);
#   2. plan memory for BERT-base and pick the batch size that fits this machine;
#   3. load and verify a HuggingFace checkpoint (written by transformers, tests/golden);
#   4. initialise a BERT-mini and save it as a HuggingFace checkpoint, then verify it;
#   5. time fp32 training steps (forward + backward) of BERT-mini and report utilisation;
#   6. read Google BERT pretraining TFRecords: verify every CRC, then measure the pipeline.
# Output goes to demo-out/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BT=build/bertrain
OUT=demo-out
mkdir -p "$OUT"
mem_kib=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
budget="$((mem_kib / 1024 / 2))MiB"

echo; echo "== 1. memory plan for BERT-base pretraining, half of this machine's free memory ($budget)"
$BT estimate --model-config configs/bert-base.json --batch-size 32 --seq-len 128 --memory-budget "$budget"

echo; echo "== 2. a HuggingFace checkpoint (BertForPreTraining written by transformers)"
$BT inspect tests/golden/bert_pretrain

echo; echo "== 3. a fresh BERT-mini, saved as a HuggingFace checkpoint"
$BT init --model-config configs/bert-mini.json --output "$OUT/bert-mini-init" --seed 42
$BT inspect "$OUT/bert-mini-init" | tail -2

echo; echo "== 4. fp32 training-step speed of BERT-mini (forward + backward)"
$BT bench --model-config configs/bert-mini.json --batch-size 16 --seq-len 128 --steps 5
echo; echo "== 5. Google BERT pretraining records (create_pretraining_data.py output): verify and read"
$BT inspect --count tests/data/tfrecord/bert_pretrain_sample_text.tfrecord
$BT inspect --max-records 1 --max-values 12 tests/data/tfrecord/bert_pretrain_sample_text.tfrecord
$BT bench-input --data tests/data/tfrecord/bert_pretrain_sample_text.tfrecord --batch-size 16 --seconds 2
echo; echo "demo: done (outputs in $OUT/)"
