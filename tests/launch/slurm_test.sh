#!/usr/bin/env bash
# A real Slurm runs the sbatch script `bertrain launch --emit slurm` writes: munged, slurmctld and
# slurmd (Debian's slurm-wlm, munge) are started on this machine with a configuration of their
# own in a temporary directory, the 2-rank training job is submitted with sbatch, squeue shows
# it, srun --mpi=pmix starts the ranks (which check their Slurm variables against MPI and the
# job spec), and the job must complete with exit code 0 and a checkpoint. Then an elastic spec's
# script runs the supervisor in the allocation, which restarts the srun step after a rank is
# killed. Skips (exit 77) when not root or Slurm/munge are not installed. The daemons are stopped
# whatever happens.
#   tests/launch/slurm_test.sh BERTRAIN
set -u
BT=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
for tool in munged slurmctld slurmd sbatch squeue scontrol sinfo; do
  command -v "$tool" > /dev/null || { echo "SKIP: $tool not installed (scripts/setup.sh installs slurm-wlm and munge)"; exit 77; }
done
[ "$(id -u)" = 0 ] || { echo "SKIP: slurmd must run as root"; exit 77; }
TMP=$(mktemp -d /tmp/bertrain-slurm.XXXXXX)
chmod 755 "$TMP"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2> /dev/null; done
  sleep 1
  for p in "${PIDS[@]}"; do kill -9 "$p" 2> /dev/null; done
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$TMP"/*.log "$TMP"/job/*.out; do [ -f "$f" ] && { echo "== $f"; tail -20 "$f"; }; done
  exit 1
}
HOST=$(hostname -s)
PORT=$((20000 + RANDOM % 20000))
mkdir -p "$TMP/state" "$TMP/spool" "$TMP/job"
source "$ROOT/tests/launch/slurm_env.sh"
munge_start || fail "munged did not start"
CPUS=$(nproc)
MEM=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2))
cat > "$TMP/slurm.conf" << EOC
ClusterName=bertrain-test
SlurmctldHost=$HOST
SlurmdSpoolDir=$TMP/spool
SlurmdPidFile=$TMP/slurmd.pid
SlurmdLogFile=$TMP/slurmd.log
$(slurm_conf_common $PORT)
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOC
export SLURM_CONF=$TMP/slurm.conf
slurmctld -D -i -f "$SLURM_CONF" > "$TMP/slurmctld.out.log" 2>&1 &
PIDS+=($!)
slurmd -D -f "$SLURM_CONF" > "$TMP/slurmd.out.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 60); do
  state=$(sinfo -h -o %T 2> /dev/null | head -1)
  [ "$state" = idle ] && break
  sleep 1
done
[ "$state" = idle ] || fail "the node did not come up (state '$state')"
echo "slurm: $(sinfo -h -o '%P %D node(s) %T %c CPUs')"

# The job spec: 1 worker x 2 slots, training bert-tiny for 4 steps.
cat > "$TMP/job/slurm-2rank.yaml" << EOJ
name: slurm-2rank
workers: 1
slots_per_worker: 2
env:
  OMP_NUM_THREADS: "1"
command: train
flags:
  model-config: $ROOT/configs/bert-tiny.json
  data: $ROOT/tests/data/tfrecord/bert_pretrain_sample_text.tfrecord
  output: $TMP/job/run
  batch-size: 4
  seq-len: 128
  max-predictions: 20
  steps: 4
  log-every: 2
EOJ
"$BT" launch "$TMP/job/slurm-2rank.yaml" --emit slurm --output "$TMP/job" > /dev/null || fail "launch --emit slurm"
cd "$TMP/job" || fail "cd"
id=$(PATH="$(dirname "$BT"):$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 sbatch --parsable slurm-2rank.sbatch) \
  || fail "sbatch refused the script"
echo "slurm: submitted job $id"
squeue -h -j "$id" -o '%i %j %T %D node(s) %C CPUs' || fail "squeue does not know job $id"
state=$(slurm_job_end "$id")
echo "slurm: $(scontrol show job "$id" | grep -oE 'JobState=[A-Z_]+|ExitCode=[0-9:]+|NumTasks=[0-9]+' | tr '\n' ' ')"
[ "$state" = COMPLETED ] || fail "job $id ended $state"
out="$TMP/job/slurm-2rank-$id.out"
grep -q "MPI, 2 ranks" "$out" || fail "the job did not train on 2 ranks"
[ -f "$TMP/job/run/checkpoint-000004/model.safetensors" ] || fail "no checkpoint"
grep -q "JobId=$id .*JobState=COMPLETED" "$TMP/jobcomp.txt" || fail "not in the completion log"
grep "^step" "$out" | tail -1

# An elastic spec: the sbatch script (--no-kill) runs the supervisor in the allocation, each
# attempt an srun step on the nodes that answer (asked with overlapping one-task steps). A rank
# killed mid-run: the step fails, the node still answers and a checkpoint was written since the
# step began, so the supervisor restarts it from that checkpoint and the job completes. (One
# node here: a node's loss is tests/cluster/slurm_nodes_test.sh's.)
cat > "$TMP/job/slurm-elastic.yaml" << EOJ
name: slurm-elastic
workers: 1
slots_per_worker: 2
env:
  OMP_NUM_THREADS: "1"
command: train
elastic: {min_workers: 1, max_restarts: 2}
flags:
  model-config: $ROOT/configs/bert-tiny.json
  data: $ROOT/tests/data/tfrecord/bert_pretrain_sample_text.tfrecord
  output: $TMP/job/erun
  batch-size: 4
  seq-len: 128
  max-predictions: 20
  steps: 200
  save-every: 10
  log-every: 10
  stall-timeout: 10
EOJ
"$BT" launch "$TMP/job/slurm-elastic.yaml" --emit slurm --output "$TMP/job" > /dev/null || fail "launch --emit slurm (elastic)"
grep -q -- "--no-kill" "$TMP/job/slurm-elastic.sbatch" || fail "the elastic script lacks --no-kill"
id=$(PATH="$(dirname "$BT"):$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 sbatch --parsable slurm-elastic.sbatch) \
  || fail "sbatch refused the elastic script"
for _ in $(seq 600); do [ -e "$TMP/job/erun/checkpoint-000020" ] && break; sleep 0.1; done
pkill -9 -n -f "bertrain train .*$TMP/job/erun" || fail "no rank of the elastic job to kill"
state=$(slurm_job_end "$id")
out="$TMP/job/slurm-elastic-$id.out"
[ "$state" = COMPLETED ] || fail "elastic job $id ended $state"
grep -q "Slurm allocation $id: srun steps on its nodes that answer" "$out" || fail "the supervisor did not use the allocation"
grep -q "restart 1 of 2: the job ended with .* with every host answering" "$out" || fail "no restart after the killed rank"
grep -q "attempt 2 on 1 of 1 workers ($HOST), from checkpoint-" "$out" || fail "no second srun step"
[ -f "$TMP/job/erun/checkpoint-000200/model.safetensors" ] || fail "the elastic job did not reach step 200"
echo "slurm: elastic job $id: a rank killed, $(grep -m1 -o 'restart 1 of 2: [^;]*' "$out"), $(grep -m1 -o 'the job ended well after .*' "$out")"
echo ok
