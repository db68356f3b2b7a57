#!/usr/bin/env bash
# The main job, end to end, on bundled real data (a few minutes on 2 cores):
#   1. set up and build (installs missing Debian packages);
#   2. prepare: Chinese CLUE corpus -> BERT pretraining TFRecords (a held-out split for eval);
#   3. train a tiny Chinese BERT with 2 MPI ranks (zero-copy shared-memory allreduce), autotuned
#      (attention kernel and bucket size timed first), each sequence on its real tokens (the
#      padding skipped), with the progress line and the step-time breakdown; TensorBoard event
#      files and metrics.jsonl in the run directory; then the padding computed, skipped and
#      packed (MLPerf-style rows of several instances), timed side by side at 512 tokens;
#   4. eval: masked-LM and next-sentence metrics on the held-out records;
#   5. fine-tune on ChnSentiCorp reviews (dev accuracy per epoch) and predict the test set; a
#      regression task (GLUE STS-B as distributed: dev Pearson/Spearman per epoch); entity tagging
#      (CLUENER: dev entity F1 per epoch, entities with their character spans); extractive question
#      answering (CMRC 2018: windows over long contexts, dev exact match/F1 by its official
#      evaluation, answers with their character spans); read a Google BERT TensorFlow checkpoint
#      and convert it for transformers;
#   6. an HTML report of both runs (plots, offline; the last step's compute/communication overlap
#      from the timeline) and `bertrain doctor` on the machine (CPU, MPI, CUDA/NCCL) and the run;
#   7. the memory plan of BERT-base and the largest batch that fits this machine, with and without
#      layer recomputation;
#   8. one job description emitted for mpirun, Slurm, a Kubernetes MPIJob and PAI-DLC, and a
#      two-rank job started here from its description;
#   9. an elastic job on two test hosts (network namespaces; as root): one host killed mid-run,
#      the supervisor restarts the job on the host left (global batch kept), and grows it back
#      to two when the host returns; the run's record and the doctor's reading of it;
#  10. training data in object storage: an S3 server (moto, from PyPI) 50 ms away, the input
#      pipeline's rate from it against local disk, and a model trained from the bucket with its
#      run directory (checkpoints committed, metrics) in the bucket.
# Outputs go to demo-out/. DEMO_STEPS (default 300) sets the pretraining length.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BT=$PWD/build/bertrain
OUT=demo-out
STEPS=${DEMO_STEPS:-300}
rm -rf "$OUT"
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

echo; echo "== what this binary is: the build, and the libraries it runs with here"
$BT --version

echo; echo "== 1. prepare: the CLUE corpus sample (2500 Chinese documents), 100 documents held out"
awk -v RS= -v ORS='\n\n' -v out="$OUT" 'NR <= 2400 {print > out "/train.txt"} NR > 2400 {print > out "/heldout.txt"}' \
  data/corpus/zh_CLUECorpusSmall_bert_sampled.txt
$BT prepare --input "$OUT/train.txt" --vocab data/vocab/bert-base-chinese-vocab.txt --output "$OUT/data" \
  --seq-len 128 --max-predictions 20 --dupe-factor 3 --output-shards 4
$BT prepare --input "$OUT/heldout.txt" --vocab data/vocab/bert-base-chinese-vocab.txt --output "$OUT/eval" \
  --seq-len 128 --max-predictions 20 --dupe-factor 1 --seed 7 >/dev/null
$BT inspect --count "$OUT/data/*.tfrecord"

echo; echo "== 2. train: tiny Chinese BERT, 2 MPI ranks x batch 16, LAMB, $STEPS steps, autotuned, padding skipped"
mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 \
  $BT train --model-config configs/bert-tiny-zh.json --data "$OUT/data/*.tfrecord" --output "$OUT/run" \
  --batch-size 16 --seq-len 128 --max-predictions 20 --steps "$STEPS" --lr 5e-3 --warmup 0.1 \
  --optimizer lamb --log-every 25 --save-every 100 --timeline "$OUT/run/timeline.json" --autotune

echo; echo "-- what TensorBoard shows (tensorboard --logdir $OUT/run): $(ls "$OUT"/run/events.out.tfevents.* | head -1)"
echo "   metrics.jsonl, the last logged step (one JSON object per logged step; rank_step_ms: each rank's mean step time):"
tail -1 "$OUT/run/metrics.jsonl" | fold -w 110 | sed 's/^/     /'
echo; echo "-- the padding computed, skipped and packed (train --pack 3): BERT-tiny steps on the training documents at 512 tokens"
$BT prepare --input "$OUT/train.txt" --vocab data/vocab/bert-base-chinese-vocab.txt --output "$OUT/data512" \
  --seq-len 512 --max-predictions 76 --dupe-factor 1 --output-shards 1 >/dev/null
$BT bench --model-config configs/bert-tiny.json --data "$OUT/data512/*.tfrecord" --batch-size 8 --seq-len 512 \
  --max-predictions 76 --steps 4 --padding both --pack 3 | grep -E "^  (data|--|throughput)|x the real"

echo; echo "== 3. eval on the held-out documents"
$BT eval --checkpoint "$OUT/run" --data "$OUT/eval/*.tfrecord" --batch-size 32 --seq-len 128 --max-predictions 20

echo; echo "== 4. fine-tune on ChnSentiCorp (500 reviews), predict its test set"
$BT finetune --init-checkpoint "$OUT/run" --vocab data/vocab/bert-base-chinese-vocab.txt \
  --train data/classification/chnsenticorp_small/train.tsv --dev data/classification/chnsenticorp_small/dev.tsv \
  --output "$OUT/sentiment" --seq-len 128 --batch-size 16 --epochs 8 --lr 2e-4
$BT predict --checkpoint "$OUT/sentiment" --input data/classification/chnsenticorp_small/test.tsv > "$OUT/predictions.tsv"
echo "predictions in $OUT/predictions.tsv"
echo "-- regression: GLUE STS-B's files as distributed (--task stsb; the first 1000 training pairs)"
$BT finetune --init-checkpoint "$OUT/run" --vocab data/vocab/bert-base-chinese-vocab.txt --task stsb \
  --train tests/data/tasks/stsb_train_head1000.tsv --dev tests/data/tasks/stsb_dev_head300.tsv \
  --output "$OUT/stsb" --seq-len 64 --batch-size 16 --epochs 3 --lr 5e-4
echo "-- entity tagging: CLUENER (the first 2000 training sentences), then the entities of two dev sentences"
$BT finetune --init-checkpoint "$OUT/run" --vocab data/vocab/bert-base-chinese-vocab.txt --task cluener \
  --train tests/data/tasks/cluener_train_head2000.json --dev tests/data/tasks/cluener_dev_head200.json \
  --output "$OUT/ner" --seq-len 64 --batch-size 16 --epochs 6 --lr 4e-3
$BT predict --checkpoint "$OUT/ner" --input tests/data/tasks/cluener_dev_head200.json > "$OUT/entities.jsonl"
head -2 "$OUT/entities.jsonl" | cut -c1-200; echo "  ... (all in $OUT/entities.jsonl)"
echo "-- extractive QA: CMRC 2018 (700 questions of its dev set to train on, 120 of its trial set as dev)"
$BT finetune --init-checkpoint "$OUT/run" --vocab data/vocab/bert-base-chinese-vocab.txt --task cmrc2018 \
  --train tests/data/tasks/cmrc2018_dev_head.json --dev tests/data/tasks/cmrc2018_trial_head.json \
  --output "$OUT/qa" --seq-len 128 --max-query-length 32 --batch-size 32 --epochs 2 --lr 3e-3
$BT predict --checkpoint "$OUT/qa" --input tests/data/tasks/cmrc2018_trial_head.json > "$OUT/answers.jsonl"
head -2 "$OUT/answers.jsonl" | cut -c1-200; echo "  ... (all in $OUT/answers.jsonl)"
echo "-- a Google BERT TensorFlow checkpoint (keras-bert's tiny one): its variables, then as a HuggingFace directory"
$BT inspect tests/data/tf_checkpoint/keras_bert_tiny > "$OUT/tf-variables.txt"
head -4 "$OUT/tf-variables.txt"; echo "  ... (all of them in $OUT/tf-variables.txt)"
$BT convert tests/data/tf_checkpoint/keras_bert_tiny "$OUT/from-tf"

echo; echo "== 5. see the runs: one HTML report (pretraining with its eval, fine-tuning), and the doctor"
$BT report "$OUT/run" "$OUT/sentiment" "$OUT/stsb" "$OUT/ner" "$OUT/qa" --output "$OUT/report.html"
$BT doctor "$OUT/run"

echo; echo "== 6. memory plan: BERT-base pretraining per rank, and the batch that fits half this machine's memory"
mem_kib=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
$BT estimate --model-config configs/bert-base.json --batch-size 32 --seq-len 128 --memory-budget "$((mem_kib / 1024 / 2))MiB"
echo "-- the same with layer recomputation (backward recomputes each layer's forward; same gradients):"
$BT estimate --model-config configs/bert-base.json --batch-size 32 --seq-len 128 --recompute layer \
  --memory-budget "$((mem_kib / 1024 / 2))MiB" | grep -E "^run|activations|total|budget"
echo "-- and with the optimizer state sharded over 8 ranks (train --shard-optimizer, ZeRO stage 1); in bf16 the fp32 master weights too:"
for p in fp32 bf16; do
  $BT estimate --model-config configs/bert-base.json --batch-size 32 --seq-len 128 --shard-optimizer --ranks 8 \
    --precision $p | grep -E "^run|^  parameters|^  optimizer|^  total"
done
echo "-- and on a GPU (no GPU needed to plan one; the CUDA kernels themselves run on an emulated device"
echo "   in the test command, cuda_emu/README.md): BERT-Large phase 2 in bf16, what an 80 GiB GPU fits:"
$BT estimate --model-config configs/bert-large.json --batch-size 8 --seq-len 512 --max-predictions 80 \
  --precision bf16 --device cuda --memory-budget 80GiB | grep -E "^run|^memory|^  [a-z0-9]+ +[0-9.]+ [KMG]iB$|^budget"
echo "-- that plan keeps the full attention's [B,heads,T,T] (a GPU's auto in bf16: on an H200 the step ran"
echo "   3.6x faster than with the fused blocked kernel, docs/gpus.md); the blocked one keeps only the row log-sum-exp:"
$BT estimate --model-config configs/bert-large.json --batch-size 8 --seq-len 512 --max-predictions 80 \
  --precision bf16 --device cuda --memory-budget 80GiB --attention blocked | grep -E "^run|^  total|^budget"
echo "-- what a step asks of a GPU: kernel launches and host synchronisations (docs/gpus.md; none between"
echo "   logged steps: the norm, finite check, clipping and fp16's loss scale stay on the GPU), counted by"
echo "   bench --device cuda; with the fused attention (--attention blocked: 2 kernels a layer, every sequence"
echo "   length of the batch in one launch, the padding skipped) 20 launches a layer in all; padded or not, forward"
echo "   and backward run as CUDA graphs (--cuda-graphs auto: 3 graph launches a step, forward, backward and the"
echo "   update; the host issues no kernel):"
if [ -x build-emu/bertrain ]; then
  for a in auto blocked; do
    build-emu/bertrain bench --device cuda --model-config configs/bert-tiny.json --batch-size 4 --seq-len 32 \
      --max-predictions 5 --steps 2 --warmup 1 --precision bf16 --attention $a | grep -E "^bench|^  device|^  graphs|^  traffic"
  done
  echo "   fine-tuning too (every head; the same model bit for bit as --cuda-graphs off), here with the attention"
  echo "   fused (--attention blocked) and so each sentence on its real tokens (--padding auto skips the padding):"
  build-emu/bertrain finetune --device cuda --init-checkpoint "$OUT/run" --vocab data/vocab/bert-base-chinese-vocab.txt \
    --task cluener --train tests/data/tasks/cluener_dev_head200.json --output "$OUT/ner-gpu" --seq-len 32 \
    --batch-size 16 --epochs 1 --lr 4e-3 --precision bf16 --attention blocked | grep -E "^finetune: .* from|^epoch" | fold -s -w 106 | sed 's/^/     /'
  echo "   (measured on an H200, docs/gpus.md: BERT-Large 128 tokens bf16 at 1.76x PyTorch's tokens/s, BERT-base 1.97x)"
else
  echo "   (on the emulated device once scripts/test.sh has built it: build-emu/bertrain bench --device cuda ...)"
fi
echo "-- and the bytes behind the launches: the traffic model of a BERT-Large step (estimate --device cuda --explain;"
echo "   checked kernel by kernel against the pages the emulated device sees each kernel touch and the products"
echo "   it computes), a few rows and the time it predicts on an H200 (which measured 36.9 ms for this step: the"
echo "   gap is kernels short of their floor):"
$BT estimate --model-config configs/bert-large.json --batch-size 32 --precision bf16 --device cuda --explain \
  --optimizer adamw | sed -n '/^GPU traffic model/,$p' |
  grep -E "^GPU traffic|^  kernel|cublasLtMatmul +layer|layernorm_backward_kernel +layer|adamw_many|^step|^pred|ms a step"
echo "   at 512 tokens with the attention fused (two kernels a layer), their tensor-core products counted too:"
$BT estimate --model-config configs/bert-large.json --batch-size 8 --seq-len 512 --max-predictions 80 --precision bf16 \
  --device cuda --explain --optimizer adamw --attention blocked | sed -n '/^GPU traffic model/,$p' |
  grep -E "attention_(forward|backward)_fused|ms a step|fused attention's"

echo; echo "== 7. one job description for every launcher: BERT-Large on 32 hosts x 4 GPUs"
for emit in mpirun slurm mpijob dlc; do $BT launch configs/jobs/bert-large-128.yaml --emit $emit --output "$OUT/jobs"; done
head -12 "$OUT/jobs/bert-large-128.sbatch"
echo "-- and before renting the 32 hosts: the scaling model (assumed V100 compute: 90 + 180 + 8 ms a step; 25 Gbit/s, then fp16 on the wire)"
for comp in none fp16; do
  $BT plan --model-config configs/bert-large.json --batch-size 64 --seq-len 128 --precision fp16 --forward-ms 90 \
    --backward-ms 180 --optimizer-ms 8 --ranks-per-host 4 --link-gbit 25 --host-gbyte-s 150 --compression $comp \
    --hosts 1,8,32 | sed -n '4,$p'
done
echo "-- and a two-rank job started here, its optimizer state sharded (configs/jobs/local-2rank.yaml --run):"
$BT launch configs/jobs/local-2rank.yaml --run 2>&1 | grep -E "^launch|sharded|^step|^bottleneck"

echo; echo "== 8. a host lost mid-run: the elastic supervisor restarts the job on the host left, and grows it back"
lost_args=(train --model-config "$PWD/configs/bert-tiny-zh.json" --data "$PWD/$OUT/data/*.tfrecord" --output "$PWD/$OUT/lost"
  --seq-len 128 --max-predictions 20 --steps 16 --lr 5e-3 --optimizer lamb --log-every 4
  --save-every 2 --stall-timeout 10)
if [ "$(id -u)" = 0 ] && ip netns add "bt-demo-$$" 2> /dev/null; then
  ip netns del "bt-demo-$$"
  # Two test hosts (network namespaces, tests/cluster/hosts.sh), one rank each, TCP between them;
  # `bertrain launch --run` on a spec with elastic: supervises the job from h0.
  tests/cluster/hosts.sh up "$OUT/hosts" 2 > /dev/null
  mapfile -t addr < <(awk '{print $1}' "$OUT/hosts/hostfile")
  cat > "$OUT/lost.yaml" << SPEC
name: lost
workers: 2
hosts: [${addr[0]}, ${addr[1]}]
env: {OMP_NUM_THREADS: "1", OMPI_ALLOW_RUN_AS_ROOT: "1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM: "1"}
command: train
elastic: {min_workers: 1, max_workers: 2, max_restarts: 2}
flags: {model-config: $PWD/configs/bert-tiny-zh.json, data: "$PWD/$OUT/data/*.tfrecord", output: $PWD/$OUT/elastic,
        seq-len: 128, max-predictions: 20, steps: 120, lr: 5e-3, optimizer: lamb, log-every: 10, save-every: 10,
        global-batch: 16, batch-size: 8, stall-timeout: 10}
SPEC
  (
    for _ in $(seq 600); do [ -e "$OUT/elastic/checkpoint-000020" ] && break; sleep 0.1; done
    tests/cluster/hosts.sh kill "$OUT/hosts" h1 && tests/cluster/hosts.sh cut "$OUT/hosts" h1
    for _ in $(seq 600); do grep -q '"event":"restart"' "$OUT/elastic/metrics.jsonl" 2> /dev/null && break; sleep 0.2; done
    sleep 2
    tests/cluster/hosts.sh restore "$OUT/hosts" h1
  ) &
  tests/cluster/hosts.sh exec "$OUT/hosts" h0 env $(tests/cluster/hosts.sh mca "$OUT/hosts") "$BT" launch "$OUT/lost.yaml" \
    --run --probe-seconds 1 --probe-timeout 3 2>&1 | grep -E "^elastic|global batch .* kept|^step +(10|30|60|90|120)/" |
    sed -e 's/: mpirun .*//' -e 's/, allreduce.*//' || true
  wait
  tests/cluster/hosts.sh down "$OUT/hosts"
  echo "-- what the run recorded ($OUT/elastic/incidents.log and metrics.jsonl; bertrain doctor):"
  grep "elastic" "$OUT/elastic/incidents.log" | cut -c1-220
  "$BT" doctor "$OUT/elastic" 2>&1 | grep -A1 -E "^  find  elastic" || true
else
  echo "(test hosts need root for network namespaces: 2 ranks on this host instead, stopped at step 6,"
  echo " and resumed by hand on 1 rank with the global batch kept)"
  mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$BT" "${lost_args[@]}" \
    --batch-size 8 --stop-after-steps 6 2>&1 | grep -E "^step"
  "$BT" "${lost_args[@]}" --resume --batch-size 16 2>&1 | grep -E "resumed|data:|^step|^bottleneck"
fi

echo; echo "== 9. training data in object storage: an S3 server 50 ms away"
# moto (a reference S3 server that checks request signatures; PyPI, in a venv outside the
# repository) behind tests/s3/s3proxy.py, which delays every byte by 25 ms each way.
(
  source tests/s3/moto_env.sh
  trap 'proxy_stop; moto_stop' EXIT
  mkdir -p "$OUT/s3"
  moto_start "$OUT/s3"
  moto_put clue/ "$OUT"/data/*.tfrecord
  proxy_start --rtt-ms 50
  echo "-- bench-input from local disk, then from s3://data/clue/*.tfrecord (default settings):"
  "$BT" bench-input --data "$OUT/data/*.tfrecord" --seconds 3 | grep "examples/s"
  "$BT" bench-input --data "s3://data/clue/*.tfrecord" --s3-endpoint "$PROXY_URL" --seconds 3 |
    grep -E "examples/s|object store"
  echo "-- the tiny model trained from the bucket into the bucket (--output s3://data/runs/from-s3:"
  echo "   each checkpoint's files, then its COMMIT object, then latest; input wait in the step breakdown):"
  "$BT" train --model-config "$PWD/configs/bert-tiny-zh.json" --data "s3://data/clue/*.tfrecord" \
    --s3-endpoint "$PROXY_URL" --output s3://data/runs/from-s3 --stage-dir "$OUT/from-s3" --batch-size 16 \
    --seq-len 128 --max-predictions 20 --steps 60 --save-every 30 --lr 5e-3 --optimizer lamb --log-every 30 2>&1 |
    grep -E "^step|^step time"
  echo "-- what the bucket holds (a reader takes latest, then the COMMIT it names):"
  "$MOTO_VENV/bin/python" -c "
import boto3; s3 = boto3.client('s3', endpoint_url='$MOTO_URL', region_name='us-east-1')
for o in s3.list_objects_v2(Bucket='data', Prefix='runs/from-s3/')['Contents']:
    print('     %-60s %10d bytes' % (o['Key'], o['Size']))" | grep -v tfevents
) 2>&1 | grep -v -i -E "task was destroyed|task: <Task" || echo "(object storage step skipped: no S3 server)"
echo; echo "demo: done (outputs in $OUT/)"
