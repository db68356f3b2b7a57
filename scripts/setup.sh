#!/usr/bin/env bash
# Installs every Debian package bertrain needs (idempotent: apt runs only when something is
# missing), then configures and builds bertrain in ./build (Release, tests on).
#   scripts/setup.sh            install + build
#   BUILD_DIR=out scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake pkg-config clang-format
  libdnnl-dev                       # oneDNN: GEMM (fp32/bf16), post-op fusion
  libopenmpi-dev openmpi-bin        # processes and transport for data parallelism
  libprotobuf-dev protobuf-compiler # tf.Example, TensorBoard events
  libutf8proc-dev zlib1g-dev        # WordPiece Unicode; gzip TFRecords
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev          # the fuzz target (libFuzzer + sanitizers) in scripts/test.sh
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)"
echo "setup: built $BUILD_DIR/bertrain"
