#!/usr/bin/env bash
# bertrain bench vs PyTorch (HF BertForPreTraining, bench/peer_pytorch.py) back to back, same
# config, batch, sequence length, threads; fp32 and bf16; full training steps (forward,
# backward, AdamW). Each side runs ROUNDS times, interleaved, and the best run of each counts
# (this machine's timings are noisy; the best is the least disturbed). Prints tokens/s, ratio,
# peak RSS of both and bertrain's model FLOP utilisation against the GEMM ceiling it measured.
#   PY=/path/to/python-with-torch-and-transformers bench/step_vs_pytorch.sh [configs...]
#   (SEQ=512 PREDS=80 for BERT's long-sequence phase; BATCH, THREADS, ROUNDS as below)
#   PRECISIONS="fp32 fp16" for CPUs without AVX-512: bertrain's fp16 storage mode runs against
#   PyTorch fp32 (PyTorch's bf16 autocast without AVX-512 is ~40x slower than its fp32: not a
#   mode anyone runs there). BERTRAIN_ISA=avx2 caps both sides at AVX2 (PyTorch through
#   ATEN_CPU_CAPABILITY, DNNL_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS), to measure an AVX2 CPU's
#   code paths on an AVX-512 machine.
#   BEFORE=/path/to/an/older/bertrain also runs that binary in the same rounds and prints its
#   tokens/s and the ratio this build / it (a change's speed, measured in one run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
B=${BATCH:-8}
SEQ=${SEQ:-128}
PREDS=${PREDS:-20}
PRECISIONS=${PRECISIONS:-fp32 bf16}
CONFIGS=${*:-configs/bert-mini.json configs/bert-small.json configs/bert-base.json}
if [ "${BERTRAIN_ISA:-}" = avx2 ]; then
  export ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
fi
best() { python3 -c "
import json,sys
runs=[json.loads(l.strip().splitlines()[-1]) for l in sys.stdin.read().split('\x1e') if l.strip()]
print(json.dumps(max(runs, key=lambda r: r['tokens_per_s'])))"; }
field() { python3 -c "import json,sys; print(json.loads(sys.stdin.read())['$1'])"; }
"$PY" -c "import torch; print('# PyTorch', torch.__version__, '| bertrain', '$(git rev-parse --short HEAD 2>/dev/null || echo ?)', '| threads $THREADS, batch $B x $SEQ ($PREDS predictions), best of $ROUNDS')"
echo "# CPU: $(build/bertrain bench --model-config configs/bert-tiny.json --batch-size 1 --seq-len 8 --max-predictions 1 --steps 1 --warmup 0 | sed -n 's/^  cpu *//p')"
BEFORE=${BEFORE:-}
printf "%-24s %-5s %12s %12s %7s %10s %10s %6s" config prec "bertrain t/s" "pytorch t/s" ratio "bt RSS" "pt RSS" "MFU"
[ -n "$BEFORE" ] && printf " %12s %8s" "before t/s" "/before"
echo
for cfg in $CONFIGS; do
  for prec in $PRECISIONS; do
    peer_prec=$([ "$prec" = bf16 ] && echo bf16 || echo fp32)  # fp16 storage vs PyTorch fp32
    bts=""; pts=""; ots=""
    for r in $(seq "$ROUNDS"); do
      bts+=$(build/bertrain bench --model-config "$cfg" --batch-size "$B" --seq-len "$SEQ" --max-predictions "$PREDS" --threads "$THREADS" --precision $prec --steps 4 --warmup 1 --json)$'\x1e'
      if [ -n "$BEFORE" ]; then
        ots+=$("$BEFORE" bench --model-config "$cfg" --batch-size "$B" --seq-len "$SEQ" --max-predictions "$PREDS" --threads "$THREADS" --precision $prec --steps 4 --warmup 1 --json)$'\x1e'
      fi
      pts+=$("$PY" bench/peer_pytorch.py --model-config "$cfg" --batch-size "$B" --seq-len "$SEQ" --max-predictions "$PREDS" --threads "$THREADS" --precision $peer_prec --steps 4 --warmup 1 2>/dev/null)$'\x1e'
    done
    bt=$(printf "%s" "$bts" | best); pt=$(printf "%s" "$pts" | best)
    b=$(echo "$bt" | field tokens_per_s); p=$(echo "$pt" | field tokens_per_s)
    printf "%-24s %-5s %12.0f %12.0f %6.2fx %9.0fM %9.0fM %5.0f%%" "$cfg" $prec "$b" "$p" "$(python3 -c "print($b/$p)")" \
      "$(echo "$bt" | field peak_rss_bytes | python3 -c "import sys; print(float(sys.stdin.read())/2**20)")" \
      "$(echo "$pt" | field peak_rss_bytes | python3 -c "import sys; print(float(sys.stdin.read())/2**20)")" \
      "$(echo "$bt" | field mfu | python3 -c "import sys; print(100*float(sys.stdin.read()))")"
    if [ -n "$BEFORE" ]; then
      o=$(printf "%s" "$ots" | best | field tokens_per_s)
      printf " %12.0f %7.3fx" "$o" "$(python3 -c "print($b/$o)")"
    fi
    echo
  done
done
