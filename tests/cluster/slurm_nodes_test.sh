#!/usr/bin/env bash
# An elastic job under a real Slurm whose nodes are test hosts (network namespaces, hosts.sh):
# slurmctld on h3, a slurmd on each of h0-h2 (nodes h0-h2, one CPU each), munge shared. The sbatch
# script `bertrain launch --emit slurm` writes for an elastic spec (min 2, max 3 workers) runs the
# supervisor in the allocation; the job trains on the three nodes (one srun step, --mpi=pmix);
# node h2 dies (every process on it killed, slurmd with them, its link down): the supervisor
# finds it no longer answers, restarts the step on h0-h1 from the last checkpoint, and the job
# completes. Skips (77) without root, network namespaces, mpirun or Slurm.
#   tests/cluster/slurm_nodes_test.sh build/bertrain
source "$(dirname "$0")/common.sh"
for tool in munged slurmctld slurmd sbatch scontrol sinfo srun; do
  command -v "$tool" > /dev/null || { echo "SKIP: $tool not installed (scripts/setup.sh installs slurm-wlm and munge)"; exit 77; }
done
PIDS=()
cleanup() { # (the daemons on the test hosts go with them)
  for p in "${PIDS[@]}"; do kill "$p" 2> /dev/null || true; done
  "$HOSTS" down "$CL" 2> /dev/null || true
  for p in "${PIDS[@]}"; do kill -9 "$p" 2> /dev/null || true; done
  [ -n "$KEEP" ] || rm -rf "$TMP"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$TMP"/*.log "$TMP"/job/*.out; do [ -f "$f" ] && { echo "--- $f"; grep -v "^step " "$f" | tail -25; }; done
  exit 1
}
chmod 755 "$TMP"
SLOTS=1 "$HOSTS" up "$CL" 4 # h0-h2 the nodes, h3 the controller
mapfile -t ADDR < <(awk '{print $1}' "$CL/hostfile")
on() { # HOST CMD...
  local h=$1
  shift
  "$HOSTS" exec "$CL" "$h" "$@"
}
mkdir -p "$TMP/state" "$TMP/job"
for n in h0 h1 h2; do mkdir -p "$TMP/spool/$n"; done
source "$ROOT/tests/launch/slurm_env.sh"
munge_start || fail "munged did not start"
PORT=$((20000 + RANDOM % 20000))
cat > "$TMP/slurm.conf" << EOC
ClusterName=bertrain-nodes
SlurmctldHost=h3(${ADDR[3]})
SlurmdSpoolDir=$TMP/spool/%n
SlurmdPidFile=$TMP/slurmd.%n.pid
SlurmdLogFile=$TMP/slurmd.%n.log
$(slurm_conf_common $PORT)
SlurmdTimeout=10
MessageTimeout=5
NodeName=h0 NodeAddr=${ADDR[0]} CPUs=1 RealMemory=2000 State=UNKNOWN
NodeName=h1 NodeAddr=${ADDR[1]} CPUs=1 RealMemory=2000 State=UNKNOWN
NodeName=h2 NodeAddr=${ADDR[2]} CPUs=1 RealMemory=2000 State=UNKNOWN
PartitionName=test Nodes=h[0-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOC
export SLURM_CONF=$TMP/slurm.conf
# ip netns exec mounts a sysfs of the namespace's own, without the cgroup file systems slurmd
# initialises its plugin from: the host's mounted again (v1 controllers, v2, or both) in each
# slurmd's own mount namespace.
findmnt -rn -o TARGET,FSTYPE,OPTIONS -t tmpfs,cgroup,cgroup2 | awk '$1 ~ "^/sys/fs/cgroup" {
  opts = $3; gsub(/(^|,)(rw|ro|relatime|nosuid|nodev|noexec|mode=[0-9]+)/, "", opts); sub(/^,/, "", opts)
  if ($2 == "tmpfs") print "mount -t tmpfs cgroup_root " $1
  else if ($2 == "cgroup") print "mkdir -p " $1 " && mount -t cgroup -o " opts " cgroup " $1
  else print "mkdir -p " $1 " && mount -t cgroup2 cgroup2 " $1
}' > "$TMP/cgroups.sh"
on h3 slurmctld -D -i -f "$SLURM_CONF" > "$TMP/slurmctld.out.log" 2>&1 &
PIDS+=($!)
for n in h0 h1 h2; do
  # Each node its own copy of the configuration, whose mpi.conf gives PMIx a directory of the
  # node's own (the nodes share this machine's /tmp, where steps' directories would collide).
  mkdir -p "$TMP/conf/$n" "$TMP/pmix/$n"
  cp "$SLURM_CONF" "$TMP/conf/$n/slurm.conf"
  echo "PMIxCliTmpDirBase=$TMP/pmix/$n" > "$TMP/conf/$n/mpi.conf"
  on "$n" sh -c '. "$0"; exec "$@"' "$TMP/cgroups.sh" \
    slurmd -D -N "$n" -f "$TMP/conf/$n/slurm.conf" > "$TMP/slurmd.$n.out.log" 2>&1 &
  PIDS+=($!)
done
for _ in $(seq 60); do
  idle=$(on h3 sinfo -h -t idle -o %D 2> /dev/null | head -1)
  [ "${idle:-0}" = 3 ] && break
  sleep 1
done
[ "${idle:-0}" = 3 ] || fail "the 3 nodes did not come up: $(on h3 sinfo -h -N -o '%N %T' 2>&1 | tr '\n' ' ')"
echo "slurm: $(on h3 sinfo -h -o '%P %D nodes (%N) %T')"

"$BT" prepare --input "$ROOT/data/corpus/bert_sample_text.txt" --vocab "$ROOT/data/vocab/bert-base-uncased-vocab.txt" \
  --output "$TMP/data" --seq-len 64 --max-predictions 10 --output-shards 3 > /dev/null 2>&1 || fail "prepare"
mca_env=$("$HOSTS" mca "$CL" | grep -v plm_rsh | sed 's/^\([^=]*\)=\(.*\)$/  \1: "\2"/')
cat > "$TMP/job/nodes.yaml" << EOJ
name: nodes
workers: 3
slots_per_worker: 1
env:
  OMP_NUM_THREADS: "1"
$mca_env
command: train
elastic: {min_workers: 2, max_workers: 3, max_restarts: 2}
flags:
  model-config: $ROOT/configs/bert-tiny.json
  data: "$TMP/data/*.tfrecord"
  output: $TMP/job/run
  global-batch: 12
  batch-size: 2
  seq-len: 64
  max-predictions: 10
  steps: 60
  save-every: 10
  log-every: 1
  stall-timeout: 10
EOJ
"$BT" launch "$TMP/job/nodes.yaml" --emit slurm --output "$TMP/job" > /dev/null || fail "launch --emit slurm"
cd "$TMP/job" || fail "cd"
id=$(on h3 env PATH="$(dirname "$BT"):$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  sbatch --parsable --chdir "$TMP/job" nodes.sbatch) || fail "sbatch refused the script"
echo "slurm: submitted job $id"
last_step() { tail -n 1 "$TMP/job/run/metrics.jsonl" 2> /dev/null | sed -n 's/.*"step": *\([0-9]*\).*/\1/p'; }
for _ in $(seq 600); do [ "$(last_step)" -ge 14 ] 2> /dev/null && break; sleep 0.2; done
[ "$(last_step)" -ge 14 ] 2> /dev/null || fail "the job did not reach step 14 on 3 nodes"
grep -q "attempt 1 on 3 of 3 workers (h0, h1, h2)" "$TMP/job/nodes-$id.out" || fail "not on the 3 nodes"
t0=$(date +%s.%N)
at=$(last_step)
"$HOSTS" kill "$CL" h2
"$HOSTS" cut "$CL" h2
state=$(slurm_job_end "$id" on h3)
out="$TMP/job/nodes-$id.out"
[ "$state" = COMPLETED ] || fail "job $id ended $state"
grep -q "attempt 2 on 2 of 3 workers (h0, h1), from checkpoint-" "$out" || fail "no restart on h0-h1"
[ -f "$TMP/job/run/checkpoint-000060/model.safetensors" ] || fail "the job did not reach step 60"
back=$(grep '"event":"restart"' "$TMP/job/run/metrics.jsonl" | head -1 |
  python3 -c "import json,sys; print(round(json.loads(sys.stdin.readline())['first_step_at'] - $t0, 1))" 2> /dev/null ||
  echo never)
[ "$back" != never ] || fail "no restart recorded in metrics.jsonl"
echo "ok: Slurm job $id on nodes h0-h2: node h2 lost at step $at, the supervisor restarted the srun step on h0-h1 ($(grep -m1 -o 'restart 1 of 2: [^;]*' "$out")), training again ${back} s after the loss; completed, checkpoint 60"
