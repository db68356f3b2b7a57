#!/usr/bin/env bash
# `bertrain plan` against measured training steps: 2 ranks acting as 2 hosts on this machine
# (BERTRAIN_LOCAL_SIZE=1: hierarchical = the ring between host leaders; Open MPI over TCP on
# loopback only) with loopback shaped by tc's token bucket to each RATE, BERT-small pretraining.
# The plan gets the run's own per-rank compute (forward, backward, optimizer from metrics.jsonl)
# and predicts the step and its exposed communication; the table prints both and their ratio.
# Loopback is one device, so both directions of the ring share the one shaped queue: the link
# each rank sees is RATE / 2, which is what the plan is told.
# Needs root and iproute2 (tc); the shaping is removed on exit.
#   RATES="1 4" bench/plan_vs_measured.sh [config]      (Gbit/s; BATCH, SEQ, STEPS as below)
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=${1:-configs/bert-small.json}
RATES=${RATES:-1 4}
B=${BATCH:-8}
SEQ=${SEQ:-128}
STEPS=${STEPS:-8}
BUCKET=${BUCKET:-16}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMP=$(mktemp -d)
trap 'tc qdisc del dev lo root 2>/dev/null || true; rm -rf "$TMP"' EXIT
build/bertrain prepare --input data/corpus/bert_sample_text.txt --vocab data/vocab/bert-base-uncased-vocab.txt \
  --output "$TMP/data" --seq-len "$SEQ" --max-predictions 20 > /dev/null
# Median over the steps after the first two (warm-up) of a metrics.jsonl field.
median() {
  python3 -c "
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][2:]
print(statistics.median(r[sys.argv[2]] for r in rows))" "$1" "$2"
}
printf "%-10s %14s %14s %8s %16s %16s\n" link "measured step" "planned step" ratio "measured exposed" "planned exposed"
for rate in $RATES; do
  tc qdisc del dev lo root 2> /dev/null || true
  tc qdisc add dev lo root tbf rate "${rate}gbit" burst 4mb latency 100ms
  run="$TMP/run_$rate"
  mpirun -np 2 --oversubscribe --bind-to none --mca btl tcp,self --mca btl_tcp_if_include lo \
    -x OMP_NUM_THREADS=1 -x BERTRAIN_LOCAL_SIZE=1 build/bertrain train --model-config "$CFG" \
    --data "$TMP/data/*.tfrecord" --output "$run" --batch-size "$B" --seq-len "$SEQ" --max-predictions 20 \
    --steps "$STEPS" --log-every 1 --optimizer adamw --allreduce hierarchical --bucket-mb "$BUCKET" \
    > "$TMP/log_$rate" 2>&1 || { cat "$TMP/log_$rate"; exit 1; }
  tc qdisc del dev lo root
  m="$run/metrics.jsonl"
  fwd=$(median "$m" time/forward_ms); bwd=$(median "$m" time/backward_ms); opt=$(median "$m" time/optimizer_ms)
  step=$(median "$m" time/step_ms); exposed=$(median "$m" time/communication_exposed_ms)
  link=$(python3 -c "print($rate / 2)")
  out=$(build/bertrain plan --model-config "$CFG" --batch-size "$B" --seq-len "$SEQ" --forward-ms "$fwd" \
    --backward-ms "$bwd" --optimizer-ms "$opt" --hosts 2 --ranks-per-host 1 --link-gbit "$link" \
    --latency-us 50 --allreduce hierarchical --bucket-mb "$BUCKET" | tail -1)
  pstep=$(echo "$out" | awk '{print $4}'); pexp=$(echo "$out" | awk '{print $6}')
  printf "%-10s %11.0f ms %11.0f ms %7.2fx %13.0f ms %13.0f ms\n" "${rate}gbit" "$step" "$pstep" \
    "$(python3 -c "print($pstep / $step)")" "$exposed" "$pexp"
done
