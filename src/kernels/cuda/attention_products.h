// Attention's six matrix products (QK^T and PV forward; dV, dP, dQ and dK backward) as the CUDA
// backend runs them: each over every (sequence, head) pair at once, one cuBLAS call with the
// pairs' matrices read in place out of the QKV rows [B, T, 3C], the [B, NH, T, T] probability
// buffers and the context rows [B, T, C]. Plain C++ (no CUDA types), compiled in every build: the
// host tests run these very descriptions through a reference GEMM against the CPU's attention,
// so on a GPU only cuBLAS's side is new.
#pragma once

#include <array>
#include <cstdint>

#include "core/host_device.h"
#include "kernels/types.h"

namespace bertrain::cuda {

// One operand over the pairs: pair k = b * NH + h reads the matrix at
// base + (b * per_sequence + h * per_head) elements of `bytes` bytes each.
struct PairOperand {
  const void* base = nullptr;
  int64_t per_sequence = 0, per_head = 0, bytes = 4;
  BT_HOST_DEVICE const void* of(int64_t k, int64_t NH) const {
    return static_cast<const char*>(base) + ((k / NH) * per_sequence + (k % NH) * per_head) * bytes;
  }
};

// Row-major C_k = alpha op(A_k) op(B_k) for every pair k (C overwritten, fp32).
struct PairProduct {
  bool trans_a, trans_b;
  int64_t M, N, K;
  float alpha;
  PairOperand a, b, c;
  int64_t lda, ldb, ldc;
};

// Forward: scores = scale Q K^T into `scores` [B, NH, T, T] (fp32), then ctx = dropped V into
// the context rows (fp32). qkv and dropped hold elements of `bytes` (the products' operands:
// bf16 bits or fp32 values).
std::array<PairProduct, 2> attention_forward_products(const kernels::AttentionShape& s,
                                                      int64_t bytes, const void* qkv, float* scores,
                                                      const void* dropped, float* ctx);
// Backward: dV = dropped^T dctx and dd = dctx V^T (into dd [B, NH, T, T], fp32; the softmax
// backward's input), then from ds (dd's pass, `bytes` elements) dQ = scale ds K and
// dK = scale ds^T Q, all into dqkv [B, T, 3C] (fp32).
std::array<PairProduct, 4> attention_backward_products(const kernels::AttentionShape& s,
                                                       int64_t bytes, const void* qkv,
                                                       const void* dropped, const void* dctx,
                                                       float* dd, const void* ds, float* dqkv);

}  // namespace bertrain::cuda
