#!/usr/bin/env bash
# The Debian package and the container image, used as a user on a clean machine would:
#   1. scripts/package.sh --image: the .deb (dpkg-shlibdeps' dependencies) and bertrain:<version>;
#   2. a clean Debian 12 root (mmdebstrap from Debian's mirror), `apt-get install ./bertrain_*.deb`
#      in it (apt fetches what the package depends on), then inside it, from the installed files
#      only (the root cannot see the build tree): --version, doctor, prepare, a 20-step train,
#      finetune and predict, the man page, the bash completion; then `apt-get purge bertrain`
#      leaves none of its files behind;
#   3. the image: bertrain doctor and a 2-rank mpirun training job in a container (podman), its
#      size; `launch --emit mpijob` names it by default and the manifest validates against the
#      MPI Operator's CRD schema.
#   tests/package/package_test.sh         (exit 77: no mmdebstrap/podman, or not root)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${BUILD_DIR:-build}
for tool in mmdebstrap podman cpack help2man; do
  command -v $tool >/dev/null || { echo "SKIP: $tool is missing (scripts/setup.sh --tests installs it)"; exit 77; }
done
[ "$(id -u)" = 0 ] || { echo "SKIP: a clean root (mmdebstrap --mode=root, chroot) needs root"; exit 77; }
T=$(mktemp -d /tmp/bertrain-package.XXXXXX)
ROOT=$T/root
cleanup() {
  for m in dev/shm dev proc; do umount "$ROOT/$m" 2>/dev/null || true; done
  rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# --- 1. the package and the image -----------------------------------------------------------
t0=$(date +%s)
scripts/package.sh --image
DEB=$(ls "$BUILD_DIR"/bertrain_*_amd64.deb)
VERSION=$(dpkg-deb -f "$DEB" Version)
DEPENDS=$(dpkg-deb -f "$DEB" Depends)
for lib in libdnnl libopenmpi libprotobuf libcurl libyaml-cpp libutf8proc; do
  grep -q "$lib" <<<"$DEPENDS" || fail "the package's Depends lacks $lib (dpkg-shlibdeps): $DEPENDS"
done
if dpkg-deb -c "$DEB" | grep -E '\.(h|hpp|a|o)$'; then fail "headers or objects in the package"; fi
echo "package_test: built in $(($(date +%s) - t0)) s"

# --- 2. a clean root, the package installed by apt ------------------------------------------
t0=$(date +%s)
mmdebstrap --quiet --variant=minbase --mode=root --include=bash-completion \
  --customize-hook="copy-in $DEB /root" \
  --customize-hook="chroot \"\$1\" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends /root/$(basename "$DEB") >/dev/null" \
  bookworm "$ROOT"
echo "package_test: clean Debian 12 root with the package installed by apt in $(($(date +%s) - t0)) s"
mkdir -p "$ROOT/work/data"
cp data/vocab/bert-base-chinese-vocab.txt "$ROOT/work/vocab.txt"
awk -v RS= -v ORS='\n\n' 'NR <= 300' data/corpus/zh_CLUECorpusSmall_bert_sampled.txt > "$ROOT/work/corpus.txt"
head -201 data/classification/chnsenticorp_small/train.tsv > "$ROOT/work/train.tsv"
head -51 data/classification/chnsenticorp_small/dev.tsv > "$ROOT/work/dev.tsv"
head -11 data/classification/chnsenticorp_small/test.tsv > "$ROOT/work/test.tsv"
mount -t proc proc "$ROOT/proc"
mount --bind /dev "$ROOT/dev"
mount -t tmpfs -o size=1g tmpfs "$ROOT/dev/shm"
in_root() { chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root OMP_NUM_THREADS=2 \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 /bin/bash -c "$1"; }
in_root 'set -e
  ldd /usr/bin/bertrain | grep "not found" && exit 1
  bertrain --version
  bertrain doctor > /work/doctor.txt || { cat /work/doctor.txt; exit 1; }
  cd /work
  bertrain prepare --input corpus.txt --vocab vocab.txt --output data --seq-len 64 --max-predictions 10 \
    --output-shards 2 > /dev/null
  bertrain train --model-config /usr/share/bertrain/configs/bert-tiny-zh.json --data "data/*.tfrecord" \
    --output run --batch-size 8 --seq-len 64 --max-predictions 10 --steps 20 --log-every 10 \
    --lr 5e-3 | grep -E "^step +20"
  bertrain finetune --init-checkpoint run --vocab vocab.txt --train train.tsv --dev dev.tsv \
    --output cls --epochs 1 --seq-len 64 | tail -1
  bertrain predict --checkpoint cls --input test.tsv > predictions.txt
  [ "$(wc -l < predictions.txt)" -ge 10 ] || { cat predictions.txt; exit 1; }
  zcat /usr/share/man/man1/bertrain.1.gz | grep "^\.SS train" > /dev/null || { echo "man page lacks train"; exit 1; }
  source /usr/share/bash-completion/completions/bertrain
  COMP_WORDS=(bertrain fin); COMP_CWORD=1; _bertrain; [ "${COMPREPLY[*]}" = finetune ]
  COMP_WORDS=(bertrain train --save-ev); COMP_CWORD=2; _bertrain; [ "${COMPREPLY[*]}" = --save-every ]
' || fail "the installed package did not work in the clean root (above)"
echo "package_test: installed bertrain ran doctor, prepare, a 20-step train, finetune, predict; man page and completion work"
in_root 'dpkg -L bertrain' | sort > "$T/files"
# (apt's terminal log wants /dev/pts; without it apt says so and purges all the same)
in_root 'apt-get purge -y -qq bertrain' > "$T/purge.log" 2>&1 || { cat "$T/purge.log"; fail "apt-get purge bertrain"; }
in_root 'dpkg -L bertrain' > /dev/null 2>&1 && fail "dpkg still lists bertrain after purge"
left=0
while read -r f; do
  [ "$f" = /. ] && continue
  if [ -f "$ROOT$f" ] || [ -L "$ROOT$f" ]; then echo "left: $f"; left=1; fi
done < "$T/files"
[ -d "$ROOT/usr/share/bertrain" ] && { echo "left: /usr/share/bertrain"; left=1; }
[ "$left" = 0 ] || fail "purging the package left files behind"
echo "package_test: purged: none of its $(grep -c . "$T/files") paths left"

# --- 3. the image -------------------------------------------------------------------------------
TAG=bertrain:$VERSION
# crun refuses hybrid cgroup hierarchies (cgroup v1 + v2, as on this machine); runc runs them.
RUNTIME=crun
command -v runc >/dev/null && RUNTIME=runc
# Limits no higher than this process's: a container may not raise them.
ULIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=4096:4096")
run() { podman run --runtime "$RUNTIME" --rm --network none "${ULIMITS[@]}" --shm-size=1g \
  -v "$ROOT/work:/work" -w /work -e OMP_NUM_THREADS=1 "$TAG" "$@"; }
run bertrain doctor > "$T/doctor-image.txt" || { cat "$T/doctor-image.txt"; fail "doctor in the image"; }
run mpirun -np 2 --oversubscribe --bind-to none bertrain train \
  --model-config /usr/share/bertrain/configs/bert-tiny-zh.json --data "data/*.tfrecord" \
  --output run2 --batch-size 8 --seq-len 64 --max-predictions 10 --steps 20 --log-every 10 \
  --lr 5e-3 > "$T/mpirun.txt" 2>&1 || { cat "$T/mpirun.txt"; fail "the 2-rank job in the image"; }
grep -q "2 ranks" "$T/mpirun.txt" || { cat "$T/mpirun.txt"; fail "the job in the image did not run on 2 ranks"; }
grep -E "^step +20" "$T/mpirun.txt"
if run sh -c 'command -v gcc || command -v cc || ls /usr/include/*.h' 2>/dev/null | grep .; then
  fail "the image has a compiler or headers"
fi
size=$(($(podman image inspect --format '{{.Size}}' "$TAG") / 1048576))
echo "package_test: image $TAG: doctor and a 2-rank mpirun job ran in it; $size MiB"
# The specs bertrain writes name that image, and the MPIJob validates against the CRD schema.
mkdir -p "$T/jobs"
"$BUILD_DIR"/bertrain launch configs/jobs/local-2rank.yaml --emit mpijob --output "$T/jobs" > /dev/null
"$BUILD_DIR"/bertrain launch configs/jobs/local-2rank.yaml --emit dlc --output "$T/jobs" > /dev/null
grep -q "image: $TAG" "$T/jobs/local-2rank-mpijob.yaml" || fail "the MPIJob does not name $TAG"
grep -q "\"Image\": \"$TAG\"" "$T/jobs/local-2rank-dlc.json" || fail "the DLC job does not name $TAG"
if /usr/bin/python3 -c "import jsonschema, yaml" 2>/dev/null; then
  /usr/bin/python3 tools/validate_mpijob.py tests/data/schemas/mpijob-v2beta1.schema.json "$T/jobs/local-2rank-mpijob.yaml" \
    || fail "the MPIJob naming $TAG is invalid"
fi
echo "package_test: ok"
