// Linear layers through cuBLASLt: fp32, bf16 or fp16 operands, fp32 accumulation and output (or
// a 16-bit output in the operands' type, rounded by the epilogue: linear_forward_16), the bias
// added in the matmul's epilogue. Row-major tensors are cuBLAS's column-major transposes, so
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
#include "core/error.h"
#include "core/rng.h"
#include "kernels/cuda/blas_calls.h"
#include "kernels/cuda/column_tickets.cuh"
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

cudaDataType_t operand_type(Precision o) {
  switch (o) {
    case Precision::BF16:
      return CUDA_R_16BF;
    case Precision::FP16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// fp32 accumulation throughout (plain fp32 for fp32 operands: no TF32 behind the caller's back).
constexpr cublasComputeType_t kCompute = CUBLAS_COMPUTE_32F;

__host__ __device__ inline bool fp32_storage(Precision o) {
  return o == Precision::FP32;
}

// One product: its column-major call (blas_calls.h), whether the epilogue adds a bias, and the
// alignment of its pointers (cuBLASLt assumes 256 bytes unless told: a tensor of the flat
// parameter buffer's 16-bit copy may start at any 32 bytes).
struct Shape {
  Precision operands;
  ColumnMajorCall g;
  bool bias;
  bool out16 = false;  // C and D in the operands' 16-bit type, not fp32
  uint32_t align_a = 256, align_b = 256, align_c = 256;
  auto key() const {
    return std::tie(operands, g.trans_a, g.trans_b, bias, out16, g.m, g.n, g.k, g.lda, g.ldb, g.ldc,
                    align_a, align_b, align_c);
  }
  bool operator<(const Shape& o) const { return key() < o.key(); }
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
  const ColumnMajorCall& g = s.g;
  BT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, kCompute, CUDA_R_32F));
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                          tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  BT_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  BT_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const cudaDataType_t t = operand_type(s.operands);
  if (s.bias) {  // (of the output's type: cuBLASLt's rule outside its integer and fp8 kernels)
    const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bt = s.out16 ? t : CUDA_R_32F;
    BT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
    BT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  // Stored (column-major) sizes: A is m x k, or k x m read transposed; B likewise.
  BT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, t, g.a_rows(), g.a_cols(), g.lda));
  BT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, t, g.b_rows(), g.b_cols(), g.ldb));
  BT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, s.out16 ? t : CUDA_R_32F, g.m, g.n, g.ldc));
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
  BT_CHECK(found > 0, "cuBLASLt has no algorithm for a ", g.m, "x", g.n, "x", g.k, " product of ",
           fp32_storage(s.operands) ? "fp32" : "16-bit", " operands");
  p.algo = result.algo;
  return ctx.products.emplace(s, p).first->second;
}

void matmul(Shape s, const void* A, const void* B, void* C, float beta, const void* bias,
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
  count_launch();
  BT_CUBLAS_CHECK(cublasLtMatmul(ctx.handle, p.op, &alpha, A, p.a, B, p.b, &beta, C, p.c, C, p.c,
                                 &p.algo, scratch(kMatmulWorkspaceSlot, kMatmulWorkspaceBytes),
                                 kMatmulWorkspaceBytes, as_stream(stream)));
}

// Chunk blockIdx.y of the [M,N] values' rows (`per` rows each), a column per thread: their sums
// in row order into partial[chunk * N + c]; the tile's last block adds the chunks in order onto
// db (column_tickets.cuh). value(i) gives element i (a matrix's, or one computed and written as
// it is read: activation_bias_backward's).
template <class Value>
__global__ void column_sums_kernel(float* db, float* partial, unsigned* tickets, Value value,
                                   int64_t M, int64_t N, int64_t per) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.y, chunks = gridDim.y;
  if (c < N) {
    const int64_t end = (chunk + 1) * per < M ? (chunk + 1) * per : M;
    float s = 0.0f;
    for (int64_t r = chunk * per; r < end; ++r) s += value(r * N + c);
    partial[chunk * N + c] = s;
  }
  if (last_chunk_of_tile(tickets) && c < N) add_chunks(db, partial, chunks, N, c);
}

// A matrix's elements.
struct Elements {
  const float* x;
  __device__ float operator()(int64_t i) const { return x[i]; }
};

// dinp[i] = dout[i] x act'(in[i]) (in: fp32, or the kept 16-bit bits, In uint16_t with p saying
// which; dout: fp32, or where null its 16-bit copy dout16), written (and rounded into dinp16
// where given) and returned.
template <typename In>
struct ActivationGrad {
  Precision p;
  kernels::Activation a;
  float* dinp;
  uint16_t* dinp16;
  const In* in;
  const float* dout;
  const uint16_t* dout16;
  __device__ float widen16(uint16_t b) const { return from_16(p, b); }
  __device__ float operator()(int64_t i) const {
    float x;
    if constexpr (sizeof(In) == 4)
      x = in[i];
    else
      x = widen16(in[i]);
    const float g = rm::activation_grad(a, x, dout ? dout[i] : widen16(dout16[i]));
    if (dinp) dinp[i] = g;
    if (dinp16) dinp16[i] = to_16(p, g);
    return g;
  }
};

// db[N] += column sums of value's [M,N] elements: chunks of rows in parallel, then the chunks in
// order (deterministic; scratch.h, column_chunks), one launch.
template <class Value>
void column_sums_of(float* db, Value value, int64_t M, int64_t N, cudaStream_t s) {
  const int64_t chunks = column_chunks(M), per = (M + chunks - 1) / chunks;
  const unsigned tiles = blocks_for(N, kColumnTile);
  auto* partial = static_cast<float*>(scratch(kColumnSumsSlot, chunks * N * sizeof(float)));
  BT_LAUNCH(column_sums_kernel<Value>, dim3(tiles, static_cast<unsigned>(chunks)), kColumnTile, 0,
            s)
  (db, partial, column_tickets(tiles), value, M, N, per);
  BT_CUDA_CHECK(cudaGetLastError());
}

void column_sums(float* db, const float* dout, int64_t M, int64_t N, cudaStream_t s) {
  column_sums_of(db, Elements{dout}, M, N, s);
}

// A matrix's elements, each rounded into bits (p's 16 bits) as it is read: the rounding pass of
// a product's operand that sums the bias gradient too.
struct RoundedElements {
  Precision p;
  const float* x;
  uint16_t* bits;
  __device__ float operator()(int64_t i) const {
    const float v = x[i];
    bits[i] = to_16(p, v);
    return v;
  }
};

}  // namespace

void rounded_column_sums(Precision p, float* db, const float* x, uint16_t* bits, int64_t M,
                         int64_t N, void* stream) {
  if (M == 0 || N == 0) return;
  const cudaStream_t s = as_stream(stream);
  if (bits && p != Precision::FP32 && db)
    column_sums_of(db, RoundedElements{p, x, bits}, M, N, s);
  else if (db)
    column_sums(db, x, M, N, s);
  else if (bits && p != Precision::FP32)
    round_to_16(p, bits, x, M * N, stream);
}

namespace {

// The pairs' matrices of up to kMaxPairProducts products at once: product j's pointers at
// out + 3 n j, [0, n) of A, [n, 2n) of B, [2n, 3n) of C.
struct PairOperands {
  PairOperand a[kMaxPairProducts], b[kMaxPairProducts], c[kMaxPairProducts];
};
__global__ void pair_pointers_kernel(void** out, int64_t n, int64_t count, int64_t NH,
                                     PairOperands o) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * count) return;
  const int64_t j = i / n, k = i % n;
  void** at = out + 3 * n * j;
  at[k] = const_cast<void*>(o.a[j].of(k, NH));
  at[n + k] = const_cast<void*>(o.b[j].of(k, NH));
  at[2 * n + k] = const_cast<void*>(o.c[j].of(k, NH));
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

namespace {

bool same(const PairOperand& x, const PairOperand& y) {
  return x.base == y.base && x.per_sequence == y.per_sequence && x.per_head == y.per_head &&
         x.bytes == y.bytes;
}

// The tables the calling thread made (pair_pointers): what each holds, made in which binding of
// the scratch and part, at which stride (tables of another stride would overlap: one stride at a
// time), and when last used.
struct PairTable {
  uint64_t binding = 0;
  void** part = nullptr;
  int64_t stride = 0, pairs = 0, NH = 0, count = 0;
  PairOperands o{};
  uint64_t used = 0;  // 0: none made
  bool holds(uint64_t bound, void** at, int64_t s, int64_t n, int64_t heads, int64_t k,
             const PairOperands& x) const {
    if (used == 0 || binding != bound || part != at || stride != s || pairs != n || NH != heads ||
        count != k)
      return false;
    for (int64_t j = 0; j < k; ++j)
      if (!same(o.a[j], x.a[j]) || !same(o.b[j], x.b[j]) || !same(o.c[j], x.c[j])) return false;
    return true;
  }
};
thread_local PairTable t_tables[kPairTables];
thread_local uint64_t t_uses = 0;

}  // namespace

void forget_device_records() {
  for (PairTable& t : t_tables) t.used = 0;
}

PairPointers pair_pointers(int64_t pairs, int64_t NH, const PairProduct* p, int64_t count,
                           void* stream) {
  BT_CHECK(count >= 1 && count <= kMaxPairProducts, "pair_pointers: ", count, " products");
  const int64_t stride = 3 * kMaxPairProducts * pairs;  // (pointers a table)
  auto* part = static_cast<void**>(
      scratch(kAttentionPointersSlot, kPairTables * stride * int64_t{sizeof(void*)}));
  if (pairs == 0) return {part, pairs, count};
  PairOperands o{};
  for (int64_t j = 0; j < count; ++j) {
    o.a[j] = p[j].a;
    o.b[j] = p[j].b;
    o.c[j] = p[j].c;
  }
  // Table k made (a launch).
  auto make = [&](int64_t k) {
    const PairPointers at{part + k * stride, pairs, count};
    constexpr unsigned kThreads = 256;
    BT_LAUNCH(pair_pointers_kernel, blocks_for(pairs * count, kThreads), kThreads, 0,
              as_stream(stream))
    (at.base, pairs, count, NH, o);
    BT_CUDA_CHECK(cudaGetLastError());
    return at;
  };
  // (captured: made in the graph, in turn; the stream's order keeps each until it is used)
  if (capturing()) return make(static_cast<int64_t>(t_uses++ % kPairTables));
  const uint64_t bound = scratch_binding();
  PairTable* oldest = &t_tables[0];
  for (PairTable& t : t_tables) {
    if (t.holds(bound, part, stride, pairs, NH, count, o)) {
      t.used = ++t_uses;
      return {part + (&t - t_tables) * stride, pairs, count};
    }
    if (t.binding != bound || t.part != part || t.stride != stride) t.used = 0;  // (overlapping)
    if (t.used < oldest->used) oldest = &t;
  }
  *oldest = PairTable{bound, part, stride, pairs, NH, count, o, ++t_uses};
  return make(oldest - t_tables);
}

void gemm_pairs(Precision o, const PairPointers& at, int64_t j, const PairProduct& p,
                void* stream) {
  BT_CHECK(j >= 0 && j < at.count, "gemm_pairs: product ", j, " of ", at.count);
  const int64_t pairs = at.pairs;
  if (pairs == 0 || p.M == 0 || p.N == 0) return;
  void** ptrs = at.base + 3 * pairs * j;
  cublasHandle_t h = blas_handle();
  BT_CUBLAS_CHECK(cublasSetStream(h, as_stream(stream)));
  // (the products' workspace, cuBLASLt's, used in the stream's order: cuBLAS allocating one of
  // its own would break a CUDA graph's capture)
  BT_CUBLAS_CHECK(cublasSetWorkspace(h, scratch(kMatmulWorkspaceSlot, kMatmulWorkspaceBytes),
                                     kMatmulWorkspaceBytes));
  // Column-major C^T = op(B)^T op(A)^T (blas_calls.h): the product's B pointers first.
  const ColumnMajorCall g = pair_call(p);
  const cudaDataType_t t = operand_type(o);
  const float beta = p.accumulate ? 1.0f : 0.0f;
  // (C in fp32, or in the operands' 16-bit type where its elements are 2 bytes: the context)
  const cudaDataType_t c_type = p.c.bytes == 4 ? CUDA_R_32F : t;
  BT_CHECK(p.c.bytes == 4 || !fp32_storage(o), "gemm_pairs: a 16-bit output of fp32 operands");
  count_launch();
  BT_CUBLAS_CHECK(cublasGemmBatchedEx(
      h, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k), &p.alpha, ptrs + pairs,
      t, static_cast<int>(g.lda), ptrs, t, static_cast<int>(g.ldb), &beta, ptrs + 2 * pairs, c_type,
      static_cast<int>(g.ldc), static_cast<int>(pairs), kCompute, CUBLAS_GEMM_DEFAULT));
}

void gemm_pairs(Precision o, int64_t pairs, int64_t NH, const PairProduct& p, void* stream) {
  if (pairs == 0 || p.M == 0 || p.N == 0) return;
  gemm_pairs(o, pair_pointers(pairs, NH, &p, 1, stream), 0, p, stream);
}

void linear_forward(Precision o, float* out, const void* in, const void* w, const float* bias,
                    int64_t M, int64_t N, int64_t K, void* stream) {
  if (M == 0 || N == 0) return;
  // out^T (N x M) = w^T (w stored K x N, read transposed) . in^T (stored K x M).
  matmul({o, linear_forward_call(M, N, K), bias != nullptr}, w, in, out, 0.0f, bias, stream);
}

void linear_backward(Precision o, float* dinp, float* dw, float* db, const void* dout,
                     const float* dout_f32, const void* in, const void* w, int64_t M, int64_t N,
                     int64_t K, bool accumulate_dinp, void* stream) {
  if (M == 0) return;
  // dinp^T (K x M) = w (stored K x N) . dout^T (stored N x M).
  if (dinp)
    matmul({o, linear_dinp_call(M, N, K), false}, w, dout, dinp, accumulate_dinp ? 1.0f : 0.0f,
           nullptr, stream);
  // dw^T (K x N) += in^T (stored K x M) . dout (stored N x M, read transposed).
  if (dw) matmul({o, linear_dw_call(M, N, K), false}, in, dout, dw, 1.0f, nullptr, stream);
  if (db) column_sums(db, dout_f32, M, N, as_stream(stream));
}

namespace {

// Values in [-1, 1) from the counter-based hash, in the operand type.
__global__ void fill_kernel(Precision o, void* x, int64_t n, uint64_t key) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = 2.0f * rng_uniform(key, i) - 1.0f;
  if (fp32_storage(o))
    static_cast<float*>(x)[i] = v;
  else if (o == Precision::BF16)
    static_cast<uint16_t*>(x)[i] = f32_to_bf16(v);
  else
    static_cast<uint16_t*>(x)[i] = __half_as_ushort(__float2half_rn(v));
}

}  // namespace

void activation_bias_backward(Precision p, kernels::Activation a, kernels::Kept dinp, float* db,
                              kernels::Kept in, kernels::KeptIn dout, int64_t M, int64_t N,
                              void* stream) {
  if (M == 0 || N == 0) return;
  const cudaStream_t s = as_stream(stream);
  BT_CHECK(dout.f32 || (dout.bits && p != Precision::FP32),
           "activation_bias_backward: no dout (neither its fp32 values nor a 16-bit copy)");
  if (p == Precision::FP32)
    column_sums_of(db, ActivationGrad<float>{p, a, dinp.f32, nullptr, in.f32, dout.f32, nullptr}, M,
                   N, s);
  else
    column_sums_of(db,
                   ActivationGrad<uint16_t>{p, a, dinp.f32, dinp.bits, in.bits, dout.f32,
                                            dout.f32 ? nullptr : dout.bits},
                   M, N, s);
}

double gemm_tflops(Precision o, int64_t M, int64_t N, int64_t K, double seconds) {
  const size_t el = precision_bytes(o);
  DeviceBuffer a(M * K * el), b(N * K * el), c(M * N * 4);
  constexpr unsigned kThreads = 256;
  const cudaStream_t s = compute_stream();
  BT_LAUNCH(fill_kernel, blocks_for(M * K, kThreads), kThreads, 0, s)(o, a.data(), M * K, 1);
  BT_LAUNCH(fill_kernel, blocks_for(N * K, kThreads), kThreads, 0, s)(o, b.data(), N * K, 2);
  BT_CUDA_CHECK(cudaGetLastError());
  for (int i = 0; i < 3; ++i) linear_forward(o, c.f32(), a.data(), b.data(), nullptr, M, N, K);
  BT_CUDA_WAIT(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  BT_CUDA_CHECK(cudaEventCreate(&start));
  BT_CUDA_CHECK(cudaEventCreate(&stop));
  double elapsed_ms = 0;
  int64_t runs = 0;
  for (int batch = 1; elapsed_ms < seconds * 1e3; batch *= 2) {
    BT_CUDA_CHECK(cudaEventRecord(start, s));
    for (int i = 0; i < batch; ++i)
      linear_forward(o, c.f32(), a.data(), b.data(), nullptr, M, N, K);
    BT_CUDA_CHECK(cudaEventRecord(stop, s));
    BT_CUDA_WAIT(cudaEventSynchronize(stop));
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

namespace {

// A 16-bit precision's products read the weights' 16-bit copy: a model on this backend plans one
// (Target::fp16_operands, ModelDims::weight_copy).
void check_copy(const kernels::Weight& w) {
  BT_CHECK(w.bits,
           "a 16-bit product on the GPU reads the weights' 16-bit copy (BertModel plans it: "
           "ModelDims::weight_copy), and none was given");
}

}  // namespace

void linear_forward(Precision p, float* out, kernels::Kept in, kernels::Weight w, const float* bias,
                    int64_t M, int64_t N, int64_t K, const kernels::Workspace& ws) {
  if (p == Precision::FP32) return linear_forward(p, out, in.f32, w.f32, bias, M, N, K);
  check_copy(w);
  const uint16_t* x = in.bits;
  if (!x) {
    round_to_16(p, ws.half_a, in.f32, M * K);
    x = ws.half_a;
  }
  linear_forward(p, out, x, w.bits, bias, M, N, K);
}

void linear_forward_16(Precision p, uint16_t* out, kernels::Kept in, kernels::Weight w,
                       const uint16_t* bias, int64_t M, int64_t N, int64_t K,
                       const kernels::Workspace& ws, void* stream) {
  BT_CHECK(p != Precision::FP32, "linear_forward_16: fp32 operands write fp32 outputs");
  if (M == 0 || N == 0) return;
  check_copy(w);
  const uint16_t* x = in.bits;
  if (!x) {
    round_to_16(p, ws.half_a, in.f32, M * K, stream);
    x = ws.half_a;
  }
  Shape s{p, linear_forward_call(M, N, K), bias != nullptr};
  s.out16 = true;
  matmul(s, w.bits, x, out, 0.0f, bias, stream);
}

namespace {

// A 16-bit linear_backward's operands: dout's copy (its producer's, or rounded here, the rounding
// pass summing db as it reads dout: db then null) and the input's.
struct Operands16 {
  const uint16_t *d, *x;
};
Operands16 operands_16(Precision p, float*& db, kernels::KeptIn dout, kernels::Kept in, int64_t M,
                       int64_t N, int64_t K, const kernels::Workspace& ws) {
  Operands16 o{dout.bits, in.bits};
  if (!o.d) {
    rounded_column_sums(p, db, dout.f32, ws.half_a, M, N, nullptr);
    db = nullptr;
    o.d = ws.half_a;
  }
  if (!o.x) {
    round_to_16(p, ws.half_b, in.f32, M * K);
    o.x = ws.half_b;
  }
  return o;
}

}  // namespace

void linear_backward(Precision p, float* dinp, float* dw, float* db, kernels::KeptIn dout,
                     kernels::Kept in, kernels::Weight w, int64_t M, int64_t N, int64_t K,
                     bool accumulate_dinp, const kernels::Workspace& ws) {
  if (p == Precision::FP32)
    return linear_backward(p, dinp, dw, db, dout.f32, dout.f32, in.f32, w.f32, M, N, K,
                           accumulate_dinp);
  check_copy(w);
  const Operands16 o = operands_16(p, db, dout, in, M, N, K, ws);
  linear_backward(p, dinp, dw, db, o.d, dout.f32, o.x, w.bits, M, N, K, accumulate_dinp);
}

void linear_backward_16(Precision p, uint16_t* dinp16, float* dw, float* db, kernels::KeptIn dout,
                        kernels::Kept in, kernels::Weight w, int64_t M, int64_t N, int64_t K,
                        const kernels::Workspace& ws) {
  BT_CHECK(p != Precision::FP32, "linear_backward_16: fp32 operands write fp32 outputs");
  if (M == 0) return;
  check_copy(w);
  const Operands16 o = operands_16(p, db, dout, in, M, N, K, ws);
  // dinp16^T (K x M) = w (stored K x N) . dout^T (stored N x M), in p's 16 bits
  Shape s{p, linear_dinp_call(M, N, K), false};
  s.out16 = true;
  matmul(s, w.bits, o.d, dinp16, 0.0f, nullptr, nullptr);
  linear_backward(p, nullptr, dw, db, o.d, dout.f32, o.x, w.bits, M, N, K, false);
}

}  // namespace bertrain::cuda
