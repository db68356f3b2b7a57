#!/usr/bin/env bash
# Resume on another number of ranks, on one host (the multi-host version, after a host is lost,
# is tests/cluster/cluster_test.sh): 2 ranks x 2 -> 1 rank x 4 (global batch kept), then
# 1 -> 3 ranks x 2 (4 is not a multiple of 6: the global batch changes, with a warning); the
# examples of the epochs in progress are read once (--trace-input), the run reaches its end.
#   regrid_test.sh BERTRAIN [train flags...]   (e.g. --pack 3: the same with packed batches,
#   whose positions count instances)
source "$(dirname "$0")/prepared_run.sh"
EXTRA=("${@:2}")
fail() { echo "FAIL: $*"; exit 1; }
run() {  # run NP BATCH TRACE [flags...]
  local np=$1 batch=$2 trace=$3
  shift 3
  timeout 300 mpiexec -np "$np" --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$BT" train \
    --model-config "$ROOT/configs/bert-tiny.json" --data "$TMP/data/*.tfrecord" --output "$TMP/run" \
    --batch-size "$batch" --seq-len 64 --max-predictions 10 --steps 30 --optimizer adamw \
    --save-every 5 --keep-last 0 --trace-input "$TMP/$trace" ${EXTRA[@]+"${EXTRA[@]}"} "$@" >> "$TMP/log_$trace" 2>&1
}
run 2 2 a --stop-after-steps 10 || { cat "$TMP/log_a"; fail "2 ranks"; }
if [[ " ${EXTRA[*]-} " == *" --pack "* ]]; then
  grep -q "batch 2 packed rows x 2 ranks" "$TMP/log_a" || { cat "$TMP/log_a"; fail "not packed"; }
fi
run 1 4 b --stop-after-steps 10 --resume || { cat "$TMP/log_b"; fail "resume on 1 rank"; }
grep -q "resumed on 1 rank from a checkpoint of 2 ranks: global batch 4 kept (1 rank x 4 x 1 accumulation; it was 2 ranks x 2 x 1)" "$TMP/log_b" ||
  { cat "$TMP/log_b"; fail "no line on the kept global batch"; }
run 3 2 c --resume || { cat "$TMP/log_c"; fail "resume on 3 ranks"; }
grep -q "WARNING: the global batch changes from 4" "$TMP/log_c" || { cat "$TMP/log_c"; fail "no warning on the changed batch"; }
[ -f "$TMP/run/checkpoint-000030/model.safetensors" ] || fail "the run did not reach step 30"
grep -q "resumed on 3 ranks from a checkpoint of 1 rank" "$TMP/log_c" || { cat "$TMP/log_c"; fail "no regrid line"; }
# No example read twice within an epoch over the three runs (each run's steps follow the last).
python3 - "$TMP" << 'PY' || fail "an example was read twice within an epoch"
import collections, glob, sys
seen = collections.defaultdict(collections.Counter)
for name, lo, hi in (("a", 0, 10), ("b", 10, 20), ("c", 20, 30)):
    for path in glob.glob(f"{sys.argv[1]}/{name}.rank-*"):
        for line in open(path):
            step, epoch, fp = line.split()
            if lo <= int(step) < hi:
                seen[int(epoch)][fp] += 1
twice = {e: [fp for fp, n in c.items() if n > 1] for e, c in seen.items()}
twice = {e: v for e, v in twice.items() if v}
assert not twice, twice
print("epochs", sorted(seen), "examples", [sum(c.values()) for _, c in sorted(seen.items())])
PY
echo ok
