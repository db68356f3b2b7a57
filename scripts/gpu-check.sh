#!/usr/bin/env bash
# The GPU check (#16), for a session lent the device machine (one H200, CUDA 13, none of our
# Debian libraries): build here, run there.
#   scripts/gpu-check.sh pack   here: the CUDA build (build-cuda/), its test binary and the CLI
#                               stripped, with every shared library they load except glibc's and
#                               cuBLAS's (the device has CUDA 13), packed into gpu-pack.tar.xz
#                               (ignored; carry it: run's `carry: ["gpu-pack.tar.xz"]`)
#   scripts/gpu-check.sh run    there (or here, where the GPU tests skip): unpacks it and runs
#                               every GPU test (Cuda.*: each CUDA kernel against the CPU kernel;
#                               CudaBackend.*: the CUDA backend against the CPU backend in every
#                               precision; CudaModel.*: BertModel and train::Step on the GPU
#                               against the CPU: every gradient, HuggingFace's golden, a
#                               300-step loss curve, checkpoints both ways, a run stopped on
#                               one device resumed on the other; Nccl*: NCCL on one GPU, and with two
#                               or more the sums, half the batch on each GPU against one at the
#                               whole, a rank that never joins) and the host tests of what they
#                               share (RowMath, DeviceModel, DeviceMemory, BlasCalls, Reducer,
#                               GpuPlacement), then
#                               `bertrain doctor`'s GEMM ceiling
#                               beside PyTorch's; the log goes to $OUT/gpu-check.log.
#                               Then BERT-base and BERT-Large training steps (bench --device
#                               cuda) against PyTorch on the same GPU: tokens/s, ratio, MFU
#                               against the GEMM ceiling measured in the run, GPU memory
#                               and where a BERT-Large step's GPU time goes by operation
#                               (BERTRAIN_CUDA_PROFILE=1) (BENCH=0 skips them; past BUDGET
#                               seconds, 480 unless set, the rest are skipped), after a
#                               BERT-tiny training run
#                               from the CLI on the GPU (train --device cuda; TRAIN=0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=gpu-pack
case "${1:-}" in
  pack)
    NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
    [ -n "$NVCC" ] || { echo "gpu-check: nvcc not found (the CUDA toolkit builds the pack)"; exit 2; }
    cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA=ON -DBERTRAIN_BENCH=OFF \
      -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
    cmake --build build-cuda -j"$(nproc)" --target bertrain_tests bertrain
    rm -rf "$PACK" gpu-pack.tar.xz
    mkdir -p "$PACK/bin" "$PACK/lib"
    cp build-cuda/tests/bertrain_tests build-cuda/bertrain "$PACK/bin/"
    strip "$PACK"/bin/*
    ldd build-cuda/tests/bertrain_tests build-cuda/bertrain | awk '/=> \//{print $3}' | sort -u |
      while read -r lib; do
        case "$(basename "$lib")" in
          libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | ld-linux* | libcublas* | \
            libcuda.so*) ;;
          *) cp -L "$lib" "$PACK/lib/" ;;
        esac
      done
    tar -C "$PACK" -cf - . | xz -T0 -6 >gpu-pack.tar.xz
    echo "gpu-check: gpu-pack.tar.xz $(du -h gpu-pack.tar.xz | cut -f1) ($(ls "$PACK/lib" | wc -l) libraries);" \
      "on the device: scripts/gpu-check.sh run, carrying gpu-pack.tar.xz"
    ;;
  run)
    if [ -f gpu-pack.tar.xz ]; then
      rm -rf "$PACK" && mkdir -p "$PACK" && xz -dc gpu-pack.tar.xz | tar -C "$PACK" -xf -
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
    export LD_LIBRARY_PATH="$PWD/$PACK/lib$CUDALIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    LOG=${OUT:-.}/gpu-check.log
    # The whole run fits the issue's 10 minutes and a device call's limit: past BUDGET seconds
    # (the tests always run; they come first) the remaining benchmarks are skipped, saying so.
    BUDGET=${BUDGET:-480}
    past_budget() {
      [ "$SECONDS" -le "$BUDGET" ] && return 1
      echo "gpu-check: ${SECONDS} s, past the ${BUDGET} s budget: $1 skipped"
    }
    {
      echo "== gpu-check $(date -u +%FT%TZ) on $(hostname)"
      if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      else
        echo "no nvidia-smi: no NVIDIA driver here (the GPU tests skip)"
      fi
      echo "library path: $LD_LIBRARY_PATH"
      if ldd "$PACK/bin/bertrain_tests" | grep "not found"; then echo "gpu-check: libraries missing (above)"; fi
      set +e
      # Each GPU test in a process of its own under a time limit: a kernel that faults leaves its
      # CUDA context unusable (every later test in that process would fail too) and a hang would
      # eat the device time; the host tests of the shared code run together.
      export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
      "$PACK/bin/bertrain_tests" --gtest_brief=1 \
        --gtest_filter='*RowMath*:DeviceModel*:DeviceMemory*:BlasCalls*:Reducer*:GpuPlacement*'
      FAILED=$?
      ONE=$(mktemp)
      for t in $("$PACK/bin/bertrain_tests" --gtest_list_tests --gtest_filter='Cuda*:Nccl*' |
        awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}'); do
        timeout "${TEST_TIMEOUT:-150}" "$PACK/bin/bertrain_tests" --gtest_filter="$t" >"$ONE" 2>&1
        rc=$?
        if [ $rc = 0 ] && grep -q "^\[  SKIPPED \] $t" "$ONE"; then
          echo "SKIP $t: $(grep -m1 -A1 "Skipped" "$ONE" | tail -1)"
        elif [ $rc = 0 ]; then
          echo "PASS $t ($(sed -n "s/^\[       OK \] $t (\(.*\))/\1/p" "$ONE"))"
        else
          FAILED=1
          [ $rc = 124 ] && echo "TIMEOUT $t (${TEST_TIMEOUT:-150} s)" || echo "FAIL $t (exit $rc)"
          grep -v "^\[ *\(RUN\|OK\|==\|--\)" "$ONE" | tail -40
        fi
      done
      rm -f "$ONE"
      echo "gpu-check: tests exit $FAILED (at ${SECONDS} s)"
      # The GEMM ceiling: ours (cuBLASLt, bertrain doctor) and PyTorch's on the same GPU.
      OURS=$("$PACK/bin/bertrain" doctor 2>&1 | grep -E "^ *[a-z]+ +gpu" | tee /dev/stderr |
        sed -n 's/.*gpu gemm *\([0-9.]*\) TFLOP\/s bf16.*/\1/p')
      python3 - "${OURS:-0}" <<'PY' || echo "gpu-check: no PyTorch peer here"
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
      # A training run from the CLI on the GPU: BERT-tiny on the bundled English sample, LAMB,
      # bf16, checkpoints (the run's summary names the bottleneck).
      if [ "${TRAIN:-1}" = 1 ] && ! past_budget "the training run from the CLI"; then
        echo "gpu-check: the training run from ${SECONDS} s"
        GC=$(mktemp -d)
        "$PACK/bin/bertrain" prepare --input data/corpus/bert_sample_text.txt \
          --vocab data/vocab/bert-base-uncased-vocab.txt --output "$GC/data" --seq-len 128 \
          --max-predictions 20 --dupe-factor 5 --output-shards 2 >/dev/null &&
          timeout 180 "$PACK/bin/bertrain" train --device cuda --model-config configs/bert-tiny.json \
            --data "$GC/data/*.tfrecord" --output "$GC/run" --batch-size 32 --steps 100 \
            --log-every 25 --save-every 50 --optimizer lamb --lr 5e-3 --precision bf16 ||
          echo "gpu-check: the GPU training run failed (above)"
        rm -rf "$GC"
      fi
      # BERT-base and BERT-Large training steps against PyTorch on the same GPU (bench/peer_pytorch.py
      # --device cuda: HF BertForPreTraining, SDPA, autocast, fused AdamW), same batch.
      if [ "${BENCH:-1}" = 1 ]; then
        echo "gpu-check: the benchmarks from ${SECONDS} s"
        printf "%-24s %-4s %-9s %12s %12s %6s %6s %10s %10s\n" config prec "batch" "bertrain t/s" \
          "pytorch t/s" ratio MFU "bt GPU" "pt GPU"
        # 512 tokens: the blocked attention kernel (auto), then the full one in bf16 beside it.
        for run in "bert-base 128 20 32" "bert-large 128 20 32" "bert-large 512 80 8" \
          "bert-large 512 80 8 full"; do
          set -- $run
          ATT=${5:-auto}
          for prec in bf16 fp16; do
            [ "$ATT" = full ] && [ "$prec" = fp16 ] && continue
            past_budget "$1/$2${5:+/$5} $prec" && continue
            BT=$(timeout 120 "$PACK/bin/bertrain" bench --device cuda --model-config "configs/$1.json" \
              --seq-len "$2" --max-predictions "$3" --batch-size "$4" --precision "$prec" \
              --attention "$ATT" --steps 5 --warmup 2 --json 2>&1 | tail -1)
            PT=$(timeout 120 python3 bench/peer_pytorch.py --device cuda --model-config "configs/$1.json" \
              --seq-len "$2" --max-predictions "$3" --batch-size "$4" --precision "$prec" \
              --steps 5 --warmup 2 2>&1 | tail -1)
            python3 - "$1/$2${5:+/$5}" "$prec" "$4x$2" "$BT" "$PT" <<'PY'
import json, sys
name, prec, batch, bt, pt = sys.argv[1:]
try:
    b, p = json.loads(bt), json.loads(pt)
except ValueError:  # one side failed: its last line says why
    sys.exit(print(f"{name:<24} {prec:<4} {batch:<9} bertrain: {bt[:150]} | pytorch: {pt[:150]}"))
gib = lambda x: f"{x / 2**30:.1f}GiB"
print(f"{name:<24} {prec:<4} {batch:<9} {b['tokens_per_s']:12.0f} {p['tokens_per_s']:12.0f} "
      f"{b['tokens_per_s'] / p['tokens_per_s']:6.2f} {b['mfu'] * 100:5.0f}% "
      f"{gib(b['allocated_bytes']):>10} {gib(p['gpu_peak_allocated_bytes']):>10}")
PY
          done
        done
        # Where a BERT-Large step's GPU time goes, by operation: the map for what to speed up next.
        past_budget "the profiled BERT-Large run" ||
          BERTRAIN_CUDA_PROFILE=1 timeout 120 "$PACK/bin/bertrain" bench --device cuda \
            --model-config configs/bert-large.json --seq-len 128 --max-predictions 20 \
            --batch-size 32 --precision bf16 --steps 3 --warmup 1 ||
          echo "gpu-check: the profiled BERT-Large run failed (above)"
      fi
      echo "gpu-check: done in ${SECONDS} s"
    } 2>&1 | tee "$LOG"
    grep -q "tests exit 0" "$LOG"
    ;;
  *)
    echo "usage: scripts/gpu-check.sh pack|run"
    exit 2
    ;;
esac
