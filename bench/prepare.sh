#!/usr/bin/env bash
# `bertrain prepare` vs the Python reference (Google's algorithm + HuggingFace tokenizer +
# TensorFlow writer, bench/peer_prepare.py) on the same corpus, vocabulary and settings, on the
# same cores; prints documents/s and the ratios. PY must have transformers and tensorflow.
#   PY=/path/to/venv/bin/python bench/prepare.sh [corpus] [vocab]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
CORPUS=${1:-data/corpus/zh_CLUECorpusSmall_bert_sampled.txt}
VOCAB=${2:-data/vocab/bert-base-chinese-vocab.txt}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
field() { python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['$1'])"; }
t0=$(date +%s.%N)
build/bertrain prepare --input "$CORPUS" --vocab "$VOCAB" --output "$OUT/bt" --dupe-factor 5 --lower-case true --format bert >/dev/null 2>&1
t1=$(date +%s.%N)
docs=$(grep -c '^\s*$' "$CORPUS" || true)
bt=$(python3 -c "print($t1 - $t0)")
slow=$("$PY" bench/peer_prepare.py --input "$CORPUS" --vocab "$VOCAB" --output "$OUT/py" --dupe-factor 5 2>/dev/null)
fast=$("$PY" bench/peer_prepare.py --input "$CORPUS" --vocab "$VOCAB" --output "$OUT/pyf" --dupe-factor 5 --fast 2>/dev/null)
pd=$(echo "$slow" | field documents)
ps=$(echo "$slow" | field seconds)
fs=$(echo "$fast" | field seconds)
printf "corpus %s: %s documents, dupe_factor 5, %s cores\n" "$CORPUS" "$pd" "$(nproc)"
printf "  bertrain prepare          %7.2f s  %8.0f docs/s\n" "$bt" "$(python3 -c "print($pd / $bt)")"
printf "  Python + BertTokenizer     %7.2f s  %8.0f docs/s   bertrain is %.1fx\n" "$ps" "$(python3 -c "print($pd / $ps)")" "$(python3 -c "print($ps / $bt)")"
printf "  Python + BertTokenizerFast %7.2f s  %8.0f docs/s   bertrain is %.1fx\n" "$fs" "$(python3 -c "print($pd / $fs)")" "$(python3 -c "print($fs / $bt)")"
