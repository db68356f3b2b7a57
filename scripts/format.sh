#!/usr/bin/env bash
# clang-format over every C++/CUDA source. --check: fail (listing files) instead of rewriting.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files --cached --others --exclude-standard '*.h' '*.cpp' '*.cu' '*.cuh' 2>/dev/null || find src tests bench -name '*.[ch]pp' -o -name '*.h' -o -name '*.cu')
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${files[@]}"; do
    clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if ((${#bad[@]})); then
    echo "format: these files differ from .clang-format (run scripts/format.sh):"
    printf '  %s\n' "${bad[@]}"
    exit 1
  fi
  echo "format: ${#files[@]} files clean"
else
  clang-format -i "${files[@]}"
fi
