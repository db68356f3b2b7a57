// Matrix products on the CPU through oneDNN; primitives are created once per shape and reused.
// Layout: row-major; weights in PyTorch/HF layout weight[N,K] (out_features x in_features).
// Dimension letters: M rows (tokens), K input features, N output features.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/types.h"

namespace bertrain::kernels {

// The instruction set oneDNN's JIT uses for the matmuls here (after any BERTRAIN_ISA cap), e.g.
// "avx512_core_bf16".
const char* gemm_isa_name();
// Whether oneDNN can run bf16 matmuls on this CPU (AVX-512: natively with AVX-512 BF16, emulated
// on plain AVX-512; not on AVX2). Probed once with a tiny primitive.
bool gemm_bf16_available();
// Empty where bf16 matmuls run natively; otherwise a note for run headers: on AVX-512 without
// AVX-512 BF16 oneDNN emulates them, several times slower than fp32 (measured 0.25-0.4x).
std::string bf16_speed_note();
// One line for run headers and reports: the CPU model, the kernel bodies in use and oneDNN's ISA,
// and how bf16 matmuls run, so that every number says where it came from.
std::string cpu_description();

// C[M,N] (=|+=) op(A)·op(B) (+ bias[N]); op(X) = X or X^T as stored row-major with leading
// dimension ld*. With accumulate, C += result (bias must then be null).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float* C, int64_t ldc, const float* bias, bool accumulate);

// out[M,N] = inp[M,K] · weight[N,K]^T + bias[N] (bias may be null).
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t M,
                    int64_t N, int64_t K);

// Backward of linear_forward. dinp[M,K] = dout·weight (or += when accumulate_dinp; skipped when
// dinp is null); dweight[N,K] += dout^T·inp; dbias[N] += column sums of dout (if non-null).
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t M, int64_t N, int64_t K,
                     bool accumulate_dinp = false);

// An outer batch around gemm_batched's: `count` groups of products, group g at A + g*a,
// B + g*b, C + g*c (attention: the sequences around the heads of one sequence).
struct OuterBatch {
  int64_t count = 1, a = 0, b = 0, c = 0;
};

// `batch` independent products C_i = alpha * op(A_i)·op(B_i), matrix i at A + i*sa, B + i*sb,
// C + i*sc (one oneDNN call; strides let attention read heads straight out of the QKV rows),
// times the outer batch.
void gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  float alpha, const float* A, int64_t lda, int64_t sa, const float* B, int64_t ldb,
                  int64_t sb, float* C, int64_t ldc, int64_t sc, const OuterBatch& outer = {});

// The same with bf16 operands (raw bits), fp32 accumulation and output.
void gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  float alpha, const uint16_t* A, int64_t lda, int64_t sa, const uint16_t* B,
                  int64_t ldb, int64_t sb, float* C, int64_t ldc, int64_t sc,
                  const OuterBatch& outer = {});

// gemm with bf16 operands (A, B as raw bf16 bits), fp32 accumulation and output (oneDNN;
// AVX-512 BF16 instructions where the CPU has them, an emulation elsewhere).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const uint16_t* A,
          int64_t lda, const uint16_t* B, int64_t ldb, float* C, int64_t ldc, const float* bias,
          bool accumulate);

// Backend::linear_forward / linear_backward (kernels/backend.h) in precision p, the one place
// the CPU's linear layers dispatch on it. FP32: the fp32 products above. BF16: products on bf16
// operands (the kept input's bits, or the input / output gradient rounded into ws.half_a /
// ws.half_b), the weight's bf16 copy; results and gradients fp32. FP16 (no fp16 matmul on the
// CPU): fp32 products at the fp16 values (the kept input widened into ws.wide).
void linear_forward(Precision p, float* out, Kept in, Weight w, const float* bias, int64_t M,
                    int64_t N, int64_t K, const Workspace& ws);
void linear_backward(Precision p, float* dinp, float* dw, float* db, KeptIn dout, Kept in, Weight w,
                     int64_t M, int64_t N, int64_t K, bool accumulate_dinp, const Workspace& ws);

// While one is open on a thread, the gemm*() calls there only make (and cache) their oneDNN
// primitive and record the largest scratchpad it needs (bytes()); nothing is read or written.
// Kernels size their part of the kernel scratch (scratch.h) by running their own products
// under one, so the sizes come from the very calls they make. Queries nest (an inner one's
// bytes reach the outer).
class GemmScratchQuery {
 public:
  GemmScratchQuery();
  ~GemmScratchQuery();
  GemmScratchQuery(const GemmScratchQuery&) = delete;
  GemmScratchQuery& operator=(const GemmScratchQuery&) = delete;
  int64_t bytes() const { return bytes_; }
  static bool active();  // one is open on this thread
  // An operand address for the calls made under the query (never read or written).
  template <typename T>
  T* placeholder() const {
    return reinterpret_cast<T*>(placeholder_);
  }

 private:
  int64_t bytes_ = 0;
  int64_t* outer_;
  alignas(64) mutable std::byte placeholder_[64] = {};
};

// oneDNN's scratchpad bytes for the products of linear_forward*/linear_backward* on
// [M,K] x [N,K]^T, fp32 or bf16 operands.
int64_t linear_scratch_bytes(bool bf16, int64_t M, int64_t N, int64_t K);

// Plain triple loop in double accumulation: the oracle for gemm in tests.
void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                    const float* bias, bool accumulate);

}  // namespace bertrain::kernels
