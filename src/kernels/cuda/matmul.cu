// Linear layers through cuBLASLt: fp32, bf16 or fp16 operands, fp32 accumulation and output, the
// bias added in the matmul's epilogue. Row-major tensors are cuBLAS's column-major transposes, so
// out[M,N] = in[M,K] . w[N,K]^T is the column-major out^T = w^T . in^T with w read transposed.
// A product's descriptors and the algorithm cuBLASLt's heuristic picks are made once per shape
// (per host thread) and reused, as the oneDNN primitives are on the CPU. fp32 runs in plain fp32
// (no TF32), so it agrees with the CPU to fp32 rounding.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <map>
#include <tuple>
#include <utility>

#include <cuda_fp16.h>

#include "core/dtype.h"
#include "core/rng.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/row_math.h"

#define BT_CUBLAS_CHECK(call)                                                             \
  do {                                                                                    \
    cublasStatus_t st_ = (call);                                                          \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                     \
      ::bertrain::fail("cuBLASLt error ", cublasGetStatusName(st_), " (",                 \
                       cublasGetStatusString(st_), ") in ", #call, " at ", __FILE__, ":", \
                       __LINE__);                                                         \
  } while (0)

namespace bertrain::cuda {

namespace rm = kernels::row_math;

namespace {

cudaDataType_t operand_type(Operands o) {
  switch (o) {
    case Operands::BF16:
      return CUDA_R_16BF;
    case Operands::FP16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// fp32 accumulation throughout (plain fp32 for fp32 operands: no TF32 behind the caller's back).
constexpr cublasComputeType_t kCompute = CUBLAS_COMPUTE_32F;

__host__ __device__ inline bool fp32_storage(Operands o) {
  return o == Operands::FP32;
}

// One product's shape: column-major m x n = op(A) m x k . op(B) k x n, C with beta; and the
// alignment of its pointers (cuBLASLt assumes 256 bytes unless told: a tensor of the flat
// parameter buffer may start at any element).
struct Shape {
  Operands operands;
  bool trans_a, trans_b, bias;
  int64_t m, n, k, lda, ldb, ldc;
  uint32_t align_a = 256, align_b = 256, align_c = 256;
  bool operator<(const Shape& o) const {
    return std::tie(operands, trans_a, trans_b, bias, m, n, k, lda, ldb, ldc, align_a, align_b,
                    align_c) < std::tie(o.operands, o.trans_a, o.trans_b, o.bias, o.m, o.n, o.k,
                                        o.lda, o.ldb, o.ldc, o.align_a, o.align_b, o.align_c);
  }
};

// The largest power of two up to 256 that divides the address.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t r = 256;
  while (r > 1 && a % r != 0) r /= 2;
  return r;
}

struct Product {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

struct Context {
  cublasLtHandle_t handle = nullptr;
  std::map<Shape, Product> products;
  Context() { BT_CUBLAS_CHECK(cublasLtCreate(&handle)); }
  ~Context() {
    for (auto& [shape, p] : products) {
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.c);
      cublasLtMatmulDescDestroy(p.op);
    }
    cublasLtDestroy(handle);
  }
};

Context& context() {
  thread_local Context c;
  return c;
}

const Product& product(Context& ctx, const Shape& s) {
  auto it = ctx.products.find(s);
  if (it != ctx.products.end()) return it->second;
  Product p;
  BT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, kCompute, CUDA_R_32F));
  const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                          tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  BT_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  BT_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (s.bias) {
    const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bt = CUDA_R_32F;
    BT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
    BT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  const cudaDataType_t t = operand_type(s.operands);
  // Stored (column-major) sizes: A is m x k, or k x m read transposed; B likewise.
  BT_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.a, t, s.trans_a ? s.k : s.m, s.trans_a ? s.m : s.k, s.lda));
  BT_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.b, t, s.trans_b ? s.n : s.k, s.trans_b ? s.k : s.n, s.ldb));
  BT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, s.m, s.n, s.ldc));
  cublasLtMatmulPreference_t pref;
  BT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = kMatmulWorkspaceBytes;
  BT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  for (auto [attr, value] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, s.align_a},
                             std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, s.align_b},
                             std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, s.align_c},
                             std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, s.align_c}})
    BT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  BT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.handle, p.op, p.a, p.b, p.c, p.c, pref, 1,
                                                 &result, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  BT_CHECK(found > 0, "cuBLASLt has no algorithm for a ", s.m, "x", s.n, "x", s.k, " product of ",
           fp32_storage(s.operands) ? "fp32" : "16-bit", " operands");
  p.algo = result.algo;
  return ctx.products.emplace(s, p).first->second;
}

void matmul(Shape s, const void* A, const void* B, float* C, float beta, const float* bias,
            void* stream) {
  s.align_a = alignment(A);
  s.align_b = alignment(B);
  s.align_c = alignment(C);
  Context& ctx = context();
  const Product& p = product(ctx, s);
  if (s.bias)
    BT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                   sizeof(bias)));
  const float alpha = 1.0f;
  BT_CUBLAS_CHECK(cublasLtMatmul(ctx.handle, p.op, &alpha, A, p.a, B, p.b, &beta, C, p.c, C, p.c,
                                 &p.algo, scratch(kMatmulWorkspaceSlot, kMatmulWorkspaceBytes),
                                 kMatmulWorkspaceBytes, as_stream(stream)));
}

// Chunk blockIdx.y of dout[M,N]'s rows (`per` rows each), a column per thread: its sums into
// partial[chunk * N + c].
__global__ void column_partials_kernel(float* partial, const float* dout, int64_t M, int64_t N,
                                       int64_t per) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= N) return;
  const int64_t chunk = blockIdx.y, end = (chunk + 1) * per < M ? (chunk + 1) * per : M;
  float* out = partial + chunk * N;
  out[c] = 0.0f;
  rm::column_sum(out, dout, chunk * per, end, N, c);
}

// db[c] += the chunks' partial sums, in chunk order.
__global__ void column_sum_kernel(float* db, const float* partial, int64_t chunks, int64_t N) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < N) rm::column_sum(db, partial, 0, chunks, N, c);
}

// db[N] += column sums of dout[M,N]: chunks of rows in parallel, then the chunks in order
// (deterministic; scratch.h, column_chunks).
void column_sums(float* db, const float* dout, int64_t M, int64_t N, cudaStream_t s) {
  constexpr unsigned kThreads = 256;
  const int64_t chunks = column_chunks(M), per = (M + chunks - 1) / chunks;
  auto* partial = static_cast<float*>(scratch(kColumnSumsSlot, chunks * N * sizeof(float)));
  column_partials_kernel<<<dim3(blocks_for(N, kThreads), static_cast<unsigned>(chunks)), kThreads,
                           0, s>>>(partial, dout, M, N, per);
  BT_CUDA_CHECK(cudaGetLastError());
  column_sum_kernel<<<blocks_for(N, kThreads), kThreads, 0, s>>>(db, partial, chunks, N);
  BT_CUDA_CHECK(cudaGetLastError());
}

// The pairs' matrices: pointers [0, n) of A, [n, 2n) of B, [2n, 3n) of C.
__global__ void pair_pointers_kernel(void** out, int64_t n, int64_t NH, PairOperand a,
                                     PairOperand b, PairOperand c) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n) return;
  out[k] = const_cast<void*>(a.of(k, NH));
  out[n + k] = const_cast<void*>(b.of(k, NH));
  out[2 * n + k] = const_cast<void*>(c.of(k, NH));
}

cublasHandle_t blas_handle() {
  thread_local struct Handle {
    cublasHandle_t h = nullptr;
    Handle() { BT_CUBLAS_CHECK(cublasCreate(&h)); }
    ~Handle() { cublasDestroy(h); }
  } handle;
  return handle.h;
}

}  // namespace

void gemm_pairs(Operands o, int64_t pairs, int64_t NH, const PairProduct& p, void* stream) {
  if (pairs == 0 || p.M == 0 || p.N == 0) return;
  const cudaStream_t s = as_stream(stream);
  auto** ptrs = static_cast<void**>(scratch(kAttentionPointersSlot, 3 * pairs * sizeof(void*)));
  constexpr unsigned kThreads = 256;
  pair_pointers_kernel<<<blocks_for(pairs, kThreads), kThreads, 0, s>>>(ptrs, pairs, NH, p.a, p.b,
                                                                        p.c);
  BT_CUDA_CHECK(cudaGetLastError());
  cublasHandle_t h = blas_handle();
  BT_CUBLAS_CHECK(cublasSetStream(h, s));
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B first, the flags kept.
  const cudaDataType_t t = operand_type(o);
  const float beta = p.accumulate ? 1.0f : 0.0f;
  BT_CUBLAS_CHECK(cublasGemmBatchedEx(
      h, p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(p.N), static_cast<int>(p.M), static_cast<int>(p.K), &p.alpha, ptrs + pairs,
      t, static_cast<int>(p.ldb), ptrs, t, static_cast<int>(p.lda), &beta, ptrs + 2 * pairs,
      CUDA_R_32F, static_cast<int>(p.ldc), static_cast<int>(pairs), kCompute, CUBLAS_GEMM_DEFAULT));
}

void linear_forward(Operands o, float* out, const void* in, const void* w, const float* bias,
                    int64_t M, int64_t N, int64_t K, void* stream) {
  if (M == 0 || N == 0) return;
  // out^T (N x M) = w^T (w stored K x N, read transposed) . in^T (stored K x M).
  matmul({o, true, false, bias != nullptr, N, M, K, K, K, N}, w, in, out, 0.0f, bias, stream);
}

void linear_backward(Operands o, float* dinp, float* dw, float* db, const void* dout,
                     const float* dout_f32, const void* in, const void* w, int64_t M, int64_t N,
                     int64_t K, bool accumulate_dinp, void* stream) {
  if (M == 0) return;
  // dinp^T (K x M) = w (stored K x N) . dout^T (stored N x M).
  if (dinp)
    matmul({o, false, false, false, K, M, N, K, N, K}, w, dout, dinp, accumulate_dinp ? 1.0f : 0.0f,
           nullptr, stream);
  // dw^T (K x N) += in^T (stored K x M) . dout (stored N x M, read transposed).
  matmul({o, false, true, false, K, N, M, K, N, K}, in, dout, dw, 1.0f, nullptr, stream);
  if (db) column_sums(db, dout_f32, M, N, as_stream(stream));
}

namespace {

// Values in [-1, 1) from the counter-based hash, in the operand type.
__global__ void fill_kernel(Operands o, void* x, int64_t n, uint64_t key) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = 2.0f * rng_uniform(key, i) - 1.0f;
  if (fp32_storage(o))
    static_cast<float*>(x)[i] = v;
  else if (o == Operands::BF16)
    static_cast<uint16_t*>(x)[i] = f32_to_bf16(v);
  else
    static_cast<uint16_t*>(x)[i] = __half_as_ushort(__float2half_rn(v));
}

}  // namespace

double gemm_tflops(Operands o, int64_t M, int64_t N, int64_t K, double seconds) {
  const size_t el = fp32_storage(o) ? 4 : 2;
  DeviceBuffer a(M * K * el), b(N * K * el), c(M * N * 4);
  constexpr unsigned kThreads = 256;
  fill_kernel<<<blocks_for(M * K, kThreads), kThreads>>>(o, a.data(), M * K, 1);
  fill_kernel<<<blocks_for(N * K, kThreads), kThreads>>>(o, b.data(), N * K, 2);
  BT_CUDA_CHECK(cudaGetLastError());
  for (int i = 0; i < 3; ++i) linear_forward(o, c.f32(), a.data(), b.data(), nullptr, M, N, K);
  BT_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  BT_CUDA_CHECK(cudaEventCreate(&start));
  BT_CUDA_CHECK(cudaEventCreate(&stop));
  double elapsed_ms = 0;
  int64_t runs = 0;
  for (int batch = 1; elapsed_ms < seconds * 1e3; batch *= 2) {
    BT_CUDA_CHECK(cudaEventRecord(start));
    for (int i = 0; i < batch; ++i)
      linear_forward(o, c.f32(), a.data(), b.data(), nullptr, M, N, K);
    BT_CUDA_CHECK(cudaEventRecord(stop));
    BT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    BT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    elapsed_ms += ms;
    runs += batch;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 2.0 * M * N * K * runs / (elapsed_ms * 1e-3) / 1e12;
}

std::string device_name() {
  int dev = 0;
  BT_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  BT_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  return p.name;
}

}  // namespace bertrain::cuda
