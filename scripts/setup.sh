#!/usr/bin/env bash
# Installs the Debian packages bertrain needs (idempotent: apt runs only when something is
# missing), then configures and builds it in ./build (Release).
#   scripts/setup.sh            what the demo needs: the packages to build and run bertrain, and
#                               the bertrain binary alone (no tests, no benchmarks)
#   scripts/setup.sh --tests    what scripts/test.sh needs besides: the test packages, then every
#                               target (tests, benchmarks, the man page and shell completion)
#   BUILD_DIR=out scripts/setup.sh
# The lists must name every package whose files configure, build, tests, demo and fuzz read, or a
# package that depends on it: scripts/check-packages.sh (run by scripts/test.sh) traces a
# configure and reads the build's dependency files and link lines, and fails naming any package
# outside the lists' dependency closure. That is how a package installed by hand on one machine
# cannot hide a missing line here.
set -euo pipefail
cd "$(dirname "$0")/.."

TESTS=0
case "${1:-}" in
  --tests) TESTS=1 ;;
  "") ;;
  -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "setup: unknown argument $1 (--tests, or nothing)" >&2; exit 2 ;;
esac

# To build bertrain and run the demo.
PACKAGES=(
  build-essential cmake pkg-config
  ccache                            # rebuilds of unchanged sources (ASan, CUDA, fuzz builds) from its cache
  libdnnl-dev                       # oneDNN: GEMM (fp32/bf16), post-op fusion
  ocl-icd-opencl-dev opencl-c-headers # read by oneDNN's CMake config (Debian builds it with OpenCL)
  libopenmpi-dev openmpi-bin        # processes and transport for data parallelism
  libprotobuf-dev protobuf-compiler # tf.Example, TensorBoard events
  libutf8proc-dev zlib1g-dev        # WordPiece Unicode; gzip TFRecords
  libcurl4-openssl-dev libssl-dev libpugixml-dev # object storage: transfers, SigV4 signing, XML replies
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
  python3 python3-venv              # the demo's S3 server (moto, from PyPI, in a venv outside the repository)
  iproute2 iputils-ping util-linux nftables # test hosts as network namespaces (ip, tc, unshare; nft drops packets)
)

# To run scripts/test.sh besides (setup.sh --tests).
TEST_PACKAGES=(
  clang-format
  libgtest-dev libgmock-dev libbenchmark-dev
  libboost-context-dev              # cuda_emu: the emulated GPU's threads as fibers (scripts/test.sh)
  clang libclang-rt-14-dev          # the fuzz target (libFuzzer + sanitizers) in scripts/test.sh
  libomp-14-dev                     # OpenMP for clang (the fuzz target's find_package(OpenMP))
  strace                            # scripts/check-packages.sh traces what configure reads
  chromium-headless-shell           # tests/report/render.sh renders `bertrain report` offline, checks the PNG
  python3-jsonschema python3-yaml   # tests/launch: the MPIJob manifests against the CRD schema
  slurmctld slurmd slurm-client munge # tests/launch/slurm_test.sh: a real Slurm runs the sbatch script
  help2man                          # the man page, made from bertrain --help (cmake --install, the .deb)
  mmdebstrap                        # tests/package: a clean Debian root to install the .deb into; the image's root
  podman runc                       # tests/package: the image built and run (runc: crun refuses hybrid cgroups)
)

t0=$SECONDS
wanted=("${PACKAGES[@]}")
[ "$TESTS" = 1 ] && wanted+=("${TEST_PACKAGES[@]}")
missing=()
for p in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "setup: packages installed in $((SECONDS - t0)) s"
fi
t0=$SECONDS

BUILD_DIR=${BUILD_DIR:-build}
if [ "$TESTS" = 1 ]; then
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_TESTS=ON -DBERTRAIN_BENCH=ON \
    ${CMAKE_ARGS:-} >/dev/null
  cmake --build "$BUILD_DIR" -j"$(nproc)"
  echo "setup: built $BUILD_DIR (bertrain, tests, benchmarks, man page) in $((SECONDS - t0)) s"
else
  # A new build directory is configured without tests and benchmarks (their packages may be
  # missing); one that --tests configured keeps them.
  parts=(-DBERTRAIN_TESTS=OFF -DBERTRAIN_BENCH=OFF)
  [ -f "$BUILD_DIR/CMakeCache.txt" ] && parts=()
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "${parts[@]}" ${CMAKE_ARGS:-} >/dev/null
  cmake --build "$BUILD_DIR" -j"$(nproc)" --target bertrain
  echo "setup: built $BUILD_DIR/bertrain in $((SECONDS - t0)) s"
fi
