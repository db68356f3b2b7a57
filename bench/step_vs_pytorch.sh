#!/usr/bin/env bash
# bertrain bench vs PyTorch (HF BertForPreTraining, bench/peer_pytorch.py) back to back, same
# config, batch, sequence length, threads; fp32 and bf16; prints tokens/s and the ratios.
#   PY=/path/to/python-with-torch-and-transformers bench/step_vs_pytorch.sh [configs...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
THREADS=${THREADS:-2}
CONFIGS=${*:-configs/bert-mini.json configs/bert-small.json configs/bert-base.json}
field() { python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['$1'])"; }
printf "%-24s %-5s %12s %12s %7s %10s %10s %6s\n" config prec "bertrain t/s" "pytorch t/s" ratio "bt RSS" "pt RSS" "MFU"
for cfg in $CONFIGS; do
  B=8
  for prec in fp32 bf16; do
    bt=$(build/bertrain bench --model-config "$cfg" --batch-size $B --seq-len 128 --threads "$THREADS" --precision $prec --steps 4 --warmup 1 --json)
    pt=$("$PY" bench/peer_pytorch.py --model-config "$cfg" --batch-size $B --seq-len 128 --threads "$THREADS" --precision $prec --steps 4 --warmup 1 2>/dev/null)
    b=$(echo "$bt" | field tokens_per_s); p=$(echo "$pt" | field tokens_per_s)
    printf "%-24s %-5s %12.0f %12.0f %6.2fx %9.0fM %9.0fM %5.0f%%\n" "$cfg" $prec "$b" "$p" "$(python3 -c "print($b/$p)")" \
      "$(echo "$bt" | field peak_rss_bytes | python3 -c "import sys; print(float(sys.stdin.read())/2**20)")" \
      "$(echo "$pt" | field peak_rss_bytes | python3 -c "import sys; print(float(sys.stdin.read())/2**20)")" \
      "$(echo "$bt" | field mfu | python3 -c "import sys; print(100*float(sys.stdin.read()))")"
  done
done
