#!/usr/bin/env bash
# The test command: sets up (installs what is missing, builds), checks formatting, runs every
# test with ctest. No Python, no network beyond Debian's packages, no GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/format.sh --check
BUILD_DIR=${BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" --timeout 600
