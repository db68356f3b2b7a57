#!/usr/bin/env bash
# The sharded optimizer (train --shard-optimizer, ZeRO stage 1) against the unsharded run and
# PyTorch, side by side in one script: BERT-base pretraining on RANKS ranks of this machine
# (BATCH sequences of SEQ tokens per rank), and PyTorch (HF BertForPreTraining + AdamW, one
# process, bench/peer_pytorch.py) on the same global batch. Prints per-process peak RSS
# (bertrain: the largest rank's ru_maxrss from metrics.jsonl; PyTorch's own), the step time (median
# of the steps after the first two), and the
# ratios: sharded/PyTorch memory, sharded/unsharded throughput.
# PRECISION=bf16: both in bf16 (bertrain sharded: the fp32 master weights of the matmuls are
# sharded too; PyTorch: autocast).
#   PY=/path/to/python-with-torch-and-transformers bench/shard_memory.sh [config]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
CFG=${1:-configs/bert-base.json}
RANKS=${RANKS:-2}
B=${BATCH:-4}
SEQ=${SEQ:-128}
PREDS=${PREDS:-20}
STEPS=${STEPS:-4}
PRECISION=${PRECISION:-fp32}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
build/bertrain prepare --input data/corpus/bert_sample_text.txt --vocab data/vocab/bert-base-uncased-vocab.txt \
  --output "$TMP/data" --seq-len "$SEQ" --max-predictions "$PREDS" > /dev/null
last() {  # last() RUN FIELD: the field of the last metrics line
  python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])['$2'])" "$TMP/$1/metrics.jsonl"
}
most() {  # most RUN FIELD: the largest rank's value of a per-rank field of the last metrics line
  python3 -c "import json,sys; print(max(json.loads(open(sys.argv[1]).read().splitlines()[-1])['$2']))" "$TMP/$1/metrics.jsonl"
}
steady_ms() {  # steady_ms RUN: the median step time of the logged steps after the first two
  python3 -c "import json,statistics,sys; l=[json.loads(x)['time/step_ms'] for x in open(sys.argv[1]).read().splitlines()]; print(statistics.median(l[2:] or l))" "$TMP/$1/metrics.jsonl"
}
for mode in unsharded sharded; do
  flag=$([ $mode = sharded ] && echo --shard-optimizer || true)
  # shellcheck disable=SC2086
  mpiexec -np "$RANKS" --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/bertrain train \
    --model-config "$CFG" --data "$TMP/data/*.tfrecord" --output "$TMP/$mode" --batch-size "$B" \
    --seq-len "$SEQ" --max-predictions "$PREDS" --steps "$STEPS" --log-every 1 --optimizer adamw \
    --precision "$PRECISION" $flag > "$TMP/$mode.log" 2>&1 || { cat "$TMP/$mode.log"; exit 1; }
done
pt=$("$PY" bench/peer_pytorch.py --model-config "$CFG" --batch-size $((B * RANKS)) --seq-len "$SEQ" \
  --max-predictions "$PREDS" --threads "$RANKS" --steps 3 --warmup 1 --precision "$PRECISION" 2>/dev/null | tail -1)
python3 - "$pt" "$(most unsharded rank_peak_rss_mib)" "$(most sharded rank_peak_rss_mib)" \
  "$(steady_ms unsharded)" "$(steady_ms sharded)" "$(most unsharded rank_plan_mib)" \
  "$(most sharded rank_plan_mib)" "$(most unsharded rank_pss_mib)" "$(most sharded rank_pss_mib)" \
  "$CFG" "$RANKS" "$B" "$SEQ" "$PRECISION" <<'PYEOF'
import json, sys
pt = json.loads(sys.argv[1])
rss_u, rss_s, ms_u, ms_s, plan_u, plan_s, pss_u, pss_s = map(float, sys.argv[2:10])
cfg, ranks, b, seq = sys.argv[10], int(sys.argv[11]), int(sys.argv[12]), int(sys.argv[13])
rss_pt = pt["peak_rss_bytes"] / 2**20
print(f"# {cfg}, {sys.argv[14]}: {ranks} ranks x batch {b} x {seq} tokens (PyTorch: one process, batch {ranks * b}, {ranks} threads)")
print("# PSS: shared pages (the gradients' MPI window, read by the peers) divided among the ranks")
print(f"{'run':<28} {'plan MiB':>9} {'peak RSS MiB':>13} {'PSS MiB':>9} {'step ms':>9}")
print(f"{'bertrain unsharded (most)':<28} {plan_u:9.0f} {rss_u:13.0f} {pss_u:9.0f} {ms_u:9.0f}")
print(f"{'bertrain sharded (most)':<28} {plan_s:9.0f} {rss_s:13.0f} {pss_s:9.0f} {ms_s:9.0f}")
print(f"{'PyTorch (one process)':<28} {'':>9} {rss_pt:13.0f} {'':>9} {pt['step_ms']:9.0f}")
print(f"sharded / PyTorch peak memory per process: {rss_s / rss_pt:.2f} by RSS, {pss_s / rss_pt:.2f} by PSS; "
      f"sharded / unsharded: {rss_s / rss_u:.2f}")
print(f"PSS / plan: unsharded {pss_u / plan_u:.3f}, sharded {pss_s / plan_s:.3f}")
print(f"throughput cost of sharding: {100 * (ms_s / ms_u - 1):+.1f}% step time")
PYEOF
