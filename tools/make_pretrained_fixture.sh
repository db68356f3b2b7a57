#!/usr/bin/env bash
# The small pretrained Chinese BERT under tests/data/pretrained/zh-h64/ (used by the fine-tuning
# test): made by bertrain itself from the bundled CLUE sample, then stored in bf16 to stay small.
#   PY=/path/to/python-with-safetensors-and-torch tools/make_pretrained_fixture.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TMP=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
build/bertrain prepare --input data/corpus/zh_CLUECorpusSmall_bert_sampled.txt \
  --vocab data/vocab/bert-base-chinese-vocab.txt --output "$TMP/data" --dupe-factor 3 --output-shards 4
mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/bertrain train \
  --model-config tests/data/pretrained/config-zh-h64.json --data "$TMP/data/*.tfrecord" --output "$TMP/run" \
  --batch-size 16 --steps 400 --lr 5e-3 --warmup 0.1 --log-every 100
OUT=tests/data/pretrained/zh-h64
mkdir -p "$OUT"
CK=$(build/bertrain eval --help >/dev/null; echo "$TMP/run/$(cat "$TMP/run/latest")")
cp "$CK/config.json" "$OUT/config.json"
"$PY" - "$CK/model.safetensors" "$OUT/model.safetensors" <<'PYEOF'
import sys, torch
from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1])
save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, sys.argv[2], metadata={"format": "pt"})
PYEOF
rm -rf "$TMP"
ls -la "$OUT"
