# Sourced by the training scripts under mpirun: sets BT (the bertrain binary, $1), ROOT, a TMP
# directory removed on exit, lets Open MPI run as root, and prepares $TMP/data (English
# sample text, seq 64, 10 predictions).
set -u
BT=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$BT" prepare --input "$ROOT/data/corpus/bert_sample_text.txt" --vocab "$ROOT/data/vocab/bert-base-uncased-vocab.txt" \
  --output "$TMP/data" --seq-len 64 --max-predictions 10 >/dev/null 2>&1 || { echo "FAIL: prepare"; exit 1; }
