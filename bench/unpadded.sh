#!/usr/bin/env bash
# Padding computed vs skipped vs packed, on real prepared data: the demo corpus (the CLUE sample,
# Chinese documents of a few hundred characters) prepared at 128 and at 512 tokens, so each batch
# has the real lengths Google's create_pretraining_data gives it (most rows full at 128, most rows
# less than half full at 512). For each config and length, `bertrain bench --padding both --pack 3`
# runs the same batches padded and unpadded in one process, then as many batches of packed rows
# (up to 3 instances a row, as train --pack 3 reads them): real tokens/s each, and the ratios; the
# PyTorch peer (bench/peer_pytorch.py: HF BertForPreTraining, which computes the padding, as HF
# does by default) runs the same shape, and its real tokens/s is its step rate times the real
# tokens of our batches (an HF step costs the same whatever the mask holds).
#   bench/unpadded.sh [configs...]      (default: bert-small and bert-base)
#   PY=/path/to/python-with-torch-and-transformers (skipped without torch); BATCH, THREADS,
#   STEPS, WARMUP, PACK as below; LENGTHS="128 512".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
THREADS=${THREADS:-2}
B=${BATCH:-8}
STEPS=${STEPS:-12}
WARMUP=${WARMUP:-1}
PACK=${PACK:-3}
LENGTHS=${LENGTHS:-128 512}
CONFIGS=${*:-configs/bert-small.json configs/bert-base.json}
BT=build/bertrain
DATA=${BENCH_UNPADDED_DATA:-/tmp/bertrain_bench_unpadded}
field() { python3 -c "import json,sys; print(json.loads(sys.argv[2])[sys.argv[1]])" "$1" "$2"; }
have_torch=0
"$PY" -c "import torch, transformers" 2>/dev/null && have_torch=1
echo "# CPU: $($BT bench --model-config configs/bert-tiny.json --batch-size 1 --seq-len 8 --max-predictions 1 --steps 1 --warmup 0 | sed -n 's/^  cpu *//p')"
echo "# bertrain $(git rev-parse --short HEAD 2>/dev/null || echo ?), threads $THREADS, batch $B, $STEPS batches timed after an untimed pass$([ $have_torch = 1 ] && "$PY" -c "import torch; print(', PyTorch', torch.__version__)")"
printf "%-24s %5s %6s %13s %13s %8s %12s %7s %8s %13s %9s\n" config seq real "padded t/s" "unpadded t/s" speedup \
  "packed t/s" "filled" speedup "pytorch t/s" "vs torch"
for seq in $LENGTHS; do
  preds=$((seq * 20 / 128))
  if [ ! -f "$DATA/$seq/part-00000-of-00001.tfrecord" ]; then
    $BT prepare --input data/corpus/zh_CLUECorpusSmall_bert_sampled.txt \
      --vocab data/vocab/bert-base-chinese-vocab.txt --output "$DATA/$seq" \
      --seq-len "$seq" --max-predictions "$preds" --dupe-factor 1 --output-shards 1 >/dev/null 2>&1
  fi
  for cfg in $CONFIGS; do
    out=$($BT bench --model-config "$cfg" --data "$DATA/$seq/*.tfrecord" --batch-size "$B" --seq-len "$seq" \
      --max-predictions "$preds" --threads "$THREADS" --steps "$STEPS" --warmup "$WARMUP" --padding both --pack "$PACK" --json)
    padded=$(echo "$out" | sed -n 1p); unpadded=$(echo "$out" | sed -n 2p); packed=$(echo "$out" | sed -n 3p)
    p=$(field tokens_per_s "$padded"); u=$(field tokens_per_s "$unpadded"); k=$(field tokens_per_s "$packed")
    filled=$(field real_token_fraction "$packed")
    real=$(field real_token_fraction "$unpadded")
    torch_tps="-"; vs="-"
    if [ $have_torch = 1 ]; then
      pt=$("$PY" bench/peer_pytorch.py --model-config "$cfg" --batch-size "$B" --seq-len "$seq" \
        --max-predictions "$preds" --threads "$THREADS" --steps "$STEPS" --warmup 1 2>/dev/null | tail -1)
      torch_tps=$(python3 -c "print(round($(field tokens_per_s "$pt") * $real))")
      vs=$(python3 -c "print(f'{max($u, $k) / $torch_tps:.2f}x')")
    fi
    printf "%-24s %5s %5.0f%% %13.0f %13.0f %7.2fx %12.0f %6.0f%% %7.2fx %13s %9s\n" "$cfg" "$seq" \
      "$(python3 -c "print(100*$real)")" "$p" "$u" "$(python3 -c "print($u/$p)")" "$k" \
      "$(python3 -c "print(100*$filled)")" "$(python3 -c "print($k/$p)")" "$torch_tps" "$vs"
  done
done
