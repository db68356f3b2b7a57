#!/bin/bash
# The build enforces the layers: a part compiles with its own include directory plus those of the
# parts it links (CMakeLists.txt, bertrain_part), so an include against the arrows fails.
# For each part: a header it may use compiles; a header of a part above or beside it does not,
# nor a private header of the kernels (kernels/cpu/*, kernels/cuda/*: the rest of bertrain reaches
# the kernels through kernels/backend.h alone). And no code outside src/kernels/ asks the build
# whether the CUDA backend is built (#if BERTRAIN_CUDA): kernels/backend.h's registry says.
# usage: check.sh <c++ compiler> <part>=<its include directories, ':'-separated>...
#   (tests/CMakeLists.txt passes each part's INCLUDE_DIRECTORIES as the build computes them)
set -u
CXX=$1
shift
declare -A SEES=()
for arg in "$@"; do SEES[${arg%%=*}]=${arg#*=}; done
# part | a header it must reach | a header it must not reach
CASES=(
  "core core/error.h kernels/cpu/matmul.h"
  "kernels kernels/cpu/matmul.h model/bert.h"
  "data data/pipeline.h model/bert.h"
  "data data/schema.h comm/communicator.h"
  "data data/tfrecord.h prep/wordpiece.h"
  "prep prep/wordpiece.h model/bert.h"
  "prep data/tfrecord.h tasks/task_files.h"
  "tasks tasks/task_files.h model/bert.h"
  "tasks prep/wordpiece.h train/finetune.h"
  "obs obs/doctor.h model/bert.h"
  "obs obs/timeline.h kernels/backend.h"
  "comm comm/reducer.h model/bert.h"
  "comm kernels/backend.h kernels/cuda/cuda.h"
  "comm kernels/types.h kernels/cpu/matmul.h"
  "model kernels/backend.h kernels/cpu/scratch.h"
  "model model/bert.h train/optimizer.h"
  "model model/params.h comm/communicator.h"
  "plan plan/memory.h train/step.h"
  "train train/step.h cli/commands.h"
  "train tasks/qa.h cli/commands.h"
  "train kernels/backend.h kernels/cpu/matmul.h"
  "train kernels/embedding_runs.h kernels/cuda/scratch.h"
  "cli cli/commands.h kernels/cuda/cuda.h"
  "cli kernels/backend.h kernels/cpu/matmul.h"
  "launch launch/job.h model/bert.h"
)
failed=0
compile() {  # part header
  local flags=(-std=c++20 -fsyntax-only -x c++) dirs
  IFS=: read -ra dirs <<<"${SEES[$1]}"
  for d in "${dirs[@]}"; do flags+=(-I"$d"); done
  echo "#include \"$2\"" | "$CXX" "${flags[@]}" - 2>&1
}
for c in "${CASES[@]}"; do
  read -r part ok bad <<<"$c"
  if ! out=$(compile "$part" "$ok"); then
    echo "FAIL: $part cannot include $ok, which its layer allows:"; echo "$out" | head -5
    failed=1
  fi
  if out=$(compile "$part" "$bad"); then
    echo "FAIL: $part can include $bad, against the layers"
    failed=1
  elif ! grep -q "$bad: No such file" <<<"$out"; then
    echo "FAIL: $part including $bad failed for another reason:"; echo "$out" | head -5
    failed=1
  else
    echo "ok: $part reaches $ok, not $bad"
  fi
done
# The build's CUDA switch stays below the kernels' interface.
SRC=$(cd "$(dirname "$0")/../../src" && pwd)
if hits=$(grep -rnE '^\s*#\s*(if|ifdef|ifndef|elif).*BERTRAIN_CUDA' "$SRC" --include='*.cpp' \
            --include='*.h' --include='*.cu' --include='*.cuh' | grep -v "^$SRC/kernels/"); then
  echo "FAIL: code above src/kernels/ asks whether the CUDA backend is built (use kernels::gpu_built):"
  echo "$hits"
  failed=1
else
  echo "ok: no #if BERTRAIN_CUDA outside src/kernels/"
fi
exit $failed
