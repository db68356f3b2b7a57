#!/usr/bin/env bash
# Data-parallel scaling across test hosts (tests/cluster/hosts.sh: network namespaces, one rank
# per host, Open MPI over TCP on veth links shaped to RATE Gbit/s with a token
# bucket): BERT pretraining steps on 1, 2 and 4 hosts, fp32 vs fp16 wire, overlap on/off. For each
# run: real tokens/s, step, exposed communication (medians after 2 warm-up steps), scaling
# efficiency against 1 host, and `bertrain plan`'s prediction for the same setting from the
# run's own compute (the calibration of the plan on separate hosts), at the nominal link speed
# and at the speed the allreduce alone reaches over those links (first, per host count, with
# MPI_Allreduce as the peer): on a small machine the CPUs moving TCP bytes bound the link.
# Every rank has OMP_NUM_THREADS=1; a machine with fewer cores than hosts shares them, which
# slows compute and is visible in the forward/backward columns (scaling then measures the CPU,
# not the network). Needs root.
#   HOSTS="1 2 4" RATES="10 25" WIRES="none fp16" OVERLAP="1 0" bench/cluster_scaling.sh [config]
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=${1:-configs/bert-small.json}
HOSTS=${HOSTS:-1 2 4}
RATES=${RATES:-10 25}
WIRES=${WIRES:-none fp16}
OVERLAP=${OVERLAP:-1 0}
B=${BATCH:-8}
SEQ=${SEQ:-128}
STEPS=${STEPS:-8}
BUCKET=${BUCKET:-16}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMP=$(mktemp -d)
CL="$TMP/cluster"
H=tests/cluster/hosts.sh
trap '"$H" down "$CL" 2> /dev/null || true; rm -rf "$TMP"' EXIT
build/bertrain prepare --input data/corpus/bert_sample_text.txt --vocab data/vocab/bert-base-uncased-vocab.txt \
  --output "$TMP/data" --seq-len "$SEQ" --max-predictions 20 --output-shards 4 > /dev/null
median() {
  python3 -c "
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][2:]
print(statistics.median(r[sys.argv[2]] for r in rows))" "$1" "$2"
}
echo "# $CFG, batch $B x $SEQ tokens per rank, 1 rank per host, $(nproc) cores, links shaped to RATE Gbit/s"
printf "%-5s %-5s %-5s %-7s %10s %9s %9s %9s %9s %7s %8s %9s %7s %10s\n" hosts gbit wire overlap "tokens/s" "step ms" \
  "fwd+bwd" "exposed" "planned" "ratio" "link" "planned" "ratio" "efficiency"
echo "# planned: bertrain plan from the run's own compute, first at the nominal link, then at the link the"
echo "# allreduce alone measured (Gbit/s); efficiency: tokens/s against n x 1 host's"
declare -A base
for rate in $RATES; do
  for n in $HOSTS; do
    "$H" up "$CL" "$n" > /dev/null
    for i in $(seq 0 $((n - 1))); do "$H" shape "$CL" "h$i" "$rate"; done
    # The peer first: the allreduce alone over the same links (MPI_Allreduce beside bertrain's
    # algorithms). Its hierarchical busbw at 128 MB is what the links deliver with this
    # machine's CPUs moving the bytes: the plan gets it as a second link speed.
    link=$rate
    if [ "$n" -gt 1 ]; then
      "$H" mpirun "$CL" -np "$n" --map-by ppr:1:node --bind-to none -x OMP_NUM_THREADS=1 \
        "$PWD/build/bench/bench_allreduce" 128 > "$TMP/peer_${rate}_$n.txt" 2>&1 || cat "$TMP/peer_${rate}_$n.txt"
      echo "#   allreduce alone, $n hosts at $rate Gbit/s (busbw GB/s; mpi = MPI_Allreduce, the peer):"
      grep -E "^ *bytes" "$TMP/peer_${rate}_$n.txt" | sed 's/^/#     /'
      grep -E "^ *[0-9]" "$TMP/peer_${rate}_$n.txt" | tail -2 | sed 's/^/#     /'
      link=$(grep -E "^ *134217728" "$TMP/peer_${rate}_$n.txt" | awk -v r="$rate" '{g = $NF * 8; print (g < r ? g : r)}')
    fi
    for wire in $WIRES; do
      for ov in $OVERLAP; do
        [ "$n" = 1 ] && { [ "$wire" = none ] && [ "$ov" = 1 ] || continue; }
        run="$TMP/run_${rate}_${n}_${wire}_${ov}"
        "$H" mpirun "$CL" -np "$n" --map-by ppr:1:node --bind-to none -x OMP_NUM_THREADS=1 "$PWD/build/bertrain" train \
          --model-config "$CFG" --data "$TMP/data/*.tfrecord" --output "$run" --batch-size "$B" --seq-len "$SEQ" \
          --max-predictions 20 --steps "$STEPS" --log-every 1 --optimizer adamw --allreduce hierarchical \
          --bucket-mb "$BUCKET" --compression "$wire" --overlap "$ov" > "$run.log" 2>&1 || { cat "$run.log"; exit 1; }
        m="$run/metrics.jsonl"
        fwd=$(median "$m" time/forward_ms); bwd=$(median "$m" time/backward_ms); opt=$(median "$m" time/optimizer_ms)
        step=$(median "$m" time/step_ms); exposed=$(median "$m" time/communication_exposed_ms)
        tps=$(median "$m" throughput/tokens_per_s)
        [ "$n" = 1 ] && base[$rate]=$tps
        plan() {
          build/bertrain plan --model-config "$CFG" --batch-size "$B" --seq-len "$SEQ" --forward-ms "$fwd" \
            --backward-ms "$bwd" --optimizer-ms "$opt" --hosts "$n" --ranks-per-host 1 --link-gbit "$1" \
            --latency-us 50 --allreduce hierarchical --compression "$wire" --bucket-mb "$BUCKET" --overlap "$ov" |
            tail -1 | awk '{print $4}'
        }
        planned=$(plan "$rate")
        planned_link=$(plan "$link")
        eff=$(python3 -c "print(f'{$tps / ($n * ${base[$rate]}):.2f}')")
        printf "%-5s %-5s %-5s %-7s %10.0f %9.0f %9.0f %9.0f %9.0f %6.2fx %8.1f %9.0f %6.2fx %10s\n" "$n" "$rate" \
          "$wire" "$ov" "$tps" "$step" "$(python3 -c "print($fwd + $bwd)")" "$exposed" "$planned" \
          "$(python3 -c "print($planned / $step)")" "$link" "$planned_link" "$(python3 -c "print($planned_link / $step)")" "$eff"
      done
    done
    "$H" down "$CL"
  done
done
