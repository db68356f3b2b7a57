#!/usr/bin/env bash
# The GPU check, for a session lent the device machine (one H200, CUDA 13, none of our Debian
# libraries, about 15 minutes in all with its start): build here, run there once.
#   scripts/gpu-check.sh pack   here: the CUDA build for Hopper only (sm_90, build-gpu-pack/), its
#                               test binary and the CLI stripped, with every shared library they
#                               load except glibc's, cuBLAS's and the driver's, packed into
#                               gpu-pack.tar.xz (ignored; the device call carries it:
#                               carry ["gpu-pack.tar.xz"]). Fails when the working tree and the
#                               pack together would pass the 64 MiB the device machine accepts.
#   scripts/gpu-check.sh run    there (or here, where the GPU parts skip saying why): in the order
#                               of what a first GPU run is worth, each item under a time limit of
#                               its own and all within BUDGET seconds (450 unless set):
#                                 1. the host tests of the code the GPU shares (RowMath,
#                                    DeviceModel, DeviceMemory, BlasCalls, Reducer, GpuPlacement);
#                                 2. every GPU test (Cuda.*, CudaBackend.*, CudaModel.*,
#                                    CudaCounts.*, Nccl*) in one process, then each that did
#                                    not pass there in a process of its own;
#                                 3. compute-sanitizer on a few kernel tests, if present: memcheck,
#                                    then racecheck and synccheck on the fused attention's and
#                                    the LayerNorms' shared memory;
#                                 4. `bertrain doctor`'s GEMM ceiling beside PyTorch's;
#                                 5. BERT-Large 128 tokens bf16 against PyTorch (bench --device
#                                    cuda, bench/peer_pytorch.py: HF BertForPreTraining, SDPA,
#                                    autocast, fused AdamW, same batch): tokens/s, ratio, MFU;
#                                    with its forward and backward as CUDA graphs (the default)
#                                    and kernel by kernel (--cuda-graphs off), and with the
#                                    fused attention (--attention blocked);
#                                 6. where that step's GPU time goes, by operation;
#                                 7. the rest: BERT-base, fp16, 512 tokens (full and blocked
#                                    attention); BERT-Large on the bundled sample's real lengths
#                                    (padding skipped and computed, full and blocked attention)
#                                    and an fp16 step profiled; a BERT-tiny training run from the
#                                    CLI (BENCH=0 / TRAIN=0 skip them).
#                               PARTS="host gpu memcheck gemm large profile more real train": some
#                               (a second call, after fixes: what the first showed, or left
#                               unrun; docs/gpus.md has the 2026-12-04 runs: about 260 and 320 s);
#                               GPU_TESTS a gtest filter for part gpu (Cuda*:Nccl* unless set);
#                               ALL_TIMEOUT / TEST_TIMEOUT the limits of the one-process run of the
#                               GPU tests and of a test alone (240 and 60 s unless set).
#                               The log goes to $OUT/gpu-check.log from its first line; it ends
#                               with a summary in which a skipped test counts as not verified.
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=gpu-pack
LIMIT_MIB=64
case "${1:-}" in
  pack)
    NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
    [ -n "$NVCC" ] || { echo "gpu-check: nvcc not found (the CUDA toolkit builds the pack)"; exit 2; }
    cmake -S . -B build-gpu-pack -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA=ON -DBERTRAIN_BENCH=OFF \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
    cmake --build build-gpu-pack -j"$(nproc)" --target bertrain_tests bertrain
    rm -rf "$PACK" gpu-pack.tar.xz
    mkdir -p "$PACK/bin" "$PACK/lib"
    cp build-gpu-pack/tests/bertrain_tests build-gpu-pack/bertrain "$PACK/bin/"
    strip "$PACK"/bin/*
    ldd build-gpu-pack/tests/bertrain_tests build-gpu-pack/bertrain | awk '/=> \//{print $3}' |
      sort -u | while read -r lib; do
        case "$(basename "$lib")" in
          libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | ld-linux* | libcublas* | \
            libcuda.so*) ;;
          *) cp -L "$lib" "$PACK/lib/" ;;
        esac
      done
    tar -C "$PACK" -cf - . | xz -T0 -6 >gpu-pack.tar.xz
    rm -rf "$PACK"
    # What the device call copies: tracked and untracked files git does not ignore, and the pack.
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null |
      tail -1 | cut -f1)
    pack=$(stat -c %s gpu-pack.tar.xz)
    total=$(((tree + pack) / 1048576))
    echo "gpu-check: gpu-pack.tar.xz $((pack / 1048576)) MiB + working tree $((tree / 1048576)) MiB" \
      "= ${total} MiB of the device machine's ${LIMIT_MIB}"
    if [ "$total" -ge "$LIMIT_MIB" ]; then
      echo "gpu-check: too large to carry: make the tree or the pack smaller" >&2
      exit 1
    fi
    echo "gpu-check: on the device: scripts/gpu-check.sh run, carrying gpu-pack.tar.xz"
    ;;
  run)
    LOG=${OUT:-.}/gpu-check.log
    exec > >(tee "$LOG") 2>&1
    echo "== gpu-check $(date -u +%FT%TZ) on $(hostname)"
    if [ -f gpu-pack.tar.xz ]; then
      rm -rf "$PACK" && mkdir -p "$PACK"
      if command -v xz >/dev/null; then
        xz -dc gpu-pack.tar.xz | tar -C "$PACK" -xf -
      else  # (no xz there: Python's tarfile reads it)
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
          gpu-pack.tar.xz "$PACK"
      fi
    fi
    [ -x "$PACK/bin/bertrain_tests" ] ||
      { echo "gpu-check: no $PACK/bin/bertrain_tests: run 'scripts/gpu-check.sh pack' first"; exit 2; }
    # cuBLAS and NCCL (NCCL loaded at run time by comm/nccl.h): the toolkit's, else those
    # PyTorch's wheels bring, wherever their layout puts them (nvidia/cublas/lib and
    # nvidia/nccl/lib for CUDA 12 wheels, nvidia/cu13/lib for the CUDA 13 toolkit wheel).
    CUDALIBS=""
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [ -d "$d" ] && CUDALIBS="$CUDALIBS:$d"; done
    PYLIBS=$(python3 - 2>/dev/null <<'PY' || true
import glob, os
import nvidia
dirs = {os.path.dirname(p) for root in nvidia.__path__
        for name in ("libcublasLt.so.*", "libnccl.so.*")
        for p in glob.glob(os.path.join(root, "*", "lib", name))}
print(":".join(sorted(dirs)))
PY
    )
    [ -n "$PYLIBS" ] && CUDALIBS="$CUDALIBS:$PYLIBS"
    # The packed libraries for our binaries only: PyTorch's process keeps its own.
    OUR_LIBS="$PWD/$PACK/lib$CUDALIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    ours() { LD_LIBRARY_PATH="$OUR_LIBS" "$@"; }
    TESTS="$PACK/bin/bertrain_tests"
    BT="$PACK/bin/bertrain"
    export BERTRAIN_TEST_DATA="$PWD/tests" BERTRAIN_BIN="$PWD/$BT" OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
    BUDGET=${BUDGET:-450}
    # The parts to run (all unless PARTS names some): host gpu memcheck gemm large profile more train.
    wants() { [[ " ${PARTS:-host gpu memcheck gemm large profile more real train} " == *" $1 "* ]]; }
    # An item's time limit: its own, cut to what is left of the budget (0: skip it, saying so).
    limit() {
      local left=$((BUDGET - SECONDS))
      if [ "$left" -lt 10 ]; then
        echo "gpu-check: ${SECONDS} s, past the ${BUDGET} s budget: $2 skipped" >&2
        echo 0
      else
        echo $((left < $1 ? left : $1))
      fi
    }
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    else
      echo "no nvidia-smi: no NVIDIA driver here (the GPU tests skip)"
    fi
    echo "library path (ours): $OUR_LIBS"
    if ours ldd "$TESTS" | grep "not found"; then echo "gpu-check: libraries missing (above)"; fi
    set +e
    PASSED=() FAILED=() SKIPPED=()
    # 1. The host tests of the shared code, together.
    t=$(limit 60 "the host tests")
    if wants host && [ "$t" -gt 0 ]; then
      ours timeout "$t" "$TESTS" --gtest_brief=1 \
        --gtest_filter='*RowMath*:DeviceModel*:DeviceMemory*:BlasCalls*:Reducer*:GpuPlacement*'
      [ $? = 0 ] && PASSED+=("host tests") || FAILED+=("host tests")
    fi
    # 2. Every GPU test, first all in one process (one context, fast), then each test that did not
    # pass or skip there again in a process of its own under a limit: a kernel that faults leaves
    # its CUDA context unusable (every later test in that process fails too, or never runs), so
    # only the test's own process says whether it fails.
    ONE=$(mktemp) ALL=$(mktemp)
    echo "gpu-check: the GPU tests from ${SECONDS} s"
    FILTER=${GPU_TESTS:-Cuda*:Nccl*}
    wants gpu || FILTER=-
    NAMES=$(ours "$TESTS" --gtest_list_tests --gtest_filter="$FILTER" |
      awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}')
    t=$(limit "${ALL_TIMEOUT:-240}" "the GPU tests in one process")
    [ "$t" -gt 0 ] && ours timeout "$t" "$TESTS" --gtest_filter="$FILTER" >"$ALL" 2>&1
    count() { grep -c "^\[ *$1 *\] [A-Za-z].* ([0-9]* ms)\$" "$ALL"; }
    echo "gpu-check: one process: $(count OK) passed, $(count SKIPPED) skipped, $(count FAILED)" \
      "failed of $(echo "$NAMES" | wc -w), ${SECONDS} s"
    for name in $NAMES; do
      if grep -q "^\[       OK \] $name (" "$ALL"; then
        echo "PASS $name ($(sed -n "s/^\[       OK \] $name (\(.*\))/\1/p" "$ALL"))"
        PASSED+=("$name")
        continue
      fi
      if grep -q "^\[  SKIPPED \] $name (" "$ALL"; then
        why=$(sed -n "/^\[ RUN      \] $name\$/,/^\[  SKIPPED \] $name (/p" "$ALL" |
          grep -m1 -A1 "Skipped" | tail -1)
        echo "SKIP $name: $why"
        SKIPPED+=("$name ($why)")
        continue
      fi
      t=$(limit "${TEST_TIMEOUT:-60}" "$name")
      [ "$t" -gt 0 ] || { SKIPPED+=("$name (past the budget)"); continue; }
      ours timeout "$t" "$TESTS" --gtest_filter="$name" >"$ONE" 2>&1
      rc=$?
      if [ $rc = 0 ] && grep -q "^\[  SKIPPED \] $name" "$ONE"; then
        why=$(grep -m1 -A1 "Skipped" "$ONE" | tail -1)
        echo "SKIP $name: $why"
        SKIPPED+=("$name ($why)")
      elif [ $rc = 0 ]; then
        echo "PASS $name, alone ($(sed -n "s/^\[       OK \] $name (\(.*\))/\1/p" "$ONE"))"
        PASSED+=("$name")
      else
        [ $rc = 124 ] && echo "TIMEOUT $name ($t s)" || echo "FAIL $name (exit $rc)"
        grep -v "^\[ *\(RUN\|OK\|==\|--\)" "$ONE" | tail -40
        FAILED+=("$name")
      fi
    done
    rm -f "$ALL"
    # 3. compute-sanitizer's memcheck on the kernel tests (out-of-bounds and misaligned accesses
    # on the real memory system), where the toolkit is there.
    CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
    t=$(limit 90 "compute-sanitizer")
    why=""
    [ -z "$CS" ] && why="no compute-sanitizer here"
    wants memcheck || why="not asked for (PARTS)"
    command -v nvidia-smi >/dev/null || why="no GPU here"
    if [ -n "$why" ]; then
      echo "gpu-check: memcheck not run ($why)"
      SKIPPED+=("memcheck ($why)")
    elif [ "$t" -gt 0 ]; then
      ours timeout "$t" "$CS" --tool memcheck --error-exitcode 9 "$TESTS" \
        --gtest_filter='Cuda.LayerNorm*:Cuda.Attention*:Cuda.CrossEntropy*:Cuda.Optimizer*:CudaBackend.Attention*:CudaBackend.FusedAttentionTakesVariableLengthsInOneCall:CudaBackend.ResidualLayerNorm*' \
        >"$ONE" 2>&1
      rc=$?
      tail -15 "$ONE"
      [ $rc = 0 ] && PASSED+=("memcheck") || FAILED+=("memcheck (exit $rc)")
      # Shared memory shared by a block's warps: the fused attention's staged tiles (four warps
      # a block; the emulated device runs a block's threads in turn, so a missing barrier there
      # may still read what it should) and the LayerNorm kernels' block sums: racecheck for
      # hazards, synccheck for barriers not all threads reach.
      for tool in racecheck synccheck; do
        t=$(limit 60 "compute-sanitizer $tool")
        [ "$t" -gt 0 ] || break
        ours timeout "$t" "$CS" --tool "$tool" --error-exitcode 9 "$TESTS" \
          --gtest_filter='CudaBackend.FusedAttentionTakesVariableLengthsInOneCall:Cuda.LayerNormMatchesCpu:Cuda.FusedLayerNormBlocksMatchCpu' \
          >"$ONE" 2>&1
        rc=$?
        tail -8 "$ONE"
        if [ $rc = 0 ]; then
          PASSED+=("$tool")
        elif [ $rc = 124 ]; then
          SKIPPED+=("$tool (not done in $t s)")
        else
          FAILED+=("$tool (exit $rc)")
        fi
      done
    fi
    rm -f "$ONE"
    # 4. The GEMM ceiling: ours (cuBLASLt, bertrain doctor) and PyTorch's on the same GPU.
    t=$(limit 60 "the GEMM ceilings")
    if wants gemm && [ "$t" -gt 0 ]; then
      OURS=$(ours timeout "$t" "$BT" doctor 2>&1 | grep -E "^ *[a-z]+ +gpu" | tee /dev/stderr |
        sed -n 's/.*gpu gemm *\([0-9.]*\) TFLOP\/s bf16.*/\1/p')
      timeout "$t" python3 - "${OURS:-0}" <<'PY' || echo "gpu-check: no PyTorch GEMM here"
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu-check: PyTorch sees no GPU")
n = 8192
a = torch.rand(n, n, device="cuda", dtype=torch.bfloat16) * 2 - 1
b = torch.rand(n, n, device="cuda", dtype=torch.bfloat16) * 2 - 1
for _ in range(3):
    a @ b.T
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(50):
    a @ b.T
e.record()
torch.cuda.synchronize()
tf = 2 * n**3 * 50 / (s.elapsed_time(e) * 1e-3) / 1e12
ours = float(sys.argv[1])
print(f"pytorch gemm: {tf:.1f} TFLOP/s bf16 (torch {torch.__version__}, a @ b.T, {n}^3); "
      f"bertrain/pytorch {ours / tf:.2f}")
PY
    fi
    # 5-7. Training steps against PyTorch on the same GPU, same batch; the most telling first.
    bench() {  # config seq predictions batch precision attention [more bench options]
      local t name="$1/$2/$6${7:+ ${*:7}}"
      t=$(limit 100 "$name $5")
      [ "$t" -gt 0 ] || return 0
      local bt pt
      bt=$(ours timeout $((t / 2)) "$BT" bench --device cuda --model-config "configs/$1.json" \
        --seq-len "$2" --max-predictions "$3" --batch-size "$4" --precision "$5" --attention "$6" \
        "${@:7}" --steps 5 --warmup 2 --json 2>&1 | tail -1)
      pt=$(timeout $((t / 2)) python3 bench/peer_pytorch.py --device cuda --model-config \
        "configs/$1.json" --seq-len "$2" --max-predictions "$3" --batch-size "$4" --precision "$5" \
        --steps 5 --warmup 2 2>&1 | tail -1)
      python3 - "$name" "$5" "$4x$2" "$bt" "$pt" <<'PY'
import json, sys
name, prec, batch, bt, pt = sys.argv[1:]
try:
    b, p = json.loads(bt), json.loads(pt)
except ValueError:  # one side failed: its last line says why
    sys.exit(print(f"{name:<24} {prec:<4} {batch:<9} bertrain: {bt[:150]} | pytorch: {pt[:150]}"))
gib = lambda x: f"{x / 2**30:.1f}GiB"
print(f"{name:<24} {prec:<4} {batch:<9} {b['tokens_per_s']:12.0f} {p['tokens_per_s']:12.0f} "
      f"{b['tokens_per_s'] / p['tokens_per_s']:6.2f} {b['mfu'] * 100:5.0f}% "
      f"{gib(b['allocated_bytes']):>10} {gib(p['gpu_peak_allocated_bytes']):>10}  "
      f"(torch {p.get('torch')}, transformers {p.get('transformers')}, {p.get('attention')})")
PY
    }
    if [ "${BENCH:-1}" = 1 ]; then
      echo "gpu-check: the benchmarks from ${SECONDS} s"
      printf "%-24s %-4s %-9s %12s %12s %6s %6s %10s %10s\n" config prec "batch" "bertrain t/s" \
        "pytorch t/s" ratio MFU "bt GPU" "pt GPU"
      wants large && bench bert-large 128 20 32 bf16 auto
      # (the same launched kernel by kernel: what the CUDA graphs save)
      wants large && bench bert-large 128 20 32 bf16 auto --cuda-graphs off
      # (the fused attention, FlashAttention-2's layout since its first H200 run: whether auto
      # should pick it, cuda::full_attention_preferred)
      wants large && bench bert-large 128 20 32 bf16 blocked
      # Where a BERT-Large step's GPU time goes, by operation: the map for what to speed up next
      # (kernel by kernel: a graph is timed whole).
      t=$(limit 90 "the profiled BERT-Large run")
      wants profile && [ "$t" -gt 0 ] && {
        BERTRAIN_CUDA_PROFILE=1 ours timeout "$t" "$BT" bench --device cuda \
          --model-config configs/bert-large.json --seq-len 128 --max-predictions 20 \
          --batch-size 32 --precision bf16 --steps 3 --warmup 1 --cuda-graphs off ||
          echo "gpu-check: the profiled BERT-Large run failed (above)"
      }
      # (the fused attention's two kernels beside the full kernel's operations above)
      t=$(limit 60 "the profiled BERT-Large run, fused attention")
      wants profile && [ "$t" -gt 0 ] && {
        BERTRAIN_CUDA_PROFILE=1 ours timeout "$t" "$BT" bench --device cuda \
          --model-config configs/bert-large.json --seq-len 128 --max-predictions 20 \
          --batch-size 32 --precision bf16 --steps 3 --warmup 1 --cuda-graphs off \
          --attention blocked || echo "gpu-check: the profiled fused-attention run failed (above)"
      }
      if wants more; then
        bench bert-large 512 80 8 bf16 auto
        bench bert-base 128 20 32 bf16 auto
        bench bert-large 128 20 32 fp16 auto
        bench bert-large 512 80 8 bf16 blocked
        bench bert-base 128 20 32 fp16 auto
        bench bert-large 512 80 8 fp16 auto
      fi
    fi
    # BERT-Large on real lengths (the bundled English sample, prepared here): the full attention
    # (auto) and the blocked one (fused: every length in one launch), the padding skipped and
    # computed on the same batches, launches and host synchronisations counted; and where an fp16
    # step's time goes.
    if wants real; then
      RD=$(mktemp -d)
      ours "$BT" prepare --input data/corpus/bert_sample_text.txt \
        --vocab data/vocab/bert-base-uncased-vocab.txt --output "$RD" --seq-len 128 \
        --max-predictions 20 --dupe-factor 20 --output-shards 1 >/dev/null
      for att in auto blocked; do
        t=$(limit 60 "real lengths, $att attention")
        [ "$t" -gt 0 ] || continue
        echo "gpu-check: BERT-Large on the sample's real lengths, --attention $att"
        ours timeout "$t" "$BT" bench --device cuda --model-config configs/bert-large.json \
          --data "$RD/*.tfrecord" --seq-len 128 --max-predictions 20 --batch-size 32 \
          --precision bf16 --attention "$att" --padding both --steps 4 --warmup 4 2>&1 |
          grep -E "^bench|^  (step|throughput|compute|device|data|padding)|^  --|ratio|skip"
      done
      rm -rf "$RD"
      t=$(limit 60 "the profiled fp16 run")
      [ "$t" -gt 0 ] && BERTRAIN_CUDA_PROFILE=1 ours timeout "$t" "$BT" bench --device cuda \
        --model-config configs/bert-large.json --seq-len 128 --max-predictions 20 \
        --batch-size 32 --precision fp16 --steps 3 --warmup 1 --cuda-graphs off 2>&1 | head -40
    fi
    # A training run from the CLI on the GPU: BERT-tiny on the bundled English sample, LAMB, bf16,
    # checkpoints (the run's summary names the bottleneck).
    t=$(limit 120 "the training run from the CLI")
    if [ "${TRAIN:-1}" = 1 ] && wants train && [ "$t" -gt 0 ]; then
      echo "gpu-check: the training run from ${SECONDS} s"
      GC=$(mktemp -d)
      ours "$BT" prepare --input data/corpus/bert_sample_text.txt \
        --vocab data/vocab/bert-base-uncased-vocab.txt --output "$GC/data" --seq-len 128 \
        --max-predictions 20 --dupe-factor 5 --output-shards 2 >/dev/null &&
        ours timeout "$t" "$BT" train --device cuda --model-config configs/bert-tiny.json \
          --data "$GC/data/*.tfrecord" --output "$GC/run" --batch-size 32 --steps 100 \
          --log-every 25 --save-every 50 --optimizer lamb --lr 5e-3 --precision bf16 ||
        echo "gpu-check: the GPU training run failed (above)"
      rm -rf "$GC"
    fi
    # The summary: a skipped test proves nothing (one GPU: every two-GPU test skips).
    echo "gpu-check: done in ${SECONDS} s: ${#PASSED[@]} passed, ${#FAILED[@]} failed," \
      "${#SKIPPED[@]} not verified (skipped)"
    for f in "${FAILED[@]}"; do echo "  failed: $f"; done
    for s in "${SKIPPED[@]}"; do echo "  not verified: $s"; done
    echo "gpu-check: tests exit $((${#FAILED[@]} > 0))"
    [ "${#FAILED[@]}" = 0 ]
    ;;
  *)
    echo "usage: scripts/gpu-check.sh pack|run"
    exit 2
    ;;
esac
