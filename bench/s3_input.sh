#!/usr/bin/env bash
# Input from object storage vs local disk, on real prepared data (the Gutenberg sample, seq 128,
# 8 shards): `bench-input` from files, then from an S3 server (moto) at 0, 20 and 50 ms of round
# trip (tests/s3/s3proxy.py delays every byte by half of it each way: what tc netem would do,
# which this kernel lacks), default settings; then BERT-mini training for STEPS steps from each,
# with the share of the step spent waiting for input. The S3 server and the proxy are Python
# processes on the same cores as bertrain: the 0 ms row is their ceiling, the 20/50 ms rows
# against it show how much of the latency the read-ahead hides.
#   bench/s3_input.sh [seconds per bench-input run] [training steps]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-8}
STEPS=${2:-40}
BT=$(realpath build/bertrain)
WORK=$(mktemp -d)
source tests/s3/moto_env.sh
trap 'proxy_stop; moto_stop; rm -rf "$WORK"' EXIT
DATA=${BENCH_S3_DATA:-/tmp/bertrain_bench_s3_shards}
if [ ! -f "$DATA/part-00007-of-00008.tfrecord" ]; then
  $BT prepare --input "data/corpus/gutenberg/*.txt" --vocab data/vocab/bert-base-uncased-vocab.txt \
    --output "$DATA" --seq-len 128 --max-predictions 20 --output-shards 8 --dupe-factor 5 >/dev/null
fi
moto_start "$WORK"
moto_put "" "$DATA"/part-*.tfrecord
size=$(du -cb "$DATA"/part-*.tfrecord | tail -1 | cut -f1)
echo "data: 8 shards, $((size / 1000000)) MB of BERT pretraining records (seq 128), moto $MOTO_VERSION"

field() { python3 -c "import json,sys; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(eval('d' + sys.argv[1]))" "$1"; }
printf "\n%-22s %12s %9s %10s %10s %12s %10s\n" source "examples/s" "MB/s" "vs local" "requests" "mean req ms" "waited s"
local_rate=$($BT bench-input --data "$DATA/part-*.tfrecord" --seconds "$SECS" --json | field "['examples_per_s']")
printf "%-22s %12.0f %9s %10s\n" "local disk" "$local_rate" "" "1.00"
for rtt in 0 20 50; do
  proxy_start --rtt-ms "$rtt"
  j=$($BT bench-input --data "s3://data/part-*.tfrecord" --s3-endpoint "$PROXY_URL" --seconds "$SECS" --json)
  proxy_stop
  r=$(echo "$j" | field "['examples_per_s']")
  printf "%-22s %12.0f %9.1f %10.2f %10s %12.0f %10.2f\n" "s3, ${rtt} ms round trip" "$r" \
    "$(echo "$j" | field "['mb_per_s']")" "$(python3 -c "print($r / $local_rate)")" \
    "$(echo "$j" | field "['remote']['requests']")" "$(echo "$j" | field "['remote']['mean_request_ms']")" \
    "$(echo "$j" | field "['remote']['reader_wait_s']")"
done

echo; echo "BERT-mini training, batch 16, seq 128, $STEPS steps, 2 threads:"
train() {  # train NAME DATA [flags]
  local name=$1 data=$2
  shift 2
  $BT train --model-config configs/bert-mini.json --data "$data" --output "$WORK/run_$name" --batch-size 16 \
    --seq-len 128 --max-predictions 20 --steps "$STEPS" --save-every 0 "$@" > "$WORK/log_$name" 2>&1 ||
    { cat "$WORK/log_$name"; exit 1; }
  printf "%-22s %s\n" "$name" "$(grep -o 'step time .*' "$WORK/log_$name" | tail -1)"
}
train "local disk" "$DATA/part-*.tfrecord"
for rtt in 20 50; do
  proxy_start --rtt-ms "$rtt"
  train "s3, ${rtt} ms round trip" "s3://data/part-*.tfrecord" --s3-endpoint "$PROXY_URL"
  proxy_stop
done
