#!/usr/bin/env bash
# bertrain's input pipeline vs TensorFlow's tf.data on the same BERT pretraining shards, the
# same cores (taskset), batch size, interleave and shuffle settings; prints examples/s and the
# ratio. Needs a Python with tensorflow: TF_PYTHON=/path/to/venv/bin/python.
#   bench/input_pipeline.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-10}
PY=${TF_PYTHON:-python3}
BT=build/bertrain
DATA=${BENCH_DATA:-/tmp/bertrain_bench_shards}
[ -d "$DATA" ] || python3 bench/make_bert_shards.py --out "$DATA" --shards 16 --records 4096
COMMON="--batch-size 32 --cycle-length 8 --block-length 256 --shuffle-buffer 1000 --seconds $SECONDS_EACH"
field() { python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['$1'])"; }
printf "%-6s %14s %16s %16s %8s %10s %10s\n" cores "bertrain ex/s" "tf.data ex/s" "tf.data vec" ratio "bt RSS" "tf RSS"
for cores in 1 2; do
  cpus=$(seq -s, 0 $((cores - 1)))
  bt=$(taskset -c "$cpus" $BT bench-input --data "$DATA/*.tfrecord" $COMMON --json)
  tf1=$(taskset -c "$cpus" "$PY" bench/peer_tfdata.py --data "$DATA/*.tfrecord" $COMMON 2>/dev/null)
  tf2=$(taskset -c "$cpus" "$PY" bench/peer_tfdata.py --data "$DATA/*.tfrecord" $COMMON --vectorized 2>/dev/null)
  b=$(echo "$bt" | field examples_per_s); t=$(echo "$tf1" | field examples_per_s); v=$(echo "$tf2" | field examples_per_s)
  brss=$(echo "$bt" | field peak_rss_bytes); trss=$(echo "$tf2" | field peak_rss_bytes)
  best=$(python3 -c "print(max($t, $v))")
  printf "%-6s %14.0f %16.0f %16.0f %7.1fx %9.0fM %9.0fM\n" "$cores" "$b" "$t" "$v" \
    "$(python3 -c "print($b / $best)")" "$(python3 -c "print($brss/2**20)")" "$(python3 -c "print($trss/2**20)")"
done
echo "ratio = bertrain / the faster tf.data variant, same cores and settings"
