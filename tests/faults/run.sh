#!/usr/bin/env bash
# Fault injection: bertrain's promise is that nothing is lost and nothing hangs. Each case is a
# row of data (kind, where/when, ranks, precision, expected outcome) run against the real binary;
# the suite ends with a table of faults injected, runs survived and data lost (must be 0).
#
#   tests/faults/run.sh BERTRAIN [--full]
#
# Kinds:
#   sigterm   SIGTERM/SIGINT at a random moment of a run (1 or 2 ranks, every precision):
#             exit 0 with a checkpoint; resumed to the end, the model equals an uninterrupted
#             run's bit for bit.
#   sigkill   SIGKILL of one rank of 2: the other exits within --stall-timeout naming it; the
#             run resumes from the last complete checkpoint. Also SIGTERM to one rank while its
#             peer hangs (SIGSTOP): the job ends within the 5 s stop grace, not the stall timeout.
#   diskfull  RLIMIT_FSIZE at a random byte offset of a checkpoint write: a clear error, the
#             previous checkpoint intact, `latest` unchanged.
#   ckpt      corrupt checkpoints (truncated, flipped header bytes, offsets past the end,
#             malformed trainer_state.json / config.json, another model's checkpoint): a clear
#             error naming the file, never a crash.
#   input     corrupt inputs (vocab: empty, duplicate tokens, missing specials; TSV: ragged rows,
#             unknown labels, BOM, CRLF; non-UTF-8 text): success or a clear error, never a crash.
# A crash is an exit by signal (134 abort, 139 segfault), a sanitizer report or a hang; a "clear
# error" is exit 1 with a "bertrain: error:" line. --full raises the random SIGTERM count to 50
# per precision (the default, run by ctest, is a reduced set). Under an ASan/UBSan build
# (BERTRAIN_SANITIZE=ON) the same cases catch memory errors.
set -uo pipefail
BT=$(readlink -f "$1")
FULL=0
[ "${2:-}" = --full ] && FULL=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d /tmp/bertrain-faults.XXXXXX)
trap 'rm -rf "$W"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}
N_SIGTERM=$((FULL ? 50 : 3))
N_SIGTERM_MPI=$((FULL ? 10 : 1))
N_SIGKILL=$((FULL ? 10 : 2))
N_DISK=$((FULL ? 20 : 4))
STEPS=24
# The kill cases strike 1-3 s into a 2-rank run: it must still be running then (24 steps of the
# tiny model took under 3 s in a CI run, and the kill found no process).
KILL_STEPS=80
RANDOM=${FAULT_SEED:-4242}

declare -A injected survived lost
failures=0
record() {  # kind ok(0/1) lost(0/1) message
  injected[$1]=$((${injected[$1]:-0} + 1))
  [ "$2" = 1 ] && survived[$1]=$((${survived[$1]:-0} + 1))
  [ "$3" = 1 ] && lost[$1]=$((${lost[$1]:-0} + 1))
  if [ "$2" != 1 ] || [ "$3" = 1 ]; then
    failures=$((failures + 1))
    echo "FAULT FAILED: $1: $4" >&2
  fi
}
crashed() {  # rc log: a signal exit or a sanitizer report
  [ "$1" -ge 128 ] || grep -qE 'AddressSanitizer|runtime error:|double free|corrupted|free\(\)' "$2"
}

# --- data: a small Chinese corpus prepared as the demo does -------------------------------------
head -c 400000 "$ROOT/data/corpus/zh_CLUECorpusSmall_bert_sampled.txt" > "$W/corpus.txt"
"$BT" prepare --input "$W/corpus.txt" --vocab "$ROOT/data/vocab/bert-base-chinese-vocab.txt" \
  --output "$W/data" --seq-len 64 --max-predictions 10 --dupe-factor 1 --output-shards 2 \
  >/dev/null 2>&1 || { echo "faults: prepare failed" >&2; exit 1; }
set -f  # the arguments built below carry globs for bertrain, not for the shell
CFG="$ROOT/configs/bert-tiny-zh.json"
PRECISIONS="fp32 fp16"
if "$BT" bench --model-config "$CFG" --batch-size 1 --seq-len 8 --max-predictions 1 --steps 1 \
  --warmup 0 --precision bf16 >/dev/null 2>&1; then
  PRECISIONS="fp32 fp16 bf16"
else
  echo "faults: bf16 cases skipped: this CPU has no bf16 matmul in oneDNN (it needs AVX-512)"
fi
train_args() {  # out precision [extra...]
  local out=$1 prec=$2
  shift 2
  echo --model-config "$CFG" --data "$W/data/*.tfrecord" --output "$out" --seq-len 64 \
    --max-predictions 10 --batch-size 8 --steps "${TSTEPS:-$STEPS}" --threads 1 --log-every 0 \
    --precision "$prec" --seed 7 "$@"
}
run_np() {  # ranks args...: bertrain train in the foreground
  local np=$1
  shift
  if [ "$np" = 1 ]; then "$BT" train "$@"; else
    mpirun -np "$np" --oversubscribe --bind-to none "$BT" train "$@"; fi
}
want() { [[ " ${FAULT_KINDS:-sigterm sigkill diskfull ckpt input} " == *" $1 "* ]]; }
model_of() { cat "$1/$(cat "$1/latest")/model.safetensors" 2>/dev/null | md5sum | cut -d' ' -f1; }

# --- sigterm ---------------------------------------------------------------------------------------
want sigterm && for np in 1 2; do
  for prec in $PRECISIONS; do
    # fp16 runs on the AVX2 code paths (oneDNN's JIT GEMM that once turned a SIGTERM into heap
    # corruption); the others on everything the CPU has.
    if [ "$prec" = fp16 ]; then export BERTRAIN_ISA=avx2; else unset BERTRAIN_ISA; fi
    ref="$W/ref-$np-$prec"
    # shellcheck disable=SC2046
    run_np "$np" $(train_args "$ref" "$prec") >"$ref.log" 2>&1 ||
      { echo "faults: reference run failed ($np ranks, $prec)" >&2; cat "$ref.log" >&2; exit 1; }
    want=$(model_of "$ref")
    n=$N_SIGTERM
    [ "$np" = 2 ] && n=$N_SIGTERM_MPI
    for i in $(seq "$n"); do
      out="$W/term-$np-$prec-$i"
      sig=TERM
      [ $((i % 4)) = 0 ] && sig=INT
      delay=$(awk -v r=$RANDOM 'BEGIN {printf "%.2f", 0.3 + 2.7 * r / 32767}')
      # shellcheck disable=SC2046
      if [ "$np" = 1 ]; then
        "$BT" train $(train_args "$out" "$prec") >"$out.log" 2>&1 &
      else
        mpirun -np 2 --oversubscribe --bind-to none "$BT" train $(train_args "$out" "$prec") \
          >"$out.log" 2>&1 &
      fi
      pid=$!
      sleep "$delay"
      if [ "$np" = 1 ]; then kill -$sig $pid 2>/dev/null; else pkill -$sig -P $pid 2>/dev/null; fi
      wait $pid
      rc=$?
      if crashed $rc "$out.log" || [ $rc != 0 ]; then
        record sigterm 0 1 "$np ranks $prec SIG$sig at ${delay}s: exit $rc ($(tail -2 "$out.log" | tr '\n' ' '))"
        continue
      fi
      # Resume to the end (a run the signal missed is already there) and compare.
      # shellcheck disable=SC2046
      run_np "$np" $(train_args "$out" "$prec" --resume) >>"$out.log" 2>&1
      rc=$?
      if [ $rc = 0 ] && [ "$(model_of "$out")" = "$want" ]; then
        record sigterm 1 0 ""
      else
        record sigterm 1 1 "$np ranks $prec SIG$sig at ${delay}s: resume exit $rc or a model that differs from the uninterrupted run"
      fi
    done
  done
done
unset BERTRAIN_ISA

# --- sigkill of one rank ---------------------------------------------------------------------------
want sigkill && for i in $(seq "$N_SIGKILL"); do
  out="$W/kill-$i"
  delay=$(awk -v r=$RANDOM 'BEGIN {printf "%.2f", 1.0 + 2.0 * r / 32767}')
  # shellcheck disable=SC2046
  mpirun -np 2 --oversubscribe --bind-to none "$BT" train $(TSTEPS=$KILL_STEPS train_args "$out" \
    fp32 --save-every 4 --stall-timeout 10) >"$out.log" 2>&1 &
  pid=$!
  sleep "$delay"
  victim=$(pgrep -P $pid -f "bertrain train" | tail -1)
  t0=$(date +%s)
  [ -n "$victim" ] && kill -KILL "$victim"
  wait $pid
  rc=$?
  took=$(($(date +%s) - t0))
  ok=1
  [ -n "$victim" ] || ok=0
  [ $rc != 0 ] || ok=0  # the job must fail, not report success
  [ $took -le 40 ] || ok=0
  grep -q 'rank\|exited on signal\|killed' "$out.log" || ok=0
  lost_=0
  if [ -f "$out/latest" ]; then
    # shellcheck disable=SC2046
    run_np 2 $(TSTEPS=$KILL_STEPS train_args "$out" fp32 --save-every 4 --resume) \
      >>"$out.log" 2>&1 || lost_=1
  fi
  record sigkill $ok $lost_ "rank pid ${victim:-none} killed at ${delay}s: exit $rc after ${took}s"
done

# --- SIGTERM while a peer hangs (SIGSTOP): the signalled rank waits a grace of 5 s in its
# collective, then ends the job instead of waiting for --stall-timeout (60 s here) ---------------
want sigkill && for i in $(seq $((FULL ? 3 : 1))); do
  out="$W/stalled-$i"
  # shellcheck disable=SC2046
  mpirun -np 2 --oversubscribe --bind-to none "$BT" train $(TSTEPS=$KILL_STEPS train_args "$out" \
    fp32 --save-every 4 --stall-timeout 60) >"$out.log" 2>&1 &
  pid=$!
  sleep 2
  ranks=$(pgrep -P $pid -f "bertrain train")
  hung=$(tail -1 <<<"$ranks")
  other=$(head -1 <<<"$ranks")
  t0=$(date +%s)
  [ -n "$hung" ] && kill -STOP "$hung" && sleep 0.5 && kill -TERM "$other"
  wait $pid
  rc=$?
  took=$(($(date +%s) - t0))
  ok=1
  [ -n "$hung" ] && [ "$hung" != "$other" ] || ok=0
  [ $rc != 0 ] || ok=0
  [ $took -le 30 ] || ok=0
  grep -q 'stopped by signal 15 while' "$out.log" || ok=0
  lost_=0
  if [ -f "$out/latest" ]; then
    # shellcheck disable=SC2046
    run_np 2 $(TSTEPS=$KILL_STEPS train_args "$out" fp32 --save-every 4 --resume) \
      >>"$out.log" 2>&1 || lost_=1
  fi
  record sigkill $ok $lost_ "SIGTERM with a stopped peer: exit $rc after ${took}s: $(grep -m1 'stopped by' "$out.log")"
done

# --- disk full during a checkpoint write --------------------------------------------------------------
base="$W/disk-base"
# shellcheck disable=SC2046
"$BT" train $(TSTEPS=4 train_args "$base" fp32) >"$base.log" 2>&1 || { echo "faults: base run failed" >&2; exit 1; }
# The largest file of a checkpoint: RLIMIT_FSIZE limits each file, so the fault lands in a write.
size=$(find "$base/$(cat "$base/latest")" -type f -printf '%s\n' | sort -n | tail -1)
want diskfull && for i in $(seq "$N_DISK"); do
  out="$W/disk-$i"
  cp -r "$base" "$out"
  prev=$(cat "$out/latest")
  before=$(cd "$out" && find "$prev" -type f -exec md5sum {} + | sort)
  limit_kib=$((1 + RANDOM * (size / 1024) / 32767))
  # shellcheck disable=SC2046
  (ulimit -f "$limit_kib"; exec "$BT" train $(TSTEPS=8 train_args "$out" fp32 --resume)) >"$out.log" 2>&1
  rc=$?
  after=$(cd "$out" && find "$prev" -type f -exec md5sum {} + | sort)
  ok=1
  lost_=0
  if crashed $rc "$out.log"; then ok=0; fi
  if [ $rc = 1 ]; then
    grep -q 'bertrain: error: could not save checkpoint .*the previous checkpoint is intact' "$out.log" || ok=0
    [ "$(cat "$out/latest")" = "$prev" ] || lost_=1
  elif [ $rc != 0 ]; then ok=0; fi
  [ "$before" = "$after" ] || lost_=1
  record diskfull $ok $lost_ "limit ${limit_kib} KiB: exit $rc ($(grep error "$out.log" | head -1))"
done

# --- corrupt checkpoints ------------------------------------------------------------------------------
good="$base/$(cat "$base/latest")"
ck_case() {  # name mutate-command (run in the copy's checkpoint dir) expected-substring
  local name=$1 mutate=$2 expect=$3 d="$W/ck-$1"
  cp -r "$base" "$d"
  (cd "$d/$(cat "$d/latest")" && set +f && eval "$mutate")
  # shellcheck disable=SC2046
  "$BT" train $(TSTEPS=8 train_args "$d" fp32 --resume) >"$d.log" 2>&1
  local rc=$?
  local ok=1
  crashed $rc "$d.log" && ok=0
  [ $rc = 1 ] || ok=0
  grep -q "bertrain: error:.*$expect" "$d.log" || ok=0
  record ckpt $ok 0 "$name: exit $rc, wanted an error naming '$expect': $(grep -m1 error "$d.log")"
}
msize=$(stat -c %s "$good/model.safetensors")
want ckpt && {
ck_case truncated "truncate -s $((msize / 2)) model.safetensors" model.safetensors
ck_case truncated-header "truncate -s 12 model.safetensors" model.safetensors
ck_case flipped-header "printf 'XX' | dd of=model.safetensors bs=1 seek=20 conv=notrunc status=none" model.safetensors
ck_case header-length "printf '\\xff\\xff\\xff\\x7f' | dd of=model.safetensors bs=1 seek=0 conv=notrunc status=none" model.safetensors
ck_case offsets-past-end "sed -i '1s/\"data_offsets\":\[0,/\"data_offsets\":[999999999,/' model.safetensors" model.safetensors
ck_case trainer-state "echo '{\"format\": ' > trainer_state.json" trainer_state.json
ck_case trainer-state-field "sed -i 's/\"step\": [0-9]*/\"step\": \"four\"/' trainer_state.json" trainer_state.json
ck_case config "echo '{' > config.json" config.json
ck_case optimizer "truncate -s 100 optimizer.safetensors" optimizer.safetensors
other="$W/other-model"
# shellcheck disable=SC2046
"$BT" train $(TSTEPS=1 train_args "$other" fp32 | sed "s#$CFG#$ROOT/configs/bert-mini.json#") >/dev/null 2>&1
ck_case other-model "rm -f *.safetensors config.json; cp $other/\$(cat $other/latest)/* ." "model.safetensors\|config.json\|shape\|differ"
}

# --- corrupt inputs -----------------------------------------------------------------------------------
VOCAB="$ROOT/data/vocab/bert-base-chinese-vocab.txt"
in_case() {  # name command... : success or a clear error, never a crash
  local name=$1
  shift
  "$@" >"$W/in-$name.log" 2>&1
  local rc=$?
  local ok=1
  crashed $rc "$W/in-$name.log" && ok=0
  if [ $rc != 0 ]; then
    [ $rc = 1 ] && grep -q 'bertrain: error:' "$W/in-$name.log" || ok=0
  fi
  record input $ok 0 "$name: exit $rc: $(tail -1 "$W/in-$name.log")"
}
: > "$W/vocab-empty.txt"
{ cat "$VOCAB"; sed -n 1000,1010p "$VOCAB"; } > "$W/vocab-dup.txt"
grep -v '^\[CLS\]$\|^\[SEP\]$\|^\[MASK\]$\|^\[UNK\]$' "$VOCAB" > "$W/vocab-nospecial.txt"
want input && {
for v in empty dup nospecial; do
  in_case "vocab-$v" "$BT" prepare --input "$W/corpus.txt" --vocab "$W/vocab-$v.txt" \
    --output "$W/prep-$v" --seq-len 32 --max-predictions 4 --dupe-factor 1
done
printf '\xff\xfe bad \xc3\x28 utf8 \xe2\x82\n\nmore text here\n' > "$W/bad-utf8.txt"
in_case non-utf8 "$BT" prepare --input "$W/bad-utf8.txt" --vocab "$VOCAB" --output "$W/prep-utf8" \
  --seq-len 32 --max-predictions 4 --dupe-factor 1
TSV="$ROOT/data/classification/chnsenticorp_small"
ft() {  # train.tsv
  "$BT" finetune --init-checkpoint "$ref" --vocab "$VOCAB" --train "$1" --dev "$TSV/dev.tsv" \
    --output "$W/ft-$(basename "$1")" --seq-len 32 --batch-size 8 --epochs 1 --threads 1
}
ref="$base"
head -40 "$TSV/train.tsv" > "$W/ok.tsv"
{ head -20 "$TSV/train.tsv"; printf '1\n'; printf '0\ta\tb\tc\td\n'; tail -n +21 "$W/ok.tsv"; } > "$W/ragged.tsv"
{ head -30 "$TSV/train.tsv"; printf 'maybe\t这个不好说\n'; } > "$W/unknown-label.tsv"
{ printf '\xef\xbb\xbf'; cat "$W/ok.tsv"; } > "$W/bom.tsv"
sed 's/$/\r/' "$W/ok.tsv" > "$W/crlf.tsv"
for t in ragged unknown-label bom crlf; do in_case "tsv-$t" ft "$W/$t.tsv"; done
# Records of another sequence length with --on-corrupt skip: once an endless loop (15 GB of
# stderr in 10 minutes, deaf to SIGTERM); now an error naming --seq-len, in seconds.
timeout 120 "$BT" train --model-config "$CFG" --data "$ROOT/tests/data/tfrecord/bert_pretrain_sample_text.tfrecord" \
  --output "$W/skip-all" --seq-len 64 --max-predictions 20 --steps 5 --threads 1 --on-corrupt skip \
  >"$W/skip-all.log" 2>&1
rc=$?
ok=1
[ $rc = 1 ] && grep -q 'bertrain: error: no usable record in a whole epoch.*--seq-len' "$W/skip-all.log" || ok=0
[ "$(wc -l < "$W/skip-all.log")" -lt 40 ] || ok=0  # skip messages are rate-limited
record input $ok 0 "every record unusable under --on-corrupt skip: exit $rc (124: still looping)"
}

# --- summary ------------------------------------------------------------------------------------------
printf '\n%-10s %9s %9s %10s\n' fault injected survived "data lost"
for k in sigterm sigkill diskfull ckpt input; do
  printf '%-10s %9d %9d %10d\n' $k "${injected[$k]:-0}" "${survived[$k]:-0}" "${lost[$k]:-0}"
done
total=0
for k in "${!injected[@]}"; do total=$((total + injected[$k])); done
echo "faults: $total injected, $failures failed"
[ $failures = 0 ]
