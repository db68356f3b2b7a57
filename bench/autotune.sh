#!/usr/bin/env bash
# --autotune against the best fixed setting of a sweep, on real prepared data (the demo corpus,
# the CLUE sample, at 128 tokens), on 1 rank (THREADS threads) and on 2 ranks (THREADS / 2 each,
# over MPI). Every setting autotune may choose is one run of the sweep: attention full/blocked x
# threads (1 rank) or x bucket size (2 ranks). Each run trains STEPS steps and counts the mean
# step time of the steps after the first log window (time/step_ms in metrics.jsonl: the steady
# state, primitives created and caches warm); the autotuned run is counted the same way, after its
# trials. Prints every run, the best fixed one and autotune's ratio to it (goal: within 5%).
#   bench/autotune.sh [config]     (default configs/bert-small.json; BATCH, STEPS, THREADS)
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=${1:-configs/bert-small.json}
B=${BATCH:-8}
STEPS=${STEPS:-30}
THREADS=${THREADS:-2}
BT=$(realpath build/bertrain)
DATA=${BENCH_UNPADDED_DATA:-/tmp/bertrain_bench_unpadded}/128
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ ! -f "$DATA/part-00000-of-00001.tfrecord" ]; then
  $BT prepare --input data/corpus/zh_CLUECorpusSmall_bert_sampled.txt \
    --vocab data/vocab/bert-base-chinese-vocab.txt --output "$DATA" \
    --seq-len 128 --max-predictions 20 --dupe-factor 1 --output-shards 1 >/dev/null 2>&1
fi
# Mean step time (ms) over the logged windows after the first.
steady() { python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])][1:]
print(sum(r['time/step_ms'] for r in rows)/len(rows))" "$1/metrics.jsonl"; }
run() {  # ranks threads out [train flags...]
  local ranks=$1 threads=$2 out=$3; shift 3
  local args=(--model-config "$CFG" --data "$DATA/*.tfrecord" --output "$WORK/$out" --batch-size "$B"
    --seq-len 128 --max-predictions 20 --steps "$STEPS" --log-every 5 --save-every 0 "$@")
  if [ "$ranks" = 1 ]; then
    OMP_NUM_THREADS=$threads $BT train "${args[@]}" --threads "$threads" > "$WORK/$out.log" 2>&1
  else
    mpirun -np "$ranks" --oversubscribe --bind-to none -x OMP_NUM_THREADS="$threads" $BT train "${args[@]}" > "$WORK/$out.log" 2>&1
  fi
  steady "$WORK/$out"
}
echo "# $CFG, batch $B x 128 per rank, $STEPS steps per run, bertrain $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
for ranks in 1 2; do
  per=$((ranks == 1 ? THREADS : THREADS / 2)); per=$((per > 0 ? per : 1))
  best=""; best_name=""
  echo "## $ranks rank(s), at most $per threads each"
  for att in full blocked; do
    if [ "$ranks" = 1 ]; then
      knobs=$(for t in $per $((per / 2)); do [ "$t" -ge 1 ] && echo "threads=$t"; done | sort -u)
    else
      knobs="bucket=16 bucket=64 bucket=256"
    fi
    for k in $knobs; do
      name="$att $k"
      if [ "${k%%=*}" = threads ]; then
        ms=$(run "$ranks" "${k#*=}" "r${ranks}_${att}_${k#*=}" --attention "$att")
      else
        ms=$(run "$ranks" "$per" "r${ranks}_${att}_${k#*=}" --attention "$att" --bucket-mb "${k#*=}")
      fi
      printf "  fixed   %-22s %8.1f ms per step\n" "$name" "$ms"
      if [ -z "$best" ] || python3 -c "import sys; sys.exit(0 if $ms < $best else 1)"; then best=$ms; best_name=$name; fi
    done
  done
  ms=$(run "$ranks" "$per" "r${ranks}_auto" --autotune)
  chose=$(grep -m1 "autotune: chose" "$WORK/r${ranks}_auto.log" | sed 's/.*chose //; s/ (the fastest.*//')
  printf "  autotune (%s) %8.1f ms per step\n" "$chose" "$ms"
  printf "  best fixed: %s %.1f ms; autotune / best = %.3f\n" "$best_name" "$best" "$(python3 -c "print($ms/$best)")"
done
