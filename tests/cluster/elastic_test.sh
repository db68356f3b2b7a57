#!/usr/bin/env bash
# The elastic supervisor on four test hosts (network namespaces, tests/cluster/hosts.sh), one
# rank each, Open MPI over TCP (ctest label "cluster"):
#   1. `bertrain launch job.yaml --run` (elastic: min 3, max 4 workers) trains; host h3 dies
#      mid-step (its processes killed, its link down, as a machine that is gone): the supervisor
#      restarts the job on h0-h2 from the last checkpoint, the global batch kept (24 = 4 x 2 x 3
#      = 3 x 2 x 4), within a bound measured and printed.
#   2. h3 comes back: the job checkpoints at the end of its step and grows to 4 workers; it
#      trains to the end and the supervisor exits 0.
#   3. The run's record: incidents.log, metrics.jsonl (a restart and a grow event, world size
#      4 -> 3 -> 4 over the steps), the report's marks on the curves, the doctor's elastic
#      finding (restarts, time lost, steps recomputed, the Young/Daly checkpoint interval).
#   4. Input: every example of every epoch read once (per-rank input traces split by attempt,
#      against an uninterrupted run's epochs), but the leftovers the re-divisions report.
#   5. The final model equals, bit for bit, the same history run by hand: resume the checkpoint
#      the supervisor restarted from on 3 hosts for the same steps, then on 4 to the end.
#   6. Hosts killed until fewer than min_workers answer: the supervisor stops naming them and
#      the checkpoint that stands.
#   7. Checkpoints in a bucket (moto on a fifth host, h4, which also runs the supervisor as an
#      MPIJob's launcher pod would): rank 0's host h0 is killed while checkpoint 20 is being
#      uploaded (its optimizer's PUTs answered 503): the job restarts on h1-h3 from the bucket's
#      latest commit (10), the lease passing from the dead attempt at once, and finishes; the
#      bucket holds every checkpoint committed and none half-visible.
# Skips (77) without root or network namespaces.
source "$(dirname "$0")/common.sh"
sup=""
trap '[ -n "$sup" ] && kill -9 $sup 2> /dev/null; "$HOSTS" down "$CL" 2> /dev/null || true; [ -n "$KEEP" ] || rm -rf "$TMP"' EXIT
fail() {
  echo "FAIL: $*"
  for f in "$TMP"/*.log; do echo "--- $f"; grep -v "^step " "$f" | tail -40; done
  exit 1
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
SLOTS=1 "$HOSTS" up "$CL" 5  # h0-h3 the job's; h4 a launcher and object store, as a pod
mapfile -t ADDR < <(awk '{print $1}' "$CL/hostfile")
WORKERS=("${ADDR[@]:0:4}")
"$BT" prepare --input "$ROOT/data/corpus/bert_sample_text.txt" --vocab "$ROOT/data/vocab/bert-base-uncased-vocab.txt" \
  --output "$TMP/data" --seq-len 64 --max-predictions 10 --output-shards 4 > /dev/null 2>&1 || fail "prepare"
STEPS=70
job() { # NAME HOSTS... : a job spec training into $TMP/NAME on those hosts
  local name=$1
  shift
  cat << EOF
name: $name
workers: $#
slots_per_worker: 1
hosts: [$(IFS=,; echo "$*")]
env: {OMP_NUM_THREADS: "1", OMPI_ALLOW_RUN_AS_ROOT: "1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM: "1"}
command: train
elastic: {min_workers: 3, max_workers: 4, max_restarts: 3}
flags:
  model-config: $ROOT/configs/bert-tiny.json
  data: "$TMP/data/*.tfrecord"
  output: $TMP/$name
  global-batch: 24
  batch-size: 2
  seq-len: 64
  max-predictions: 10
  steps: $STEPS
  save-every: 10
  keep-last: 0
  log-every: 1
  stall-timeout: 10
  trace-input: $TMP/$name.trace
EOF
}
supervise() { # SPEC LOG: bertrain launch --run in h0, in the background ($sup)
  "$HOSTS" exec "$CL" h0 env $("$HOSTS" mca "$CL") "$BT" launch "$1" --run --probe-seconds 1 \
    --probe-timeout 3 > "$2" 2>&1 &
  sup=$!
}
step_of_run() { # NAME: the last step logged
  tail -n 1 "$TMP/$1/metrics.jsonl" 2> /dev/null | python3 -c "import json,sys; print(json.loads(sys.stdin.read() or '{\"step\":0}')['step'])" 2> /dev/null || echo 0
}
wait_for() { # SECONDS CMD...: until CMD succeeds
  local until=$(($(date +%s) + $1))
  shift
  until "$@"; do [ "$(date +%s)" -lt $until ] || return 1; sleep 0.2; done
}

# 1. h3 dies mid-step, between checkpoints.
job el "${WORKERS[@]}" > "$TMP/el.yaml"
supervise "$TMP/el.yaml" "$TMP/el.log"
wait_for 120 test -e "$TMP/el/checkpoint-000020" || fail "no checkpoint 20"
wait_for 60 sh -c "[ \$(tail -n 1 $TMP/el/metrics.jsonl | grep -o '\"step\":[0-9]*' | cut -d: -f2) -ge 27 ]" ||
  fail "no step 27"
killed_at=$(date +%s.%N)
"$HOSTS" kill "$CL" h3
"$HOSTS" cut "$CL" h3
wait_for 120 grep -q '"event":"restart"' "$TMP/el/metrics.jsonl" || fail "no restart recorded"
grep -q "attempt 2 on 3 of 4 workers" "$TMP/el.log" || fail "the restart is not on the 3 hosts left"
grep -q "resumed on 3 ranks from a checkpoint of 4 ranks: global batch 24 kept" "$TMP/el.log" ||
  fail "the restart does not keep the global batch"
back=$(grep '"event":"restart"' "$TMP/el/metrics.jsonl" | python3 -c "import json,sys; print(json.loads(sys.stdin.readline())['first_step_at'])")
took=$(python3 -c "print(round($back - $killed_at, 1))")
echo "ok: h3 killed at step >= 27: the job runs on h0-h2 again ${took} s later (first step after the restart)"

# 2. h3 comes back: the job grows to 4 at the end of a step.
wait_for 60 sh -c "[ \$(tail -n 1 $TMP/el/metrics.jsonl | grep -o '\"step\":[0-9]*' | cut -d: -f2) -ge 45 ]" ||
  fail "the restarted job does not reach step 45"
"$HOSTS" restore "$CL" h3
wait_for 60 grep -q '"event":"grow"' "$TMP/el/metrics.jsonl" || fail "the job did not grow back to 4"
wait $sup || fail "the supervisor did not end well"
sup=""
grep -q "the job ended well after 3 attempts (1 restarts, 1 grown)" "$TMP/el.log" || fail "no good end"
[ -f "$TMP/el/checkpoint-$(printf %06d $STEPS)/model.safetensors" ] || fail "no final checkpoint"
echo "ok: h3 back: the job grew to 4 workers and trained to step $STEPS"

# 3. The record.
grep -q "elastic restart 1 of 3: host ${ADDR[3]} stopped answering" "$TMP/el/incidents.log" || fail "incidents.log lacks the restart"
grep -q "elastic grow 1: host ${ADDR[3]} answers: growing from 3 to 4 workers" "$TMP/el/incidents.log" || fail "incidents.log lacks the growth"
read -r S1 S2 LOST REDONE GROW < <(python3 - "$TMP/el/metrics.jsonl" << 'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ev = {r["event"]: r for r in rows if "event" in r}
sizes = [int(r["cluster/world_size"]) for r in rows if "event" not in r]
# 4 ranks, then 3 from the restart, then 4 from the growth
runs = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
assert runs == [4, 3, 4], f"world sizes over the steps: {runs}"
r, g = ev["restart"], ev["grow"]
assert r["world_size"] == 3 and r["from_world_size"] == 4 and g["world_size"] == 4 and g["from_world_size"] == 3
assert g["recomputed_steps"] == 0, g
assert r["recomputed_steps"] >= 7, r  # killed at step 27 or later, from checkpoint 20
print(r["step"], g["step"], round(r["lost_s"], 1), r["recomputed_steps"], round(g["lost_s"], 1))
PY
) || fail "metrics.jsonl's world size and events"
"$BT" doctor "$TMP/el" > "$TMP/doctor.log" 2>&1 || true
grep -q -E "elastic +1 restart" "$TMP/doctor.log" && grep -q "Young/Daly" "$TMP/doctor.log" ||
  fail "the doctor does not read the elastic run"
"$BT" report "$TMP/el" --output "$TMP/report.html" > /dev/null || fail "report"
grep -q "restart 1 of 3 at step $S1 on 3 ranks (was 4)" "$TMP/report.html" &&
  [ "$(grep -o "stroke-dasharray='4 3'" "$TMP/report.html" | wc -l)" = 4 ] ||
  fail "the report does not mark the restart and the growth on the loss and world-size curves"
echo "ok: restart at step $S1 ($LOST s from the last step before the failure to the first step after, $REDONE steps done again), growth at step $S2 ($GROW s from the last step on 3 to the first on 4): in incidents.log, metrics.jsonl (world size 4 -> 3 -> 4), the doctor"
grep -h "elastic" "$TMP/doctor.log" || true

# 4. Every example once per epoch. The reference: the same job uninterrupted on 4 ranks, past
# the epochs the first restart re-divided.
"$HOSTS" mpirun "$CL" -np 4 --host "$(IFS=,; echo "${WORKERS[*]/%/:1}")" --bind-to none -x OMP_NUM_THREADS=1 "$BT" train --model-config "$ROOT/configs/bert-tiny.json" \
  --data "$TMP/data/*.tfrecord" --output "$TMP/ref" --global-batch 24 --batch-size 2 --seq-len 64 --max-predictions 10 \
  --steps $((S1 + 12)) --trace-input "$TMP/ref.trace" > "$TMP/ref.log" 2>&1 || fail "the reference run"
python3 - "$TMP" "$S1" "$S2" << 'PY' || fail "examples per epoch"
import collections, glob, re, sys
tmp, s1, s2 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
starts, worlds = [0, s1, s2], [4, 3, 4]  # each attempt's first step and ranks
def owned(path):
    # A rank's file holds its attempts one after another. Segments: cut where the step goes back,
    # jumps, or reaches an attempt's first step; a step's lines are those of the last segment
    # that read it, if this rank was in the attempt that owns the step.
    rank = int(path.rsplit("-", 1)[1])
    segs, prev = [], None
    for line in open(path):
        step, epoch, fp = line.split()
        s = int(step)
        if prev is None or s < prev or s > prev + 1 or (s != prev and s in starts):
            segs.append([])
        segs[-1].append((s, int(epoch), fp))
        prev = s
    last = {}
    for i, seg in enumerate(segs):
        for x in seg:
            last[x[0]] = i
    for i, seg in enumerate(segs):
        for x in seg:
            a = max(k for k, v in enumerate(starts) if x[0] >= v)
            if last[x[0]] == i and rank < worlds[a]:
                yield x
per_attempt = [collections.defaultdict(collections.Counter) for _ in starts]
for p in glob.glob(f"{tmp}/el.trace.rank-*"):
    for s, e, fp in owned(p):
        a = max(i for i, x in enumerate(starts) if s >= x)
        per_attempt[a][e][fp] += 1
got = collections.defaultdict(collections.Counter)
for a in per_attempt:
    for e, c in a.items():
        got[e] += c
ref = collections.defaultdict(collections.Counter)
for p in glob.glob(f"{tmp}/ref.trace.rank-*"):
    for l in open(p):
        s, e, fp = l.split()
        ref[int(e)][fp] += 1
# How often an example may be in one epoch: as often as in any epoch of the reference (once,
# unless the data holds it twice).
most = collections.Counter()
for c in ref.values():
    most |= c
for e, c in got.items():
    twice = c - most
    assert not twice, f"epoch {e}: read more often than the data holds it: {dict(twice)}"
log = open(f"{tmp}/el.log").read()
banners = re.findall(r"data: (\d+) unread examples of epochs? (\d+)(?:\.\.(\d+))? re-divided over \d+ ranks in whole batches \(none read twice, none skipped(?:; (\d+) left over)?", log)
assert len(banners) == 2, banners  # the restart's, the growth's
# The restart (4 -> 3): the epochs it re-divided read as the uninterrupted run read them, but
# the leftover reported.
n, first, last, dropped = banners[0]
first, last, dropped = int(first), int(last or first), int(dropped or 0)
missing = 0
for e in range(first, last + 1):
    extra = got[e] - ref[e]
    assert not extra, f"epoch {e}: not in the uninterrupted run's epoch: {dict(extra)}"
    missing += sum((ref[e] - got[e]).values())
assert missing == dropped, f"epochs {first}..{last}: {missing} unread, the restart reported {dropped} left over"
# The growth (3 -> 4): the unread examples it re-divided are read after it, but the leftover.
n2, f2, l2, d2 = banners[1]
n2, f2, l2, d2 = int(n2), int(f2), int(l2 or f2), int(d2 or 0)
after = sum(sum(per_attempt[2][e].values()) for e in range(f2, l2 + 1))
assert after == n2 - d2, f"epochs {f2}..{l2}: {after} read after the growth, {n2} unread less {d2} left over expected"
print(f"ok: input: no example read twice in any of {len(got)} epochs; the restart's epochs {first}..{last} read as "
      f"the uninterrupted run read them but the {dropped} left over it reported; the growth's {n2} unread examples of epochs "
      f"{f2}..{l2} read after it but the {d2} left over")
PY

# 5. The same history by hand: checkpoint S1 on h0-h2 for S2-S1 steps, then on all four.
mkdir -p "$TMP/hand"
cp -r "$TMP/el/checkpoint-$(printf %06d "$S1")" "$TMP/hand/"
echo "checkpoint-$(printf %06d "$S1")" > "$TMP/hand/latest"
hand() { # NP HOSTS FLAGS...
  local np=$1 hosts=$2
  shift 2
  "$HOSTS" mpirun "$CL" -np "$np" --host "$hosts" --bind-to none -x OMP_NUM_THREADS=1 "$BT" train \
    --model-config "$ROOT/configs/bert-tiny.json" --data "$TMP/data/*.tfrecord" --output "$TMP/hand" --global-batch 24 \
    --batch-size 2 --seq-len 64 --max-predictions 10 --steps $STEPS --save-every 10 --keep-last 0 --resume "$@"
}
hand 3 "${ADDR[0]}:1,${ADDR[1]}:1,${ADDR[2]}:1" --stop-after-steps $((S2 - S1)) > "$TMP/hand1.log" 2>&1 || fail "by hand on 3"
hand 4 "${ADDR[0]}:1,${ADDR[1]}:1,${ADDR[2]}:1,${ADDR[3]}:1" > "$TMP/hand2.log" 2>&1 || fail "by hand on 4"
final=checkpoint-$(printf %06d $STEPS)
cmp "$TMP/el/$final/model.safetensors" "$TMP/hand/$final/model.safetensors" ||
  fail "the supervised run differs from the same resumes by hand"
echo "ok: the final model equals, bit for bit, resuming by hand from step $S1 on 3 hosts and from step $S2 on 4"

# 6. Fewer than min_workers: h2 and h3 die; the supervisor restarts once more and stops.
job low "${WORKERS[@]}" > "$TMP/low.yaml"
sed -i "s/steps: $STEPS/steps: 100000/" "$TMP/low.yaml"
supervise "$TMP/low.yaml" "$TMP/low.log"
wait_for 120 test -e "$TMP/low/checkpoint-000010" || fail "no checkpoint 10 in the second job"
for h in h2 h3; do "$HOSTS" kill "$CL" $h; "$HOSTS" cut "$CL" $h; done
wait_for 90 sh -c "! kill -0 $sup 2> /dev/null" || fail "the supervisor did not stop"
wait $sup && fail "the supervisor ended well below min_workers"
sup=""
grep -q "elastic: 2 of 4 hosts answer (not answering: ${ADDR[2]}, ${ADDR[3]}); the job needs at least 3 (elastic.min_workers): stopping. The last complete checkpoint (checkpoint-" "$TMP/low.log" ||
  fail "the stop does not say why"
echo "ok: h2 and h3 gone: the supervisor stopped: $(grep -o 'elastic: 2 of 4 hosts answer.*' "$TMP/low.log" | cut -c1-160)..."

# 7. A bucket for the checkpoints, and rank 0's host lost mid-upload.
source "$ROOT/tests/s3/moto_env.sh"
if ! (moto_ensure) > /dev/null 2>&1; then
  echo "SKIP (7. only): no moto venv and no PyPI to make one"
  exit 0
fi
"$HOSTS" restore "$CL" h2 && "$HOSTS" restore "$CL" h3
S4=${ADDR[4]}
"$HOSTS" exec "$CL" h4 env INITIAL_NO_AUTH_ACTION_COUNT=3 "$MOTO_VENV/bin/moto_server" -H 127.0.0.1 -p 9000 \
  > "$TMP/moto.log" 2>&1 &
in_h4() { "$HOSTS" exec "$CL" h4 "$@"; }
wait_for 30 in_h4 python3 -c "import socket; socket.create_connection(('127.0.0.1', 9000), 1)" 2> /dev/null ||
  fail "moto did not start in h4"
keys=$(in_h4 "$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" setup http://127.0.0.1:9000 data)
export AWS_ACCESS_KEY_ID=${keys% *} AWS_SECRET_ACCESS_KEY=${keys#* } AWS_REGION=us-east-1  # (check-run's)
echo '[{"match": "PUT /data/runs/b/checkpoint-000020/optimizer", "action": "503", "times": 6}]' > "$TMP/faults.json"
in_h4 python3 "$S3_TESTS/s3proxy.py" --listen 9001 --bind "$S4" --upstream 127.0.0.1:9000 --faults "$TMP/faults.json" \
  > "$TMP/proxy.log" 2>&1 &
wait_for 30 in_h4 python3 -c "import socket; socket.create_connection(('$S4', 9001), 1)" 2> /dev/null ||
  fail "the proxy did not start in h4"
job b "${WORKERS[@]}" | sed -e "s#output: .*#output: s3://data/runs/b#" -e "s#steps: $STEPS#steps: 40#" \
  -e "s#^env: {#env: {AWS_ACCESS_KEY_ID: \"${keys% *}\", AWS_SECRET_ACCESS_KEY: \"${keys#* }\", AWS_REGION: us-east-1, #" > "$TMP/b.yaml"
printf '  s3-endpoint: http://%s:9001\n  s3-retries: 12\n  stage-dir: %s\n' "$S4" "$TMP/stage_b" >> "$TMP/b.yaml"
"$HOSTS" exec "$CL" h4 env $("$HOSTS" mca "$CL") "$BT" launch "$TMP/b.yaml" --run --probe-seconds 1 --probe-timeout 3 \
  > "$TMP/b.log" 2>&1 &
sup=$!
wait_for 120 test -s "$TMP/faults.json.log" || fail "checkpoint 20's upload never began"
"$HOSTS" kill "$CL" h0
"$HOSTS" cut "$CL" h0
at_kill=$(in_h4 "$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" check-run http://127.0.0.1:9000 data runs/b) ||
  fail "the bucket right after the kill: $at_kill"
[[ "$at_kill" == "latest checkpoint-000010 committed 1 "* && "$at_kill" != *"orphans 0" ]] ||
  fail "not killed mid-upload (checkpoint 20 partly uploaded, 10 the latest commit): $at_kill"
wait $sup || fail "the supervisor of the bucket run did not end well"
sup=""
grep -q "attempt 2 on 3 of 4 workers (${WORKERS[1]}, ${WORKERS[2]}, ${WORKERS[3]}), from checkpoint-000010" "$TMP/b.log" ||
  fail "the restart is not on h1-h3 from the bucket's checkpoint 10"
grep -q "fetched .*checkpoint-000010 from s3://data/runs/b (its latest commit)" "$TMP/b.log" || fail "no fetch from the bucket"
grep -q "took over s3://data/runs/b/bertrain.lock from an earlier attempt of elastic job" "$TMP/b.log" ||
  fail "the lease did not pass to the restart"
after=$(in_h4 "$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" check-run http://127.0.0.1:9000 data runs/b) ||
  fail "the bucket after the run: $after"
[[ "$after" == "latest checkpoint-000040 committed 4 "*"orphans 0" ]] || fail "the bucket after the run: $after"
echo "ok: h0 (rank 0) killed mid-upload of checkpoint 20 ($at_kill): restarted on h1-h3 from the bucket's checkpoint 10, the lease passed on, finished: $after"
