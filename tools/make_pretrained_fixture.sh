#!/usr/bin/env bash
# The small pretrained BERTs under tests/data/pretrained/ (used by the fine-tuning tests), made by
# bertrain itself, then stored in bf16 to stay small:
#   zh-h64  from the bundled CLUE sample (bert-base-chinese vocab)
#   en-h64  from the bundled Project Gutenberg books (bert-base-uncased vocab)
# Both: 2 layers of 64, 400 steps of batch 16 on 2 ranks, lr 5e-3.
#   PY=/path/to/python-with-safetensors-and-torch tools/make_pretrained_fixture.sh zh|en
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LANG_=${1:-zh}
case "$LANG_" in
  zh) CORPUS=data/corpus/zh_CLUECorpusSmall_bert_sampled.txt VOCAB=data/vocab/bert-base-chinese-vocab.txt ;;
  en) CORPUS="data/corpus/gutenberg/*.txt" VOCAB=data/vocab/bert-base-uncased-vocab.txt ;;
  *) echo "usage: $0 zh|en"; exit 2 ;;
esac
TMP=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
build/bertrain prepare --input "$CORPUS" --vocab "$VOCAB" --output "$TMP/data" --dupe-factor 3 --output-shards 4
mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/bertrain train \
  --model-config "tests/data/pretrained/config-$LANG_-h64.json" --data "$TMP/data/*.tfrecord" --output "$TMP/run" \
  --batch-size 16 --steps 400 --lr 5e-3 --warmup 0.1 --log-every 100
OUT=tests/data/pretrained/$LANG_-h64
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
