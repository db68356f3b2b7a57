#!/usr/bin/env bash
# Installs every Debian package bertrain needs (idempotent: apt runs only when something is
# missing), then configures and builds bertrain in ./build (Release, tests on).
#   scripts/setup.sh            install + build
#   BUILD_DIR=out scripts/setup.sh
# PACKAGES must name every package whose files configure, build, tests, demo and fuzz read, or a
# package that depends on it: scripts/check-packages.sh (run by scripts/test.sh) traces a
# configure and reads the build's dependency files and link lines, and fails naming any package
# outside this list's dependency closure. That is how a package installed by hand on one machine
# cannot hide a missing line here.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake pkg-config clang-format
  libboost-context-dev              # cuda_emu: the emulated GPU's threads as fibers (scripts/test.sh)
  ccache                            # rebuilds of unchanged sources (ASan, CUDA, fuzz builds) from its cache
  libdnnl-dev                       # oneDNN: GEMM (fp32/bf16), post-op fusion
  ocl-icd-opencl-dev opencl-c-headers # read by oneDNN's CMake config (Debian builds it with OpenCL)
  libopenmpi-dev openmpi-bin        # processes and transport for data parallelism
  libprotobuf-dev protobuf-compiler # tf.Example, TensorBoard events
  libutf8proc-dev zlib1g-dev        # WordPiece Unicode; gzip TFRecords
  libcurl4-openssl-dev libssl-dev libpugixml-dev # object storage: transfers, SigV4 signing, XML replies
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev          # the fuzz target (libFuzzer + sanitizers) in scripts/test.sh
  libomp-14-dev                     # OpenMP for clang (the fuzz target's find_package(OpenMP))
  strace                            # scripts/check-packages.sh traces what configure reads
  chromium-headless-shell python3   # tests/report/render.sh renders `bertrain report` offline, checks the PNG
  python3-jsonschema python3-yaml   # tests/launch: the MPIJob manifests against the CRD schema
  slurmctld slurmd slurm-client munge # tests/launch/slurm_test.sh: a real Slurm runs the sbatch script
  python3-venv                      # tests/s3: the venv of the S3 test server (moto, from PyPI)
  iproute2 iputils-ping util-linux nftables # tests/cluster/hosts.sh: test hosts as network namespaces (ip, tc, unshare; nft drops packets)
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
