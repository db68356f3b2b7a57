// How the CUDA backend calls cuBLASLt and cuBLAS, as plain data: our tensors are row-major, the
// libraries' matrices column-major, and a row-major [r, c] tensor with leading dimension ld is the
// column-major c x r matrix with the same ld. So row-major C = op(A) op(B) is the column-major
// C^T = op(B)^T op(A)^T: the operands swapped, each keeping its transpose flag. Plain C++,
// compiled in every build: the host tests (RowMath.BlasCallsComputeTheRowMajorProducts) run each
// call through a column-major reference GEMM with BLAS's semantics against the row-major product
// it stands for, and check every leading dimension against the stored matrix it describes (what
// cuBLAS would refuse), so that on a GPU only the library's own arithmetic is new.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_products.h"

namespace bertrain::cuda {

// Column-major C (m x n) = alpha op(A) (m x k) . op(B) (k x n) + beta C, as cublasLtMatmul and
// cublasGemmBatchedEx take it; A, B and C name which of the caller's buffers each one is.
struct ColumnMajorCall {
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  // The stored (column-major) sizes of A and B: m x k, or k x m read transposed (cuBLASLt's
  // matrix layouts; cuBLAS requires each leading dimension to be at least the stored rows).
  int64_t a_rows() const { return trans_a ? k : m; }
  int64_t a_cols() const { return trans_a ? m : k; }
  int64_t b_rows() const { return trans_b ? n : k; }
  int64_t b_cols() const { return trans_b ? k : n; }
  bool valid() const {
    return m >= 0 && n >= 0 && k >= 0 && lda >= (a_rows() > 1 ? a_rows() : 1) &&
           ldb >= (b_rows() > 1 ? b_rows() : 1) && ldc >= (m > 1 ? m : 1);
  }
};

// A linear layer out[M,N] = in[M,K] . w[N,K]^T (+ bias): A = w, B = in, C = out (the bias, one
// per column-major row, is cuBLASLt's epilogue).
inline ColumnMajorCall linear_forward_call(int64_t M, int64_t N, int64_t K) {
  return {true, false, N, M, K, K, K, N};
}
// Its input gradient dinp[M,K] (+)= dout[M,N] . w[N,K]: A = w, B = dout, C = dinp.
inline ColumnMajorCall linear_dinp_call(int64_t M, int64_t N, int64_t K) {
  return {false, false, K, M, N, K, N, K};
}
// Its weight gradient dw[N,K] += dout[M,N]^T . in[M,K]: A = in, B = dout, C = dw.
inline ColumnMajorCall linear_dw_call(int64_t M, int64_t N, int64_t K) {
  return {false, true, K, N, M, K, N, K};
}
// A product over (sequence, head) pairs (attention_products.h), each pair's matrices one batch
// entry of cublasGemmBatchedEx: A = the product's b, B = its a, C = its c.
inline ColumnMajorCall pair_call(const PairProduct& p) {
  return {p.trans_b, p.trans_a, p.N, p.M, p.K, p.ldb, p.lda, p.ldc};
}

}  // namespace bertrain::cuda
