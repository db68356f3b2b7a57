// The emulated device's cuBLAS and cuBLASLt (cuda_emu/README.md): each product a reference GEMM
// with BLAS's column-major semantics (C = alpha op(A) op(B) + beta C; beta = 0 never reads C),
// fp32, bf16 or fp16 operands widened to fp32 and summed in fp32 along k in order, the output in
// fp32 or rounded to the operands' 16-bit type (to nearest even), queued on the stream. The
// operands' extents (ld x columns) are checked against their allocations when the stream runs the
// call, and the pointers against the alignments the algorithm was chosen for: what
// compute-sanitizer, or wrong results, would show on a GPU.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <oneapi/dnnl/dnnl.h>

#include "cublasLt.h"
#include "cublas_v2.h"
#include "cuda_fp16.h"
#include "runtime.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
};
struct cublasLtContext {};
struct cublasLtMatmulDescOpaque {
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  int32_t bias_type = -1;  // (cuBLASLt's default: D's type)
};
struct cublasLtMatrixLayoutOpaque {
  cudaDataType_t type;
  int64_t rows, cols, ld;
};
struct cublasLtMatmulPreferenceOpaque {
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D
};

namespace cuda_emu {
namespace {

size_t element_bytes(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F:
      return 4;
    case CUDA_R_64F:
      return 8;
    default:
      return 2;
  }
}

float widen(const void* p, int64_t i, cudaDataType_t t) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  const uint16_t b = static_cast<const uint16_t*>(p)[i];
  if (t == CUDA_R_16BF) {
    const uint32_t u = uint32_t{b} << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return cuda_emu::half_bits_to_float(b);  // (cuda_fp16.h: libgcc's widening is slow)
}

// A column-major operand: `rows` x `cols` stored with leading dimension ld.
struct Matrix {
  const void* p;
  cudaDataType_t type;
  int64_t rows, cols, ld;
  size_t extent() const {
    return rows == 0 || cols == 0
               ? 0
               : static_cast<size_t>(ld * (cols - 1) + rows) * element_bytes(type);
  }
};

void check_extent(const Matrix& m, const char* call, const char* name) {
  if (m.extent() == 0) return;
  const std::string why = device_range_problem(m.p, m.extent(), name);
  if (!why.empty()) throw Fault(std::string(call) + ": " + why);
}

// v rounded to a 16-bit output type, to nearest even (as cuBLAS's epilogue converts).
uint16_t narrow(float v, cudaDataType_t t) {
  if (t == CUDA_R_16BF) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
  const _Float16 h = static_cast<_Float16>(v);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

// C (m x n, ldc; fp32, or a 16-bit type rounded to nearest even) = alpha op(A) op(B) + beta C
// (+ bias[i] on row i, of C's type widened): the operands widened to compact fp32 (op applied),
// their product by oneDNN's sgemm (fp32 accumulation; one thread, as the tests run), then
// BLAS's alpha, beta and the epilogue here in fp32, and the output's rounding.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Matrix& A,
          const Matrix& B, float beta, void* C, cudaDataType_t c_type, int64_t ldc,
          const void* bias) {
  if (m == 0 || n == 0) return;
  count_products(2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k));
  std::vector<float> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(k * n)),
      ab(static_cast<size_t>(m * n), 0.0f);
  for (int64_t p = 0; p < k; ++p)
    for (int64_t i = 0; i < m; ++i)
      a[static_cast<size_t>(i + p * m)] = widen(A.p, ta ? p + i * A.ld : i + p * A.ld, A.type);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t p = 0; p < k; ++p)
      b[static_cast<size_t>(p + j * k)] = widen(B.p, tb ? j + p * B.ld : p + j * B.ld, B.type);
  // Column-major ab (m x n) = a b is row-major ab^T (n x m) = b^T a^T, each stored as it is.
  if (k > 0 && dnnl_sgemm('N', 'N', n, m, k, 1.0f, b.data(), k, a.data(), m, 0.0f, ab.data(), m) !=
                   dnnl_success)
    throw Fault("the reference GEMM (oneDNN's sgemm) failed");
  for (int64_t j = 0; j < n; ++j) {
    const float* x = ab.data() + j * m;
    for (int64_t i = 0; i < m; ++i) {
      const int64_t at = i + j * ldc;
      float v = alpha * x[i];
      if (beta != 0.0f) v += beta * widen(C, at, c_type);
      if (bias) v += widen(bias, i, c_type);
      if (c_type == CUDA_R_32F)
        static_cast<float*>(C)[at] = v;
      else
        static_cast<uint16_t*>(C)[at] = narrow(v, c_type);
    }
  }
}

bool operand_type(cudaDataType_t t) {
  return t == CUDA_R_32F || t == CUDA_R_16BF || t == CUDA_R_16F;
}

uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t r = 256;
  while (r > 1 && a % r != 0) r /= 2;
  return r;
}

}  // namespace
}  // namespace cuda_emu

using cuda_emu::Fault;
using cuda_emu::Matrix;

const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    default:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
}

const char* cublasGetStatusString(cublasStatus_t s) {
  thread_local std::string detail;
  detail = std::string(cublasGetStatusName(s)) +
           " on the emulated device: " + cudaGetErrorString(cudaPeekAtLastError());
  return detail.c_str();
}

// cuBLAS.
cublasStatus_t cublasCreate(cublasHandle_t* h) {
  *h = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace(cublasHandle_t, void* workspace, size_t bytes) {
  if (bytes == 0) return CUBLAS_STATUS_SUCCESS;
  const std::string why = cuda_emu::device_range_problem(workspace, bytes, "the workspace");
  if (!why.empty()) {
    std::fprintf(stderr, "cuda_emu: cublasSetWorkspace: %s\n", why.c_str());
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                   int m, int n, int k, const void* alpha, const void* const A[],
                                   cudaDataType_t a_type, int lda, const void* const B[],
                                   cudaDataType_t b_type, int ldb, const void* beta,
                                   void* const C[], cudaDataType_t c_type, int ldc, int batch,
                                   cublasComputeType_t compute, cublasGemmAlgo_t) {
  const bool ta_ = ta != CUBLAS_OP_N, tb_ = tb != CUBLAS_OP_N;
  const int64_t a_rows = ta_ ? k : m, b_rows = tb_ ? n : k;
  if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < std::max<int64_t>(1, a_rows) ||
      ldb < std::max<int64_t>(1, b_rows) || ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  // (C in fp32, or in the 16-bit operands' type)
  if (a_type != b_type || !cuda_emu::operand_type(a_type) ||
      (c_type != CUDA_R_32F && c_type != a_type) || compute != CUBLAS_COMPUTE_32F)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  const auto gemm_batched = [=] {
    const char* call = "cublasGemmBatchedEx";
    for (const auto* array :
         {static_cast<const void*>(A), static_cast<const void*>(B), static_cast<const void*>(C)}) {
      const std::string why = cuda_emu::device_range_problem(
          array, static_cast<size_t>(batch) * sizeof(void*), "a pointer array");
      if (!why.empty()) throw Fault(std::string(call) + ": " + why);
    }
    for (int i = 0; i < batch; ++i) {
      const Matrix a{A[i], a_type, a_rows, ta_ ? m : k, lda},
          b{B[i], b_type, b_rows, tb_ ? k : n, ldb};
      const Matrix c{C[i], c_type, m, n, ldc};
      cuda_emu::check_extent(a, call, "A");
      cuda_emu::check_extent(b, call, "B");
      cuda_emu::check_extent(c, call, "C");
      cuda_emu::gemm(ta_, tb_, m, n, k, al, a, b, be, C[i], c_type, ldc, nullptr);
    }
  };
  const int dev = cuda_emu::current_device();
  const cudaError_t e = cuda_emu::enqueue(h->stream, "cublasGemmBatchedEx", [=] {
    cuda_emu::count_touches(dev, "cublasGemmBatchedEx", [&] { gemm_batched(); });
  });
  if (e != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  cuda_emu::count_library_call(__func__);
  return CUBLAS_STATUS_SUCCESS;
}

// cuBLASLt.
cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  *h = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  *d = new cublasLtMatmulDescOpaque;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}

template <class T>
static bool read_attribute(T& out, const void* buf, size_t bytes) {
  if (bytes != sizeof(T)) return false;
  std::memcpy(&out, buf, sizeof(T));
  return true;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t a, const void* buf,
                                              size_t bytes) {
  bool ok = false;
  switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      ok = read_attribute(d->ta, buf, bytes);
      break;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      ok = read_attribute(d->tb, buf, bytes);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      ok = read_attribute(d->epilogue, buf, bytes) &&
           (d->epilogue == CUBLASLT_EPILOGUE_DEFAULT || d->epilogue == CUBLASLT_EPILOGUE_BIAS);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      ok = read_attribute(d->bias, buf, bytes);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      ok = read_attribute(d->bias_type, buf, bytes);
      break;
  }
  return ok ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType_t type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  if (ld < std::max<int64_t>(1, static_cast<int64_t>(rows))) return CUBLAS_STATUS_INVALID_VALUE;
  *l = new cublasLtMatrixLayoutOpaque{type, static_cast<int64_t>(rows), static_cast<int64_t>(cols),
                                      ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = new cublasLtMatmulPreferenceOpaque;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a,
                                                    const void* buf, size_t bytes) {
  if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) return CUBLAS_STATUS_SUCCESS;
  const int k = a - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES;
  if (k < 0 || k > 3 || !read_attribute(p->align[k], buf, bytes))
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

namespace {
// The product's sizes from its layouts, or false where they disagree (as cuBLASLt refuses).
bool product_shape(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                   cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d, int64_t& m, int64_t& n,
                   int64_t& k) {
  m = d->rows;
  n = d->cols;
  const bool ta = op->ta != CUBLAS_OP_N, tb = op->tb != CUBLAS_OP_N;
  k = ta ? a->rows : a->cols;
  return (ta ? a->cols : a->rows) == m && (tb ? b->cols : b->rows) == k &&
         (tb ? b->rows : b->cols) == n && c->rows == m && c->cols == n && a->type == b->type &&
         cuda_emu::operand_type(a->type) && c->type == d->type &&
         (d->type == CUDA_R_32F || d->type == a->type) &&  // (D in fp32 or the operands' type)
         // (a bias of D's type, as cuBLASLt documents it outside its integer and fp8 kernels)
         (op->epilogue != CUBLASLT_EPILOGUE_BIAS || op->bias_type == -1 ||
          op->bias_type == static_cast<int32_t>(d->type));
}
}  // namespace

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t* results,
                                              int* found) {
  int64_t m, n, k;
  *found = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  if (!product_shape(op, a, b, c, d, m, n, k)) return CUBLAS_STATUS_NOT_SUPPORTED;
  results[0] = cublasLtMatmulHeuristicResult_t{};
  for (int i = 0; i < 4; ++i) results[0].algo.data[i] = pref->align[i];  // what it assumes
  results[0].state = CUBLAS_STATUS_SUCCESS;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t op, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t a, const void* B,
                              cublasLtMatrixLayout_t b, const void* beta, const void* C,
                              cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t* algo, void*, size_t,
                              cudaStream_t stream) {
  int64_t m, n, k;
  if (!product_shape(op, a, b, c, d, m, n, k)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (C != D || c->ld != d->ld) return CUBLAS_STATUS_NOT_SUPPORTED;  // (in place only)
  const void* ptrs[4] = {A, B, C, D};
  for (int i = 0; algo && i < 4; ++i)
    if (cuda_emu::alignment_of(ptrs[i]) < algo->data[i]) {
      cuda_emu::set_error(cudaErrorInvalidValue,
                          "cublasLtMatmul: operand " + std::string(1, "ABCD"[i]) +
                              " is aligned to " + std::to_string(cuda_emu::alignment_of(ptrs[i])) +
                              " bytes, its algorithm was chosen for " +
                              std::to_string(algo->data[i]));
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  const bool ta = op->ta != CUBLAS_OP_N, tb = op->tb != CUBLAS_OP_N;
  const void* bias = op->epilogue == CUBLASLT_EPILOGUE_BIAS ? op->bias : nullptr;
  if (op->epilogue == CUBLASLT_EPILOGUE_BIAS && !bias) return CUBLAS_STATUS_INVALID_VALUE;
  const Matrix ma{A, a->type, a->rows, a->cols, a->ld}, mb{B, b->type, b->rows, b->cols, b->ld},
      md{D, d->type, d->rows, d->cols, d->ld};
  const int64_t ldd = d->ld;
  const int dev = cuda_emu::current_device();
  const cudaError_t e = cuda_emu::enqueue(stream, "cublasLtMatmul", [=] {
    cuda_emu::check_extent(ma, "cublasLtMatmul", "A");
    cuda_emu::check_extent(mb, "cublasLtMatmul", "B");
    cuda_emu::check_extent(md, "cublasLtMatmul", "D");
    if (bias) cuda_emu::check_extent(Matrix{bias, md.type, m, 1, m}, "cublasLtMatmul", "the bias");
    cuda_emu::count_touches(dev, "cublasLtMatmul", [&] {
      cuda_emu::gemm(ta, tb, m, n, k, al, ma, mb, be, D, md.type, ldd, bias);
    });
  });
  if (e != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  cuda_emu::count_library_call(__func__);
  return CUBLAS_STATUS_SUCCESS;
}
