#!/usr/bin/env bash
# Times the README's first command as a new user meets it: a fresh Debian 12 (mmdebstrap
# minbase from Debian's mirror, plus git and ca-certificates: what "after cloning" assumes), a
# clone of this repository's HEAD, then `scripts/setup.sh` (the packages from the mirror, the
# build with an empty compiler cache) and `scripts/demo.sh`, each timed, in a chroot of that root.
# The README's "fresh clone to the end of the demo" numbers come from this script. Root, Debian's
# mirror and PyPI (the demo's S3 server) needed; about 10 minutes on 2 cores.
#   tools/time_fresh_setup.sh [OUT_DIR]     (the root and its logs are kept in OUT_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/bertrain-fresh}
[ "$(id -u)" = 0 ] || { echo "time_fresh_setup: needs root (mmdebstrap, chroot)" >&2; exit 2; }
rm -rf "$OUT"; mkdir -p "$OUT"
ROOT=$OUT/root
umount_all() {
  for m in dev/shm dev/pts dev sys proc run/netns ""; do umount -l "$ROOT/$m" 2>/dev/null || true; done
}
trap umount_all EXIT
mmdebstrap --quiet --variant=minbase --mode=root --include=git,ca-certificates,sudo bookworm "$ROOT"
git clone -q "$PWD" "$ROOT/root/bertrain"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# The root a mount point of its own: `ip netns add` (the demo's test hosts) remounts / there.
mount --bind "$ROOT" "$ROOT"
mount -t proc proc "$ROOT/proc"
mount -t sysfs sys "$ROOT/sys"
mount --bind /dev "$ROOT/dev"
mount --bind /dev/pts "$ROOT/dev/pts"
mount -t tmpfs -o size=2g tmpfs "$ROOT/dev/shm"
mkdir -p "$ROOT/run"
step() {  # name, command: run in the root, timed, output to $OUT/name.log
  local t0; t0=$(date +%s.%N)
  chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    /bin/bash -c "cd /root/bertrain && $2" > "$OUT/$1.log" 2>&1 || { tail -20 "$OUT/$1.log"; exit 1; }
  printf '%s: %.0f s\n' "$1" "$(echo "$(date +%s.%N) - $t0" | bc)" | tee -a "$OUT/times.txt"
}
step setup "scripts/setup.sh"
grep -E "^setup: (packages installed|built)" "$OUT/setup.log" | tee -a "$OUT/times.txt"
# (the demo's first line of output: when setup has finished and the demo's own work begins)
step demo "scripts/demo.sh"
grep -q "demo: done" "$OUT/demo.log" || { echo "time_fresh_setup: the demo did not finish" >&2; exit 1; }
total=$(awk -F': ' '/^(setup|demo): [0-9]/ {sub(/ s$/, "", $2); s += $2} END {print s}' "$OUT/times.txt")
echo "fresh clone to the end of the demo: $total s ($(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))" |
  tee -a "$OUT/times.txt"
