#!/usr/bin/env bash
# The memory plan (what `bertrain estimate` prints and the trainer allocates) against the
# measured peak resident memory of a whole training step, per model and precision: bench's
# peak RSS above what the process held before the model existed (the libraries), the plan, and
# their ratio. The tests check bert-mini and bert-small (tests/test_memory.cpp); this covers
# BERT-base (and anything else given).
#   bench/plan_vs_rss.sh [configs...]    (BATCH, SEQ, PREDS, THREADS, PRECISIONS as below)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BATCH:-8}
SEQ=${SEQ:-128}
PREDS=${PREDS:-20}
THREADS=${THREADS:-2}
PRECISIONS=${PRECISIONS:-fp32 bf16 fp16}
CONFIGS=${*:-configs/bert-mini.json configs/bert-small.json configs/bert-base.json}
echo "# batch $B x $SEQ ($PREDS predictions), $THREADS threads, one step after one warmup step"
printf "%-24s %-5s %10s %12s %12s %8s\n" config prec "plan MiB" "above MiB" "baseline" "above/plan"
for cfg in $CONFIGS; do
  for prec in $PRECISIONS; do
    j=$(build/bertrain bench --model-config "$cfg" --batch-size "$B" --seq-len "$SEQ" --max-predictions "$PREDS" \
      --threads "$THREADS" --precision "$prec" --steps 1 --warmup 1 --json 2>&1 | tail -1) || { echo "$cfg $prec: $j"; continue; }
    python3 - "$j" "$cfg" "$prec" <<'PYEOF'
import json, sys
j = json.loads(sys.argv[1])
plan = j["plan_bytes"] / 2**20
above = (j["peak_rss_bytes"] - j["baseline_rss_bytes"]) / 2**20
print(f"{sys.argv[2]:<24} {sys.argv[3]:<5} {plan:10.1f} {above:12.1f} {j['baseline_rss_bytes'] / 2**20:12.1f} {above / plan:8.3f}")
PYEOF
  done
done
