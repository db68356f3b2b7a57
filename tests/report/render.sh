#!/bin/bash
# `bertrain report` renders in a real browser with no network: a short 2-rank training run, its
# report, then headless Chromium (Debian's chromium-headless-shell) in a network namespace of its
# own (unshare -n: no interface but a downed loopback) takes a screenshot. The PNG must be a
# real page: large, and not one colour. Leaves the PNG in $REPORT_PNG when set (to look at).
# usage: render.sh <bertrain binary>
set -euo pipefail
BT=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CHROME=$(command -v chromium-headless-shell || true)
if [ -z "$CHROME" ]; then
  echo "report render: SKIPPED, chromium-headless-shell is not installed (scripts/setup.sh installs it)"
  exit 0
fi
WORK=$(mktemp -d /tmp/bertrain-report.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for run in a b; do
  lr=$([ $run = a ] && echo 1e-3 || echo 3e-4)
  mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$BT" train \
    --model-config "$ROOT/configs/bert-tiny.json" \
    --data "$ROOT/tests/data/tfrecord/bert_pretrain_sample_text.tfrecord" --output "$WORK/$run" \
    --steps 30 --log-every 3 --batch-size 4 --seq-len 128 --max-predictions 20 --threads 1 \
    --lr $lr --seed 3 > "$WORK/$run.log" 2>&1 || { cat "$WORK/$run.log"; exit 1; }
done
"$BT" report "$WORK/a" "$WORK/b" --output "$WORK/report.html"
NET=()
if unshare -n true 2>/dev/null; then NET=(unshare -n); fi
"${NET[@]}" "$CHROME" --headless --no-sandbox --disable-gpu --hide-scrollbars \
  --window-size=1200,2500 --screenshot="$WORK/report.png" "file://$WORK/report.html" \
  > "$WORK/chrome.log" 2>&1 || { cat "$WORK/chrome.log"; exit 1; }
python3 - "$WORK/report.png" <<'PY'
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
w, h = struct.unpack(">II", data[16:24])
# Decompress the image data and count distinct bytes: a blank page has almost none.
idat, i = b"", 8
while i < len(data):
    n, t = struct.unpack(">I4s", data[i:i + 8])
    if t == b"IDAT":
        idat += data[i + 8:i + 8 + n]
    i += 12 + n
raw = zlib.decompress(idat)
distinct = len(set(raw[::97]))
print(f"report render: {w}x{h} PNG, {len(data)} bytes, {distinct} distinct sampled byte values")
assert w >= 1000 and h >= 1000, "too small"
assert len(data) > 30000 and distinct > 20, "the page looks blank"
PY
echo "report render: ok (offline: ${NET[*]:-network not isolated})"
if [ -n "${REPORT_PNG:-}" ]; then cp "$WORK/report.png" "$REPORT_PNG"; fi
