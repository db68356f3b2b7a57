#!/usr/bin/env bash
# Ranks launched with different settings (here: batch size) must fail at start-up, every rank,
# with a message naming the rank that differs.
source "$(dirname "$0")/prepared_run.sh"
cat > "$TMP/run.sh" <<EOS
#!/usr/bin/env bash
B=8; [ "\$OMPI_COMM_WORLD_RANK" = 1 ] && B=4
exec "$BT" train --model-config "$ROOT/configs/bert-tiny.json" --data "$TMP/data/*.tfrecord" --output "$TMP/run" \
  --batch-size \$B --seq-len 64 --max-predictions 10 --steps 2 --threads 1
EOS
chmod +x "$TMP/run.sh"
out=$(timeout 120 mpiexec -np 2 --oversubscribe --bind-to none "$TMP/run.sh" 2>&1)
rc=$?
echo "$out" | grep -v "^\[" | tail -5
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { echo "FAIL: exit code $rc"; exit 1; }
echo "$out" | grep -q "rank(s) 1 run with another" || { echo "FAIL: no message naming rank 1"; exit 1; }

# --compression where nothing is compressed (shm within one node) is an error, not silently off.
out=$(timeout 120 mpiexec -np 2 --oversubscribe --bind-to none "$BT" train --model-config "$ROOT/configs/bert-tiny.json" \
  --data "$TMP/data/*.tfrecord" --output "$TMP/run2" --batch-size 8 --seq-len 64 --max-predictions 10 --steps 2 \
  --threads 1 --compression fp16 2>&1)
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { echo "FAIL: --compression fp16 under shm: exit code $rc"; exit 1; }
echo "$out" | grep -q -- "--compression fp16 would do nothing" || { echo "FAIL: no message for --compression under shm"; echo "$out"; exit 1; }
# ... and with the ring it compresses.
timeout 120 mpiexec -np 2 --oversubscribe --bind-to none "$BT" train --model-config "$ROOT/configs/bert-tiny.json" \
  --data "$TMP/data/*.tfrecord" --output "$TMP/run3" --batch-size 8 --seq-len 64 --max-predictions 10 --steps 2 \
  --threads 1 --compression fp16 --allreduce ring 2>&1 | grep -q "wire fp16" || { echo "FAIL: ring with fp16 wire"; exit 1; }
# A job its spec describes as 4 ranks (BERTRAIN_JOB, set by bertrain launch) started as 2: every
# rank stops before training and says which.
TRAIN=(train --model-config "$ROOT/configs/bert-tiny.json" --data "$TMP/data/*.tfrecord" --batch-size 8
       --seq-len 64 --max-predictions 10 --steps 2 --threads 1)
out=$(timeout 120 mpiexec -np 2 --oversubscribe --bind-to none -x BERTRAIN_JOB="bert-x ranks=4 per_host=4" \
  "$BT" "${TRAIN[@]}" --output "$TMP/run4" 2>&1)
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { echo "FAIL: a 4-rank job started as 2 ran: exit code $rc"; exit 1; }
echo "$out" | grep -q "job 'bert-x' was described with 4 ranks (1 workers x 4 slots), but Open MPI" \
  || { echo "$out"; echo "FAIL: no message for the job shape"; exit 1; }
[ -e "$TMP/run4/checkpoint-000002" ] && { echo "FAIL: the mis-launched job trained"; exit 1; }
# srun without an MPI plugin (Slurm's variables, no PMI; simulated): the rank does not train alone.
out=$(SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=1 SLURM_LOCALID=1 SLURM_STEP_NUM_NODES=1 SLURM_NODEID=0 \
  SLURM_STEP_TASKS_PER_NODE=2 timeout 120 "$BT" "${TRAIN[@]}" --output "$TMP/run5" 2>&1)
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { echo "FAIL: a Slurm task without MPI trained: exit code $rc"; exit 1; }
echo "$out" | grep -q "Slurm started 2 ranks (SLURM_STEP_NUM_TASKS=2 .*srun --mpi=pmix" \
  || { echo "$out"; echo "FAIL: no message for srun without an MPI plugin"; exit 1; }
echo ok
