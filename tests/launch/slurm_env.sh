# Sourced by the tests that start a real Slurm (tests/launch/slurm_test.sh on this machine,
# tests/cluster/slurm_nodes_test.sh on test hosts); the caller has TMP and a PIDS array.
#   munge_start              a key and a munged of their own (socket $TMP/munge.sock), its pid
#                            added to PIDS
#   slurm_conf_common PORT   the slurm.conf lines both use: root daemons on PORT and PORT+1,
#                            munge, plugins that need neither cgroups nor accounting, the
#                            controller's state and logs under $TMP
#   slurm_job_end ID [CMD...]  waits (up to 5 min) for job ID to end, scontrol run through CMD
#                            (a test host's, say); prints the state it ended in
munge_start() {
  dd if=/dev/urandom of="$TMP/munge.key" bs=1024 count=1 2> /dev/null
  chmod 400 "$TMP/munge.key"
  munged --force -S "$TMP/munge.sock" --key-file "$TMP/munge.key" --pid-file "$TMP/munged.pid" \
    --log-file "$TMP/munged.log" --seed-file "$TMP/munge.seed" || return 1
  PIDS+=("$(cat "$TMP/munged.pid")")
}

slurm_conf_common() {
  cat << EOC
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$1
SlurmdPort=$(($1 + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$TMP/munge.sock
StateSaveLocation=$TMP/state
SlurmctldPidFile=$TMP/slurmctld.pid
SlurmctldLogFile=$TMP/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$TMP/jobcomp.txt
MinJobAge=600
SlurmdParameters=config_overrides
EOC
}

slurm_job_end() {
  local id=$1 state=""
  shift
  for _ in $(seq 300); do
    state=$("$@" scontrol show job "$id" 2> /dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
    case "$state" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) break ;; esac
    sleep 1
  done
  echo "$state"
}
