#!/usr/bin/env bash
# A rank that stalls (sleeps) or exits before a collective: every rank must exit non-zero
# within the stall timeout (2 s here) plus a margin, with a message naming what happened.
set -u
BIN=$1
MODE=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$(date +%s)
out=$(timeout 60 mpiexec -np 2 --oversubscribe --bind-to none "$BIN" "$MODE" 2>&1)
rc=$?
elapsed=$(( $(date +%s) - start ))
echo "$out" | tail -8
echo "exit code $rc after $elapsed s"
[ $rc -ne 0 ] || { echo "FAIL: the job exited 0"; exit 1; }
[ $rc -ne 124 ] || { echo "FAIL: the job hung until the test timeout"; exit 1; }
[ $elapsed -le 20 ] || { echo "FAIL: took $elapsed s (stall timeout 2 s)"; exit 1; }
if [ "$MODE" = --stall-demo ]; then
  echo "$out" | grep -q "for rank(s) 1 on this host" || { echo "FAIL: no message naming rank 1"; exit 1; }
  echo "$out" | grep -q "of gradient bucket 3" || { echo "FAIL: no message naming the bucket"; exit 1; }
else
  echo "$out" | grep -qiE "rank 1|process rank 1|exited" || { echo "FAIL: no message naming the dead rank"; exit 1; }
fi
echo "ok"
