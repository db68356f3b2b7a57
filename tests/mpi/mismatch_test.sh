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
echo ok
