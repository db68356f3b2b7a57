#!/usr/bin/env bash
# Object storage against a real S3 server (moto, which checks SigV4), through a fault-injecting
# proxy (s3proxy.py): listing across pages, ranged reads that equal the local file, a missing
# object, wrong credentials, 500 and 503 answers and connections cut mid-object (retried, same
# records), a store that keeps failing (a clear error), prepare from and to a bucket, training
# from a bucket with exact resume, and a gzip file read through ranged reads; run directories in
# a bucket (checkpoints committed through upload faults, resume, the lease) and a fine-tuned model
# published to one.
#   tests/s3/s3_test.sh build/bertrain      (exit 77: no moto, e.g. PyPI unreachable)
set -u
BT=$(realpath "$1")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TMP=$(mktemp -d)
source "$ROOT/tests/s3/moto_env.sh"
trap 'proxy_stop; moto_stop; rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
moto_start "$TMP"
echo "s3: moto $MOTO_VERSION at $MOTO_URL"

# Data: TFRecords prepared locally (one plain, one gzip), a text file for prepare.
"$BT" prepare --input "$ROOT/data/corpus/bert_sample_text.txt" --vocab "$ROOT/data/vocab/bert-base-uncased-vocab.txt" \
  --output "$TMP/local" --seq-len 64 --max-predictions 10 --output-shards 2 >/dev/null 2>&1 || fail "prepare"
cp "$ROOT/tests/data/tfrecord/tf_written/gzip.tfrecord.gz" "$TMP/local/"
moto_put "train/" "$TMP/local/"part-*.tfrecord "$TMP/local/gzip.tfrecord.gz" || fail "upload"
moto_put "text/" "$ROOT/data/corpus/bert_sample_text.txt" || fail "upload text"
# 1005 objects under pages/: the .tfrecord ones sort after the first 1000 keys (page 2).
"$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" fill "$MOTO_URL" data pages/k- 1005 || fail "fill"
moto_put "pages/" "$TMP/local/part-00000-of-00002.tfrecord" || fail "upload page 2"

S3="--s3-endpoint $MOTO_URL"
# 1. Listing, paginated: the one match lies on the second page.
out=$("$BT" inspect --count $S3 "s3://data/pages/*.tfrecord" 2>&1) || fail "listing: $out"
echo "$out" | grep -q "s3://data/pages/part-00000-of-00002.tfrecord: .* records" || fail "page 2 not listed: $out"
echo "ok: a glob over 1006 keys finds its match on the second page of ListObjectsV2"

# 2. Ranged reads equal the file: every record (JSON of every feature), plain and gzip.
for f in part-00000-of-00002.tfrecord part-00001-of-00002.tfrecord gzip.tfrecord.gz; do
  "$BT" inspect --max-values 100000 "$TMP/local/$f" > "$TMP/a.json" 2>/dev/null || fail "inspect $f"
  "$BT" inspect --max-values 100000 $S3 "s3://data/train/$f" > "$TMP/b.json" 2>/dev/null || fail "inspect s3 $f"
  sed -i "s|$TMP/local/||; s|s3://data/train/||" "$TMP/a.json" "$TMP/b.json"
  cmp -s "$TMP/a.json" "$TMP/b.json" || fail "$f from the store differs from the file"
done
echo "ok: every record of a plain and a gzip file read from the store equals the local file"

# 3. A missing object; a missing bucket; wrong credentials.
out=$("$BT" inspect --count $S3 "s3://data/train/nope.tfrecord" 2>&1) && fail "a missing object passed"
echo "$out" | grep -q "s3://data/train/nope.tfrecord: HTTP 404: no such object" || fail "missing object: $out"
out=$("$BT" inspect --count $S3 "s3://nobucket/train/*.tfrecord" 2>&1) && fail "a missing bucket passed"
echo "$out" | grep -q "NoSuchBucket: no bucket 'nobucket'" || fail "missing bucket: $out"
out=$(AWS_SECRET_ACCESS_KEY=wrong "$BT" inspect --count $S3 "s3://data/train/*.tfrecord" 2>&1) && fail "wrong credentials passed"
echo "$out" | grep -q "SignatureDoesNotMatch.*check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" || fail "wrong credentials: $out"
out=$(AWS_ACCESS_KEY_ID=AKIANOSUCHKEY0000000 "$BT" inspect --count $S3 "s3://data/train/part-00000-of-00002.tfrecord" 2>&1) &&
  fail "an unknown key passed"
echo "$out" | grep -q "HTTP 403.*check AWS_ACCESS_KEY_ID" || fail "unknown key: $out"
echo "ok: missing object, missing bucket, wrong secret, unknown key: each named, with the fix"

# 4. Faults through the proxy: 503 and 500 twice, a reply cut halfway, a connection reset;
# retried, and the records are the same. Small reads (64 KiB) so that cuts land mid-record.
proxy_start --faults "$TMP/faults.json"
cat > "$TMP/faults.json" <<JSON
[{"match": "GET /data/train/part-00000", "action": "503", "times": 2},
 {"match": "GET /data/train/part-00001", "action": "500", "times": 2},
 {"match": "GET /data/train/part-00000", "action": "cut", "times": 2},
 {"match": "GET /data/train/part-00001", "action": "reset", "times": 1},
 {"match": "GET /data/?", "action": "503", "times": 1}]
JSON
rm -f "$TMP/faults.json.log"
"$BT" train --model-config "$ROOT/configs/bert-tiny.json" --data "$TMP/local/part-*.tfrecord" --output "$TMP/run_local" \
  --batch-size 8 --seq-len 64 --max-predictions 10 --steps 12 --save-every 6 --read-chunk 0.0625 \
  --trace-input "$TMP/trace_local" > "$TMP/log_local" 2>&1 || { cat "$TMP/log_local"; fail "train from files"; }
"$BT" train --model-config "$ROOT/configs/bert-tiny.json" --data "s3://data/train/part-*.tfrecord" --output "$TMP/run_s3" \
  --batch-size 8 --seq-len 64 --max-predictions 10 --steps 12 --save-every 6 --read-chunk 0.0625 \
  --s3-endpoint "$PROXY_URL" --trace-input "$TMP/trace_s3" > "$TMP/log_s3" 2>&1 ||
  { cat "$TMP/log_s3"; fail "train from the store through faults"; }
for a in 503 500 cut reset; do grep -q "^$a " "$TMP/faults.json.log" || fail "fault $a never happened"; done
cmp -s "$TMP/trace_local.rank-0" "$TMP/trace_s3.rank-0" || fail "the examples read from the store differ"
echo "ok: 503 x2, 500 x2, 2 replies cut mid-body, a reset, a 503 on the listing: retried; the 12 steps read the same examples as from files"

# 5. Exact resume from the store: 6 steps, then resume to 12 = the same examples as 12 at once.
rm -rf "$TMP/run_s3"
"$BT" train --model-config "$ROOT/configs/bert-tiny.json" --data "s3://data/train/part-*.tfrecord" --output "$TMP/run_s3" \
  --batch-size 8 --seq-len 64 --max-predictions 10 --steps 12 --save-every 6 --stop-after-steps 6 \
  $S3 --trace-input "$TMP/trace_r1" > "$TMP/log_r1" 2>&1 || { cat "$TMP/log_r1"; fail "first half"; }
"$BT" train --model-config "$ROOT/configs/bert-tiny.json" --data "s3://data/train/part-*.tfrecord" --output "$TMP/run_s3" \
  --batch-size 8 --seq-len 64 --max-predictions 10 --steps 12 --save-every 6 --resume \
  $S3 --trace-input "$TMP/trace_r2" > "$TMP/log_r2" 2>&1 || { cat "$TMP/log_r2"; fail "resume"; }
cat "$TMP/trace_r1.rank-0" "$TMP/trace_r2.rank-0" | cmp -s - "$TMP/trace_local.rank-0" ||
  fail "a resumed run from the store read other examples"
echo "ok: stopped at step 6 and resumed from the store, the examples equal an uninterrupted run's"

# 6. A store that keeps failing: a clear error after the retries, naming the object.
proxy_stop
proxy_start --faults "$TMP/faults.json"
echo '[{"match": "GET /data/train/part-00000", "action": "503", "times": 100}]' > "$TMP/faults.json"
out=$("$BT" inspect --count --s3-endpoint "$PROXY_URL" --s3-retries 3 "s3://data/train/part-00000-of-00002.tfrecord" 2>&1) &&
  fail "a failing store passed"
echo "$out" | grep -q "s3://data/train/part-00000-of-00002.tfrecord (bytes 0-.*HTTP 503 SlowDown.*still failing after 3 attempts" ||
  fail "persistent 503: $out"
echo "ok: 503 on every attempt ends in: ${out#bertrain: error: }"
proxy_stop

# 7. prepare from a bucket to a bucket: the same shards as from the file to a folder.
"$BT" prepare --input "s3://data/text/bert_sample_text.txt" --vocab "$ROOT/data/vocab/bert-base-uncased-vocab.txt" \
  --output "s3://data/prepared" $S3 --seq-len 64 --max-predictions 10 --output-shards 2 > "$TMP/log_prep" 2>&1 ||
  { cat "$TMP/log_prep"; fail "prepare to the store"; }
for f in part-00000-of-00002.tfrecord part-00001-of-00002.tfrecord; do
  "$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" get "$MOTO_URL" data "prepared/$f" "$TMP/got_$f" || fail "download $f"
  cmp -s "$TMP/got_$f" "$TMP/local/$f" || fail "prepared/$f in the store differs from the local prepare"
done
ls "${TMPDIR:-/tmp}"/bertrain-upload-* >/dev/null 2>&1 && fail "staged uploads left behind"
echo "ok: prepare s3:// -> s3:// writes the same shards, byte for byte, as file -> folder"
# 8. Addressing and the oss:// alias: the bucket as a host name (bucket.localhost, which curl
# resolves to this machine), and oss:// with its OSS_* settings (the store speaks the S3 API).
out=$("$BT" inspect --count --s3-endpoint "http://localhost:$MOTO_PORT" --s3-addressing virtual \
  "s3://data/train/part-*.tfrecord" 2>&1) || fail "virtual-host addressing: $out"
[ "$(echo "$out" | grep -c ": .* records, .* all CRCs ok")" = 2 ] || fail "virtual-host listing: $out"
out=$(env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY OSS_ENDPOINT="$MOTO_URL" OSS_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" \
  OSS_ACCESS_KEY_SECRET="$AWS_SECRET_ACCESS_KEY" "$BT" inspect --count "oss://data/train/part-*.tfrecord" 2>&1) ||
  fail "oss://: $out"
echo "$out" | grep -q "oss://data/train/part-00001-of-00002.tfrecord: .* records" || fail "oss:// listing: $out"
out=$(env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY "$BT" inspect --count "oss://data/train/x.tfrecord" 2>&1) &&
  fail "oss:// without an endpoint passed"
echo "$out" | grep -q "set OSS_ENDPOINT" || fail "oss:// without an endpoint: $out"
echo "ok: virtual-host addressing (data.localhost), oss:// with OSS_ENDPOINT/OSS_ACCESS_KEY_*, oss:// without an endpoint named"

# 9. The AWS CLI's files instead of variables: a named profile's keys, its endpoint and region.
printf '[default]\naws_access_key_id = AKIAWRONGWRONGWRONG0\naws_secret_access_key = wrong\n\n[bt]\naws_access_key_id = %s\naws_secret_access_key = %s\n' \
  "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" > "$TMP/credentials"
printf '[profile bt]\nregion = us-east-1\nendpoint_url = %s\n' "$MOTO_URL" > "$TMP/config"
files=(env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_REGION AWS_SHARED_CREDENTIALS_FILE="$TMP/credentials"
  AWS_CONFIG_FILE="$TMP/config")
out=$("${files[@]}" AWS_PROFILE=bt "$BT" inspect --count "s3://data/train/part-00000-of-00002.tfrecord" 2>&1) ||
  fail "profile bt: $out"
out=$("${files[@]}" AWS_PROFILE=nobody "$BT" inspect --count "s3://data/train/part-00000-of-00002.tfrecord" 2>&1) &&
  fail "a missing profile passed"
echo "$out" | grep -q "AWS_PROFILE=nobody but .* has no aws_access_key_id for it" || fail "missing profile: $out"
echo "ok: keys, region and endpoint from ~/.aws/credentials and ~/.aws/config (AWS_PROFILE); a missing profile named"

# 10. A fine-tuning file from a bucket (the task readers: TSV here, JSON lines, CoNLL, SQuAD).
moto_put "tasks/" "$ROOT/data/classification/chnsenticorp_small/dev.tsv" || fail "upload the task file"
task=(prepare --vocab "$ROOT/data/vocab/bert-base-chinese-vocab.txt" --seq-len 64 --text-a-column text_a --label-column label)
"$BT" "${task[@]}" --input "$ROOT/data/classification/chnsenticorp_small/dev.tsv" --output "$TMP/task_local" \
  > /dev/null 2>&1 || fail "prepare the task file"
"$BT" "${task[@]}" --input "s3://data/tasks/dev.tsv" $S3 --output "$TMP/task_s3" > "$TMP/log_task" 2>&1 ||
  { cat "$TMP/log_task"; fail "prepare the task file from the store"; }
cmp -s "$TMP/task_local/part-00000-of-00001.tfrecord" "$TMP/task_s3/part-00000-of-00001.tfrecord" ||
  fail "the task file read from the store gave other examples"
echo "ok: a fine-tuning TSV read from the bucket gives the same examples as the file"
# 11. A run directory in the bucket (train --output s3://...). A BERT small enough that 50
# checkpoints are quick (hidden 16, one layer; the uncased vocabulary).
cat > "$TMP/micro.json" <<JSON
{"architectures": ["BertForPreTraining"], "model_type": "bert", "hidden_size": 16,
 "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32, "vocab_size": 30522,
 "max_position_embeddings": 64, "type_vocab_size": 2, "hidden_act": "gelu",
 "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "layer_norm_eps": 1e-12,
 "initializer_range": 0.02}
JSON
micro=(train --model-config "$TMP/micro.json" --data "$TMP/local/part-*.tfrecord" --batch-size 4
  --seq-len 64 --max-predictions 10 --log-every 10)
check_run() { "$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" check-run "$MOTO_URL" data "$1"; }
# a. 50 checkpoints uploaded through random faults on the uploads (503, 500, a reply cut, an
# upload cut midway, a connection reset): each retried; none half-visible, none lost.
"$BT" "${micro[@]}" --steps 50 --save-every 25 --output "$TMP/ref" > "$TMP/log_ref" 2>&1 ||
  { cat "$TMP/log_ref"; fail "the reference run"; }
"$MOTO_VENV/bin/python" - "$TMP/faults.json" <<'PY'
import json, random, sys
rng = random.Random(7)
files = ["model.safetensors", "optimizer.safetensors", "trainer_state.json", "config.json", "COMMIT"]
rules = [{"match": f"PUT /data/runs/f/checkpoint-{n:06d}/{rng.choice(files)}",
          "action": rng.choice(["503", "500", "cut", "cut-request", "reset"]), "times": 1}
         for n in range(1, 51) if rng.random() < 0.8]
rules += [{"match": "PUT /data/runs/f/latest", "action": "503", "times": 3}]
json.dump(rules, open(sys.argv[1], "w"))
PY
rm -f "$TMP/faults.json.log"
proxy_start --faults "$TMP/faults.json"
"$BT" "${micro[@]}" --steps 50 --save-every 1 --keep-last 0 --output s3://data/runs/f \
  --stage-dir "$TMP/stage_f" --s3-endpoint "$PROXY_URL" > "$TMP/log_f" 2>&1 ||
  { cat "$TMP/log_f"; fail "50 checkpoints to the bucket through faults"; }
proxy_stop
for a in 503 500 cut cut-request reset; do grep -q "^$a PUT" "$TMP/faults.json.log" || fail "fault $a never hit an upload"; done
faults=$(grep -c "PUT" "$TMP/faults.json.log")
out=$(check_run runs/f) || fail "the bucket's run: $out"
[[ "$out" == "latest checkpoint-000050 committed 50 "*"orphans 0" ]] || fail "after 50 uploads: $out"
"$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" get "$MOTO_URL" data runs/f/checkpoint-000050/model.safetensors "$TMP/f50.safetensors"
cmp -s "$TMP/f50.safetensors" "$TMP/ref/checkpoint-000050/model.safetensors" ||
  fail "the model committed to the bucket differs from the run's into a directory"
keys=$("$MOTO_VENV/bin/python" -c "
import boto3; s3 = boto3.client('s3', endpoint_url='$MOTO_URL', region_name='us-east-1')
print('\n'.join(o['Key'] for o in s3.list_objects_v2(Bucket='data', Prefix='runs/f/', Delimiter='/')['Contents']))")
grep -qx "runs/f/metrics.jsonl" <<<"$keys" && grep -q "^runs/f/events.out.tfevents" <<<"$keys" ||
  fail "metrics.jsonl and the TensorBoard events not uploaded: $keys"
echo "ok: 50 checkpoints to s3://data/runs/f through $faults injected upload faults: 50 committed, 0 half-visible, 0 lost; the last equals a local run's bit for bit"
# b. An outage that outlasts the retries mid-checkpoint: the run stops naming the object; the
# checkpoint before stays `latest`, the cut one has no COMMIT (invisible).
echo '[{"match": "PUT /data/runs/o/checkpoint-000004/optimizer", "action": "503", "times": 100}]' > "$TMP/faults.json"
proxy_start --faults "$TMP/faults.json"
out=$("$BT" "${micro[@]}" --steps 8 --save-every 2 --output s3://data/runs/o --stage-dir "$TMP/stage_o" \
  --s3-endpoint "$PROXY_URL" --s3-retries 2 2>&1) && fail "a run whose upload kept failing passed"
proxy_stop
echo "$out" | grep -q "runs/o/checkpoint-000004/optimizer.safetensors.*still failing after 2 attempts" ||
  fail "the failed upload: $out"
out=$(check_run runs/o) || fail "the bucket's run after a failed upload: $out"
[[ "$out" == "latest checkpoint-000002 committed 1 "* ]] || fail "after a failed upload: $out"
[[ "$out" == *"orphans 2" ]] || fail "the cut checkpoint's uploaded parts: $out"
"$BT" "${micro[@]}" --steps 8 --save-every 2 --resume --output s3://data/runs/o --stage-dir "$TMP/stage_o" $S3 \
  > "$TMP/log_o" 2>&1 || { cat "$TMP/log_o"; fail "resuming after the failed upload"; }
out2=$(check_run runs/o) || fail "the bucket's run after the resume: $out2"
[[ "$out2" == "latest checkpoint-000008 committed 3 "*"orphans 0" ]] || fail "after the resume: $out2"
echo "ok: an upload failing past its retries ends the run naming it; latest stays checkpoint-000002 ($out); resumed, checkpoint-000004 committed anew and keep-last 3 kept 4, 6, 8 ($out2)"
# c. Resume from the bucket (the first host's staging directory lost) = resume from a directory.
# (Logged every 2 steps: both halves have rows in metrics.jsonl.)
micro_c=("${micro[@]:0:${#micro[@]}-2}" --log-every 2)
"$BT" "${micro_c[@]}" --steps 12 --save-every 6 --stop-after-steps 6 --output "$TMP/rl" > /dev/null 2>&1 || fail "local, first half"
"$BT" "${micro_c[@]}" --steps 12 --save-every 6 --resume --output "$TMP/rl" > /dev/null 2>&1 || fail "local, resumed"
"$BT" "${micro_c[@]}" --steps 12 --save-every 6 --stop-after-steps 6 --keep-last 1 --output s3://data/runs/r \
  --stage-dir "$TMP/stage_r1" $S3 > "$TMP/log_r" 2>&1 || { cat "$TMP/log_r"; fail "bucket, first half"; }
rm -rf "$TMP/stage_r1"
"$BT" "${micro_c[@]}" --steps 12 --save-every 6 --resume --keep-last 1 --output s3://data/runs/r \
  --stage-dir "$TMP/stage_r2" $S3 > "$TMP/log_r" 2>&1 || { cat "$TMP/log_r"; fail "bucket, resumed"; }
grep -q "fetched .*checkpoint-000006 from s3://data/runs/r" "$TMP/log_r" || { cat "$TMP/log_r"; fail "no fetch said"; }
"$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" get "$MOTO_URL" data runs/r/checkpoint-000012/model.safetensors "$TMP/r12.safetensors"
"$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" get "$MOTO_URL" data runs/r/checkpoint-000012/optimizer.safetensors "$TMP/r12o.safetensors"
cmp -s "$TMP/r12.safetensors" "$TMP/rl/checkpoint-000012/model.safetensors" &&
  cmp -s "$TMP/r12o.safetensors" "$TMP/rl/checkpoint-000012/optimizer.safetensors" ||
  fail "resumed from the bucket, the model or optimizer differs from a resume from a directory"
out=$(check_run runs/r) || fail "the resumed run: $out"
[[ "$out" == "latest checkpoint-000012 committed 1 "*"orphans 0" ]] || fail "keep-last 1: $out"
# The bucket's metrics.jsonl grew on from the first half's rows (fetched with the checkpoint),
# as the local run's did: not replaced by the resumed half's alone.
"$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" get "$MOTO_URL" data runs/r/metrics.jsonl "$TMP/r_metrics.jsonl"
steps() { python3 -c "import json,sys; print(' '.join(str(json.loads(l)['step']) for l in open(sys.argv[1])))" "$1"; }
[ "$(steps "$TMP/r_metrics.jsonl")" = "$(steps "$TMP/rl/metrics.jsonl")" ] ||
  fail "the bucket's metrics.jsonl after the resume logs steps $(steps "$TMP/r_metrics.jsonl"), the local run's $(steps "$TMP/rl/metrics.jsonl")"
echo "ok: resumed from the bucket with its staging lost = resumed from a directory, bit for bit (model and optimizer), metrics.jsonl continued; keep-last 1 left one checkpoint ($out)"
# d. One job per run prefix: a lease object (runs/l/bertrain.lock). A second job stops naming
# the first; after the first is killed (no renewal), its lease expires and is taken over.
"$BT" "${micro[@]}" --steps 1000000 --save-every 100000 --lease-seconds 4 --output s3://data/runs/l \
  --stage-dir "$TMP/stage_l1" $S3 > "$TMP/log_l1" 2>&1 &
first=$!
for _ in $(seq 300); do grep -q "^step" "$TMP/log_l1" && break; sleep 0.1; done
grep -q "^step" "$TMP/log_l1" || { cat "$TMP/log_l1"; fail "the first job never stepped"; }
out=$("$BT" "${micro[@]}" --steps 4 --lease-seconds 4 --output s3://data/runs/l --stage-dir "$TMP/stage_l2" $S3 2>&1) &&
  fail "a second job on the prefix ran"
echo "$out" | grep -q "s3://data/runs/l is in use by another job (host .*, pid $first, started" ||
  fail "the second job's message: $out"
sleep 6  # (renewed every 4/3 s: still held)
out=$("$BT" "${micro[@]}" --steps 4 --lease-seconds 4 --output s3://data/runs/l --stage-dir "$TMP/stage_l2" $S3 2>&1) &&
  fail "a second job ran while the first renewed its lease"
kill -9 "$first"; wait "$first" 2>/dev/null
t0=$(date +%s.%N)
for _ in $(seq 40); do
  out=$("$BT" "${micro[@]}" --steps 4 --lease-seconds 4 --output s3://data/runs/l --stage-dir "$TMP/stage_l2" $S3 2>&1) && break
  sleep 0.5
done
echo "$out" | grep -q "took over s3://data/runs/l/bertrain.lock from a job that is gone (host .*, pid $first" ||
  fail "the takeover: $out"
waited=$(echo "$(date +%s.%N) - $t0" | bc | cut -c1-4)
keys=$("$MOTO_VENV/bin/python" -c "
import boto3; s3 = boto3.client('s3', endpoint_url='$MOTO_URL', region_name='us-east-1')
print('\n'.join(o['Key'] for o in s3.list_objects_v2(Bucket='data', Prefix='runs/l/').get('Contents', [])))")
grep -qx "runs/l/bertrain.lock" <<<"$keys" && fail "the lease was left behind by a job that ended"
echo "ok: a second job on s3://data/runs/l stopped naming the first (pid $first) while it renewed its lease; killed, its lease was taken over ${waited} s later (lease 4 s); released at the end"
# e. finetune --output s3://...: the model's files, then a COMMIT naming each (size, SHA-256);
# the files equal a fine-tuning into a directory, metrics.jsonl is in the bucket.
"$BT" "${micro[@]}" --steps 4 --output "$TMP/ftbase" > /dev/null 2>&1 || fail "the model to fine-tune"
head -65 "$ROOT/data/classification/chnsenticorp_small/train.tsv" > "$TMP/ft_train.tsv"
head -33 "$ROOT/data/classification/chnsenticorp_small/dev.tsv" > "$TMP/ft_dev.tsv"
ft=(finetune --init-checkpoint "$TMP/ftbase" --vocab "$ROOT/data/vocab/bert-base-uncased-vocab.txt"
  --train "$TMP/ft_train.tsv" --dev "$TMP/ft_dev.tsv" --epochs 2 --seq-len 64 --batch-size 8 --threads 1)
"$BT" "${ft[@]}" --output "$TMP/ft_local" > "$TMP/log_ft" 2>&1 || { cat "$TMP/log_ft"; fail "finetune into a directory"; }
"$BT" "${ft[@]}" --output s3://data/models/ft --stage-dir "$TMP/stage_ft" $S3 > "$TMP/log_ft" 2>&1 ||
  { cat "$TMP/log_ft"; fail "finetune into the bucket"; }
grep -q "finetune: published s3://data/models/ft" "$TMP/log_ft" || { cat "$TMP/log_ft"; fail "no publication said"; }
for f in model.safetensors config.json vocab.txt metrics.jsonl; do
  "$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" get "$MOTO_URL" data "models/ft/$f" "$TMP/ft_got_$f"
done
for f in model.safetensors config.json vocab.txt; do
  cmp -s "$TMP/ft_got_$f" "$TMP/ft_local/$f" || fail "models/ft/$f differs from the fine-tuning into a directory"
done
[ "$(wc -l < "$TMP/ft_got_metrics.jsonl")" = 2 ] || fail "the bucket's metrics.jsonl lacks the 2 epochs"
"$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" get "$MOTO_URL" data models/ft/COMMIT "$TMP/ft_commit"
python3 - "$TMP" << 'PY' || fail "the COMMIT object"
import hashlib, json, sys
tmp = sys.argv[1]
c = json.load(open(f"{tmp}/ft_commit"))
names = [f["name"] for f in c["files"]]
assert names == ["model.safetensors", "config.json", "vocab.txt"], names
for f in c["files"]:
    body = open(f"{tmp}/ft_got_{f['name']}", "rb").read()
    assert len(body) == f["size"] and hashlib.sha256(body).hexdigest() == f["sha256"], f["name"]
PY
echo "ok: finetune into s3://data/models/ft: model, config and vocabulary equal a fine-tuning into a directory, COMMIT names them with their sizes and SHA-256, metrics.jsonl uploaded"
# f. --shard-optimizer over two hosts publishing to a bucket. BERTRAIN_LOCAL_SIZE=2 makes ranks
# 0-1 and 2-3 two hosts, and each host gets a staging directory of its own (two machines'
# disks): each host's first rank uploads its ranks' optimizer shards with a manifest that rank 0's
# commit waits for; in bf16 the other host's fp32 master parts come to rank 0 over MPI for
# model.safetensors. The checkpoint, a resume from the bucket on 2 ranks, and a fine-tuning into
# a bucket each equal the same run on one directory all ranks share, bit for bit.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 BERTRAIN_LOCAL_SIZE=2
mpx=(-x OMP_NUM_THREADS -x BERTRAIN_LOCAL_SIZE -x AWS_ACCESS_KEY_ID -x AWS_SECRET_ACCESS_KEY -x AWS_REGION)
ranks() { # NP ARGS...: NP ranks (two hosts of two for 4) sharing every directory
  local np=$1
  shift
  timeout 300 mpirun --oversubscribe --bind-to none "${mpx[@]}" -np "$np" "$BT" "$@"
}
two_hosts() { # STAGE0 STAGE1 ARGS...: ranks 0-1 stage in STAGE0, ranks 2-3 in STAGE1
  local a=$1 b=$2
  shift 2
  timeout 300 mpirun --oversubscribe --bind-to none "${mpx[@]}" -np 2 "$BT" "$@" --stage-dir "$a" $S3 \
    : "${mpx[@]}" -np 2 "$BT" "$@" --stage-dir "$b" $S3
}
prec=bf16
"$BT" bench --model-config "$ROOT/configs/bert-tiny.json" --batch-size 2 --seq-len 16 --max-predictions 2 \
  --steps 1 --warmup 0 --precision bf16 > /dev/null 2> "$TMP/bf16_probe" || prec=fp32  # (AVX2: no bf16 matmul)
sh=(train --model-config "$ROOT/configs/bert-tiny.json" --data "$TMP/local/part-*.tfrecord" --batch-size 2
  --global-batch 8 --seq-len 64 --max-predictions 10 --log-every 5 --save-every 5 --threads 1
  --shard-optimizer --precision $prec)
two_hosts "$TMP/sh_a" "$TMP/sh_b" "${sh[@]}" --steps 10 --output s3://data/runs/sh > "$TMP/log_sh" 2>&1 ||
  { cat "$TMP/log_sh"; fail "sharded over two hosts into the bucket"; }
ranks 4 "${sh[@]}" --steps 10 --output "$TMP/sh_local" > "$TMP/log_shl" 2>&1 ||
  { cat "$TMP/log_shl"; fail "sharded over two hosts into one directory"; }
out=$(check_run runs/sh) || fail "the sharded run's bucket: $out"
[[ "$out" == "latest checkpoint-000010 committed 2 "*" orphans 0" ]] || fail "the sharded run's bucket: $out"
ck=checkpoint-000010
for f in model.safetensors trainer_state.json optimizer.rank-0000{0,1,2,3}-of-00004.safetensors; do
  "$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" get "$MOTO_URL" data "runs/sh/$ck/$f" "$TMP/sh_got" ||
    fail "runs/sh/$ck/$f is not in the bucket"
  cmp -s "$TMP/sh_got" "$TMP/sh_local/$ck/$f" || fail "runs/sh/$ck/$f differs from the run into one directory"
done
[ ! -e "$TMP/sh_a/$ck/optimizer.rank-00002-of-00004.safetensors" ] && [ -z "$(ls -A "$TMP/sh_b")" ] ||
  fail "host 1's shards are not its own to upload: $(ls "$TMP/sh_a/$ck" "$TMP/sh_b")"
ranks 2 "${sh[@]}" --steps 15 --resume --output s3://data/runs/sh --stage-dir "$TMP/sh_c" $S3 > "$TMP/log_shc" 2>&1 ||
  { cat "$TMP/log_shc"; fail "resume of the sharded run from the bucket on 2 ranks"; }
grep -q "fetched .*$ck from s3://data/runs/sh" "$TMP/log_shc" || { cat "$TMP/log_shc"; fail "no fetch from the bucket"; }
ranks 2 "${sh[@]}" --steps 15 --resume --output "$TMP/sh_local" > "$TMP/log_shl" 2>&1 ||
  { cat "$TMP/log_shl"; fail "resume of the sharded run from its directory on 2 ranks"; }
cmp -s "$TMP/sh_c/checkpoint-000015/model.safetensors" "$TMP/sh_local/checkpoint-000015/model.safetensors" ||
  fail "the resume from the bucket differs from the resume from the directory"
ftsh=(finetune --init-checkpoint "$TMP/sh_local/$ck" --vocab "$ROOT/data/vocab/bert-base-uncased-vocab.txt"
  --train "$TMP/ft_train.tsv" --dev "$TMP/ft_dev.tsv" --epochs 1 --seq-len 64 --batch-size 8 --threads 1
  --shard-optimizer --precision $prec)
two_hosts "$TMP/ftsh_a" "$TMP/ftsh_b" "${ftsh[@]}" --output s3://data/models/ftsh > "$TMP/log_ftsh" 2>&1 ||
  { cat "$TMP/log_ftsh"; fail "sharded fine-tuning over two hosts into the bucket"; }
ranks 4 "${ftsh[@]}" --output "$TMP/ftsh_local" > "$TMP/log_ftshl" 2>&1 ||
  { cat "$TMP/log_ftshl"; fail "sharded fine-tuning into one directory"; }
"$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" get "$MOTO_URL" data models/ftsh/model.safetensors "$TMP/ftsh_got"
cmp -s "$TMP/ftsh_got" "$TMP/ftsh_local/model.safetensors" || fail "the sharded fine-tuning in the bucket differs"
echo "ok: --shard-optimizer ($prec) over two hosts of two ranks, each its own staging directory: each host uploaded its shards, rank 0 committed all 4 ($out); checkpoint, a resume from the bucket on 2 ranks and a fine-tuning into the bucket equal the runs on one shared directory bit for bit"
echo "s3: all ok"
