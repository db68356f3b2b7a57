// The fused attention kernels (cuda.h, fused_attention_forward / _backward): the blocked
// (flash-style) algorithm of kernels/cpu/attention_blocked.cpp in two launches a layer (one
// forward, one backward), the scores never in global memory, for BF16 and FP16 with head sizes a
// multiple of 16 up to 128 and at most 512 tokens, laid out as FlashAttention-2 lays its work
// out: a block of four warps takes 64 rows of a (sequence, head) (kFusedAttentionTile), each
// warp 16 of them, and the tiles every warp multiplies with (keys and values forward, the other
// side's rows backward) are staged once a block into shared memory by all its threads, so a
// tile is read from global memory once for 64 rows; the warps' own operands stay in registers as
// fragments. The products on tensor cores (warp matrix operations, m16n16k16: 16-bit operands,
// fp32 accumulation).
//   forward      a block per 64 query rows: two passes over the keys, 64 at a time (32 for
//                head size 128). The first takes each row's running maximum and sum of
//                exponentials (the row's log-sum-exp); the second computes the scores again,
//                P = dropout(exp(s - max) / sum) rounded to the operand, and adds P V to the
//                context's accumulators. (FlashAttention-2 rescales its accumulators instead of
//                computing S twice; a warp matrix fragment does not say which lane holds which
//                row, so a rescale would go through shared memory: the second QK^T is the
//                cheaper price at BERT's lengths.)
//   backward     two kinds of block side by side, neither waiting for the other and no atomics
//                (the result is the same every run). dQ: a block per 64 query rows, over the
//                keys 32 at a time: S and dd = dO V^T again, dS = P (g - D) rounded,
//                dQ += dS K. dK, dV: a block per 64 keys, over the queries 32 at a time: the
//                same S, dd, P, g and dS (the same 16 x 16 products of the same fragments, so
//                the same bits as dQ's), dV += dropped^T dO, dK += dS^T Q. Each row's
//                D = sum_j P_j g_j is computed as dO . O (FlashAttention-2's identity:
//                O = dropped P V), from the context's kept 16-bit copy, by one function in both
//                kinds (the CPU's blocked kernel sums P g: the two differ by the context's
//                rounding).
//                Where asked, each block also rounds what it writes into dQKV's 16-bit copy
//                (what QKV's backward reads) and sums its columns for QKV's bias gradient.
// Variable lengths directly: AttentionShape::starts (the sequences' first rows, as
// FlashAttention's cumulative offsets) makes one launch run every sequence of a packed or
// unpadded batch, each over its own length; without it sequence b is rows [b T, b T + T).
// QKV (forward) and dO (dctx) are read as their products wrote them: in 16 bits (the model's,
// ModelDims::qkv16_output: cuBLASLt's epilogue rounds them), or in fp32, rounded to the operand
// as they are staged, the forward's blocks then writing QKV's kept bits (each its rows); the
// context is written with its 16-bit copy: no rounding launch is left around attention.
// Shared memory: static, at most 41 KiB a block (below the 48 KiB a static allocation may
// take), 33 KiB at head size 64; with nvcc's registers (sm_90, -Xptxas -v: 128 a thread forward,
// 168 backward) four blocks forward and three backward fit a multiprocessor of an H100 or H200
// (16 and 12 warps; the first version, a warp a block, had 5 and 10).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <type_traits>

#include "core/error.h"
#include "kernels/cuda/column_tickets.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/lanes.cuh"

namespace bertrain::cuda {

namespace rm = kernels::row_math;
using kernels::AttentionShape;
using kernels::Dropout;
namespace wmma = nvcuda::wmma;

namespace {

constexpr int kRows = static_cast<int>(kernels::kFusedAttentionTile);  // a block's rows
constexpr int kWarps = kRows / 16, kThreads = 32 * kWarps;             // a warp's 16 rows
constexpr int kChunk = 32;  // backward: the keys (dQ) or queries (dK, dV) a step takes
static_assert(kRows % 64 == 0 && kRows / 16 == kWarps);

// The tensor cores' element type of an operand's bits.
template <class X>
struct Element;
template <>
struct Element<rm::Bf16Bits> {
  using type = __nv_bfloat16;
};
template <>
struct Element<rm::F16Bits> {
  using type = __half;
};

template <class X>
using FragA =
    wmma::fragment<wmma::matrix_a, 16, 16, 16, typename Element<X>::type, wmma::row_major>;
template <class X>
using FragAT =
    wmma::fragment<wmma::matrix_a, 16, 16, 16, typename Element<X>::type, wmma::col_major>;
template <class X>
using FragB =
    wmma::fragment<wmma::matrix_b, 16, 16, 16, typename Element<X>::type, wmma::row_major>;
template <class X>
using FragBT =
    wmma::fragment<wmma::matrix_b, 16, 16, 16, typename Element<X>::type, wmma::col_major>;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <class X>
__device__ const typename Element<X>::type* el(const X* p) {
  return reinterpret_cast<const typename Element<X>::type*>(p);
}

// Sequence b's rows and length.
struct Sequence {
  int64_t start, L;
};
__device__ Sequence sequence(const AttentionShape& s, int64_t b) {
  if (s.starts) return {s.starts[b], s.starts[b + 1] - s.starts[b]};
  return {b * s.T, s.T};
}

// What a block needs of its (sequence, head): the QKV rows' Q, K and V of the head, the row
// log-sum-exp and D of its rows, the mask and dropout of its row i.
struct Head {
  AttentionShape s;
  Sequence q;
  int64_t b, h, HD, C3;
  __device__ Head(const AttentionShape& shape, int64_t b_, int64_t h_)
      : s(shape), q(sequence(shape, b_)), b(b_), h(h_), HD(shape.C / shape.NH), C3(3 * shape.C) {}
  // Row 0 of part (0 Q, 1 K, 2 V) of the head in a [rows, 3C] tensor (null where it is: an
  // output not written).
  template <class T>
  __device__ T* part(T* qkv, int p) const {
    return qkv ? qkv + q.start * C3 + p * s.C + h * HD : nullptr;
  }
  __device__ int64_t row_value(int64_t i) const { return s.NH * q.start + h * q.L + i; }
  __device__ const int32_t* mask(const int32_t* m) const { return m + q.start; }
  __device__ uint64_t index0(const Dropout& d, int64_t i) const {
    return d.offset + s.dropout_row(b * s.NH + h, i);
  }
};

// A block's (sequence, head), the first of its 64 rows (queries, or keys for dK and dV;
// blockIdx.x's tile unless given), the thread's warp and lane, the products' scale and dropout's
// keep factor. A warp's rows are first + 16 warp on.
struct Block : Head {
  int64_t first;
  int warp, lane;
  float scale, keep;
  __device__ Block(const AttentionShape& shape, const Dropout& d, int64_t tile = blockIdx.x)
      : Head(shape, blockIdx.z, blockIdx.y),
        first(tile * kRows),
        warp(static_cast<int>(threadIdx.x) / 32),
        lane(static_cast<int>(threadIdx.x) % 32),
        scale(1.0f / sqrtf(static_cast<float>(HD))),
        keep(rm::keep_scale_of(d.p)) {}
  __device__ bool idle() const { return first >= q.L; }
  __device__ int64_t warp_first() const { return first + 16 * warp; }
  // Row 0 of the head's columns in a [rows, C] tensor (the context, dctx; null where it is).
  template <class T>
  __device__ T* rows(T* t) const {
    return t ? t + q.start * s.C + h * HD : nullptr;
  }
};

// An unpadded batch's rows past its sequences, [starts[B], rows) (its rounding up), zero in
// columns [col0, col0 + HD) of a [rows, ld] tensor and its 16-bit copy (each may be null): the
// blocks of the launch's z slice past the sequences (AttentionShape::starts), striding over the
// rows.
__device__ void zero_tail(float* t, uint16_t* bits, int64_t ld, int64_t col0, int64_t HD,
                          const AttentionShape& s) {
  const int64_t first = s.starts[s.B], n = (s.rows - first) * HD;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t at = (first + e / HD) * ld + col0 + e % HD;
    if (t) t[at] = 0.0f;
    if (bits) bits[at] = 0;
  }
}

// Rows [first, first + n) of a head's part (row stride ld) into dst [n, HD] by every thread of
// the block, 16 bytes a load (8 16-bit values, copied; or 4 fp32 ones, rounded to the operand),
// rows at or past L zero. The caller puts the barriers around it. (Every row and head starts at a
// multiple of 16 values; fused_attention_forward checks the tensors' alignment.)
template <class X>
__device__ void stage(X* dst, const X* src, int64_t ld, int64_t first, int n, int64_t L,
                      int64_t HD) {
  for (int64_t e = 8 * threadIdx.x; e < n * HD; e += 8 * kThreads) {
    const int64_t r = first + e / HD;
    uint4 v = {0, 0, 0, 0};
    if (r < L) v = *reinterpret_cast<const uint4*>(src + r * ld + e % HD);
    *reinterpret_cast<uint4*>(dst + e) = v;
  }
}
template <class X>
__device__ void stage(X* dst, const float* src, int64_t ld, int64_t first, int n, int64_t L,
                      int64_t HD) {
  for (int64_t e = 4 * threadIdx.x; e < n * HD; e += 4 * kThreads) {
    const int64_t r = first + e / HD;
    float4 v = {0.0f, 0.0f, 0.0f, 0.0f};
    if (r < L) v = *reinterpret_cast<const float4*>(src + r * ld + e % HD);
    X o[4];
    rm::store(o, v.x);
    rm::store(o + 1, v.y);
    rm::store(o + 2, v.z);
    rm::store(o + 3, v.w);
    *reinterpret_cast<uint2*>(dst + e) = {o[0].bits | unsigned{o[1].bits} << 16,
                                          o[2].bits | unsigned{o[3].bits} << 16};
  }
}

// A staged tile's rows [first, first + n) (those before L) to a head's part of the kept bits
// (row stride ld), 16 bytes a store: QKV's 16-bit copy, written by the block that staged them
// from fp32.
template <class X>
__device__ void keep_rows(X* dst, int64_t ld, const X* tile, int64_t first, int n, int64_t L,
                          int64_t HD) {
  for (int64_t e = 8 * threadIdx.x; e < n * HD; e += 8 * kThreads) {
    const int64_t r = first + e / HD;
    if (r < L)
      *reinterpret_cast<uint4*>(dst + r * ld + e % HD) = *reinterpret_cast<const uint4*>(tile + e);
  }
}

// A 16 x 16 product tile: scale times the sum over the head's 16-column steps of a[n] b[n]^T,
// one side the warp's own rows held as fragments, the other a staged tile's 16 rows (row-major,
// stride HD) loaded a fragment at a time as the sum needs it. The same fragments in the same
// order give the same bits, whichever side is held: what the two kinds of backward block rely
// on.
template <class X, int NT>
__device__ void product_tile(Acc& acc, const FragA<X> (&a)[NT], const X* b_rows, float scale) {
  wmma::fill_fragment(acc, 0.0f);
  for (int n = 0; n < NT; ++n) {
    FragBT<X> b;
    wmma::load_matrix_sync(b, el(b_rows) + n * 16, NT * 16);
    wmma::mma_sync(acc, a[n], b, acc);
  }
  for (int e = 0; e < acc.num_elements; ++e) acc.x[e] = scale * acc.x[e];
}
template <class X, int NT>
__device__ void product_tile(Acc& acc, const X* a_rows, const FragBT<X> (&b)[NT], float scale) {
  wmma::fill_fragment(acc, 0.0f);
  for (int n = 0; n < NT; ++n) {
    FragA<X> a;
    wmma::load_matrix_sync(a, el(a_rows) + n * 16, NT * 16);
    wmma::mma_sync(acc, a, b[n], acc);
  }
  for (int e = 0; e < acc.num_elements; ++e) acc.x[e] = scale * acc.x[e];
}

// A warp's 16 rows of a head's part (row-major [16, HD] at `rows`, stride HD) as fragments.
template <class Frag, int NT, class X>
__device__ void load_rows(Frag (&f)[NT], const X* rows) {
  for (int n = 0; n < NT; ++n) wmma::load_matrix_sync(f[n], el(rows) + n * 16, NT * 16);
}

// The block's 64 rows of an output (the warps' accumulators through `out` [64, HD] fp32) times
// scale, those before L, into a head's part (row stride ld) from row first (dst may be null
// where `bits` is given: the copy alone); where `bits` is given also rounded to the operand X there
// (with `keep`, keep's contract: FP16 writes the rounded value in fp32 too). Where `partial` is
// given, the rows' column sums in row order (a tile's partial sums of the bias gradient). `out` may
// alias what the block used before: the first barrier waits for every warp.
template <int NT, class X>
__device__ void write_block(float* dst, int64_t ld, int64_t first, int64_t L, const Acc (&acc)[NT],
                            float* out, float scale, int warp, X* bits, bool keep,
                            float* partial = nullptr) {
  constexpr int HD = NT * 16;
  __syncthreads();
  for (int n = 0; n < NT; ++n)
    wmma::store_matrix_sync(out + warp * 16 * HD + n * 16, acc[n], HD, wmma::mem_row_major);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < kRows * HD; e += kThreads) {
    const int64_t r = first + e / HD, at = r * ld + e % HD;
    if (r >= L) continue;
    const float v = scale * out[e];
    if (!bits) {
      dst[at] = v;
      continue;
    }
    rm::store(bits + at, v);
    if (dst) dst[at] = keep && std::is_same_v<X, rm::F16Bits> ? rm::widen(bits[at]) : v;
  }
  if (!partial) return;
  for (int c = static_cast<int>(threadIdx.x); c < HD; c += kThreads) {
    float v = 0.0f;
    for (int r = 0; r < kRows && first + r < L; ++r) v += scale * out[r * HD + c];
    partial[c] = v;
  }
}

// ---- forward

// The forward's shared memory: the block's Q rows while they are staged; then the key tile's K
// and V [keys, HD] and each warp's scores [16, keys] (row stride ld floats, 4 more than the
// keys: the 16 rows a warp's lanes read at once fall on 16 banks, two rows a bank, where a
// stride of the keys would put them all on one), whose rows then hold the dropped
// probabilities as operands in their first half (row stride 2 ld elements); at the end the
// context [64, HD] fp32.
template <int HD>
struct ForwardShared {
  static constexpr int kKeys = HD <= 64 ? 64 : 32, kLd = kKeys + 4;
  static constexpr int64_t kKv = 2 * int64_t{kKeys} * HD * 2, kScores = kWarps * 16 * kLd * 4;
  static constexpr int64_t kOut = int64_t{kRows} * HD * 4;
  static constexpr int64_t kBytes = kKv + kScores > kOut ? kKv + kScores : kOut;
};

template <class X, int NT>
__global__ void __launch_bounds__(kThreads)
    fused_forward_kernel(float* ctx, X* ctx16, float* lse, const float* qkv, X* qkv16,
                         const int32_t* mask, AttentionShape s, Dropout d) {
  constexpr int HD = NT * 16;
  using Sh = ForwardShared<HD>;
  constexpr int kKeys = Sh::kKeys, kLd = Sh::kLd;
  static_assert(Sh::kBytes <= 48 * 1024 && kRows * HD * 2 <= Sh::kKv);
  alignas(128) __shared__ unsigned char shared[Sh::kBytes];
  if (blockIdx.z == s.B)  // (the slice past the sequences: the rows none holds)
    return zero_tail(ctx, reinterpret_cast<uint16_t*>(ctx16), s.C, blockIdx.y * HD, HD, s);
  d = kernels::resolved(d);  // (the step's arguments: Dropout::at)
  const Block hd(s, d);
  if (hd.idle()) return;
  const int64_t L = hd.q.L, w0 = hd.warp_first();
  const int lane = hd.lane;
  X* const kt = reinterpret_cast<X*>(shared);
  X* const vt = kt + kKeys * HD;
  float* const sw = reinterpret_cast<float*>(shared + Sh::kKv) + hd.warp * 16 * kLd;
  X* const ops = reinterpret_cast<X*>(sw);
  const bool active = w0 < L;  // (a warp past the sequence only takes part in the barriers)
  // Q staged (through the K and V tiles' memory): its 16-bit copy as its product wrote it, or
  // its fp32 values rounded, the block then writing its rows' kept bits; each warp keeps its 16
  // rows as fragments.
  const X* const q16 = qkv16;
  auto stage_part = [&](X* dst, int part, int64_t first, int n) {
    if (qkv)
      stage(dst, hd.part(qkv, part), hd.C3, first, n, L, HD);
    else
      stage(dst, hd.part(q16, part), hd.C3, first, n, L, HD);
  };
  stage_part(kt, 0, hd.first, kRows);
  __syncthreads();
  if (qkv) keep_rows(hd.part(qkv16, 0), hd.C3, kt, hd.first, kRows, L, HD);
  FragA<X> qf[NT];
  load_rows(qf, kt + 16 * hd.warp * HD);
  // The lane's row r (a pair of lanes a row: columns 2c + half) and its statistics.
  const int r = lane / 2, half = lane % 2;
  const int64_t i = w0 + r;
  const int32_t* m = hd.mask(mask);
  const int64_t tiles = (L + kKeys - 1) / kKeys;
  // S = scale Q K^T of the tile's keys into the warp's scores.
  auto scores = [&] {
    __syncwarp();  // (the warp's last readers of its scores are done)
    for (int kb = 0; kb < kKeys / 16; ++kb) {
      Acc acc;
      product_tile<X, NT>(acc, qf, kt + kb * 16 * HD, hd.scale);
      wmma::store_matrix_sync(sw + kb * 16, acc, kLd, wmma::mem_row_major);
    }
    __syncwarp();
  };
  // Pass 1: each row's running maximum and sum of exponentials.
  float mx = -INFINITY, sum = 0.0f;
  for (int64_t t = 0; t < tiles; ++t) {
    __syncthreads();  // (every warp is done with the tile before)
    stage_part(kt, 1, t * kKeys, kKeys);
    __syncthreads();
    if (!active) continue;
    scores();
    const float* row = sw + r * kLd;
    float tmx = -INFINITY;
    for (int c = half; c < kKeys; c += 2)
      if (t * kKeys + c < L) tmx = fmaxf(tmx, rm::masked_score(row[c], m, t * kKeys + c));
    const float nm = fmaxf(mx, fmaxf(tmx, __shfl_xor_sync(kFullMask, tmx, 1)));
    float ts = 0.0f;
    for (int c = half; c < kKeys; c += 2)
      if (t * kKeys + c < L) ts += expf(rm::masked_score(row[c], m, t * kKeys + c) - nm);
    ts += __shfl_xor_sync(kFullMask, ts, 1);  // (a + b in one lane, b + a in the other)
    sum = sum * expf(mx - nm) + ts;
    mx = nm;
  }
  if (active && i < L && half == 0) lse[hd.row_value(i)] = mx + logf(sum);
  // Pass 2: the scores again, the dropped probabilities, ctx += P V.
  const float inv = 1.0f / sum, ks = hd.keep;
  const uint64_t index0 = i < L ? hd.index0(d, i) : 0;
  Acc o[NT];
  for (int n = 0; n < NT; ++n) wmma::fill_fragment(o[n], 0.0f);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t j0 = t * kKeys;
    __syncthreads();
    stage_part(kt, 1, j0, kKeys);
    stage_part(vt, 2, j0, kKeys);
    __syncthreads();
    if (qkv && j0 >= hd.first && j0 < hd.first + kRows) {  // (the block's own rows' kept bits)
      keep_rows(hd.part(qkv16, 1), hd.C3, kt, j0, kKeys, L, HD);
      keep_rows(hd.part(qkv16, 2), hd.C3, vt, j0, kKeys, L, HD);
    }
    if (!active) continue;
    scores();
    float v[kKeys / 2];
    const float* row = sw + r * kLd;
    for (int c = half, k = 0; c < kKeys; c += 2, ++k) {
      const int64_t j = j0 + c;
      v[k] = i < L && j < L ? rm::dropout(expf(rm::masked_score(row[c], m, j) - mx) * inv, d.p, ks,
                                          d.key, index0 + j)
                            : 0.0f;
    }
    __syncwarp();  // (every lane has read its scores: the operands overwrite them)
    for (int c = half, k = 0; c < kKeys; c += 2, ++k) rm::store(ops + r * 2 * kLd + c, v[k]);
    __syncwarp();
    for (int kb = 0; kb < kKeys / 16; ++kb) {
      FragA<X> p;
      wmma::load_matrix_sync(p, el(ops) + kb * 16, 2 * kLd);
      for (int n = 0; n < NT; ++n) {
        FragB<X> vf;
        wmma::load_matrix_sync(vf, el(vt) + kb * 16 * HD + n * 16, HD);
        wmma::mma_sync(o[n], p, vf, o[n]);
      }
    }
  }
  write_block<NT>(hd.rows(ctx), s.C, hd.first, L, o, reinterpret_cast<float*>(shared), 1.0f,
                  hd.warp, hd.rows(ctx16), true);
}

// ---- backward

// P, g = dropout(dd) and the keep factor of score (i, j): row_math's
// attention_softmax_backward_lse, element by element.
struct BackwardElement {
  float P, g, k;
};
__device__ inline BackwardElement backward_element(float score, float dd, const int32_t* m,
                                                   int64_t j, float lse, const Dropout& d, float ks,
                                                   uint64_t index0) {
  const float P = expf(rm::masked_score(score, m, j) - lse);
  const float k = rm::dropout(1.0f, d.p, ks, d.key, index0 + j);
  return {P, dd * k, k};
}

// dO (dctx): its fp32 values, rounded to the operand as they are staged, or its 16-bit copy as
// the output projection's backward product wrote it (then f32 is null).
template <class X>
struct Dctx {
  const float* f32;
  const X* bits;
};
__device__ inline float value_of(float x) {
  return x;
}
template <class X>
__device__ float value_of(X x) {
  return rm::widen(x);
}
// Rows [first, first + n) of the block's head of dO into dst [n, HD] (stage's).
template <class X>
__device__ void stage_dctx(X* dst, const Block& hd, Dctx<X> g, int64_t first, int n) {
  if (g.f32)
    stage(dst, hd.rows(g.f32), hd.s.C, first, n, hd.q.L, hd.HD);
  else
    stage(dst, hd.rows(g.bits), hd.s.C, first, n, hd.q.L, hd.HD);
}

// D of row i of the block's head: dO . O over the head's columns (dO as given, the context's
// kept 16-bit copy), each lane adding its columns in order, then the warp's sum; 0 past L.
// Equal to sum_j P_j g_j (attention_softmax_backward_lse's dot: O = dropped P V) up to the
// context's rounding (and dO's, given in 16 bits); both kinds of block compute a row's D with
// it, so the same bits.
template <class X>
__device__ float row_dot(const Block& hd, Dctx<X> dctx, const X* ctx16, int64_t i) {
  float v = 0.0f;
  if (i < hd.q.L) {
    const X* o = hd.rows(ctx16) + i * hd.s.C;
    if (dctx.f32) {
      const float* g = hd.rows(dctx.f32) + i * hd.s.C;
      for (int64_t c = hd.lane; c < hd.HD; c += 32) v += value_of(g[c]) * rm::widen(o[c]);
    } else {
      const X* g = hd.rows(dctx.bits) + i * hd.s.C;
      for (int64_t c = hd.lane; c < hd.HD; c += 32) v += value_of(g[c]) * rm::widen(o[c]);
    }
  }
  return WarpLanes{hd.lane}.sum(v);
}

// The backward's shared memory, one buffer in three uses. First the block's 64 rows of its two
// operands [64, HD] each (Q and dO, or K and V) while the warps load their fragments; then a
// step's two tiles of the other side [32, HD] each, each warp's S and dd [16 x 32 pairs] fp32
// and dS and the dropped probabilities as operands, and a query step's D and log-sum-exp; at
// the end the outputs [64, HD] fp32.
template <int HD>
struct BackwardShared {
  static constexpr int64_t kPairs = 16 * kChunk;  // a warp's scores in a step
  static constexpr int64_t kTiles = 2 * int64_t{kChunk} * HD * 2,
                           kStep = kTiles + kWarps * kPairs * (4 + 4 + 2 + 2) + 2 * kChunk * 4,
                           kOwn = 2 * int64_t{kRows} * HD * 2, kOut = int64_t{kRows} * HD * 4;
  static constexpr int64_t kBytes = kStep > kOut ? kStep : kOut;
  // (the step's arrays from byte 0: the two tiles, S, dd, dS, dropped, D, the log-sum-exp)
  static constexpr int64_t kS = kTiles, kDd = kS + kWarps * kPairs * 4,
                           kDs = kDd + kWarps * kPairs * 4, kDropped = kDs + kWarps * kPairs * 2,
                           kD = kDropped + kWarps * kPairs * 2, kLse = kD + kChunk * 4;
  static_assert(kOwn <= kOut && kBytes <= 48 * 1024);
};

// The dQ kind: a block's 64 query rows (a warp's 16 Q and dO rows as fragments), over the keys
// 32 at a time: S and dd = dO V^T again, dS = P (g - D) rounded, dQ += dS K.
template <class X, int NT>
__device__ void dq_rows(const Block& hd, unsigned char* shared, float* dqkv, X* dqkv16, float* prow,
                        Dctx<X> dctx, const X* qkv, const X* ctx16, const float* lse,
                        const int32_t* mask, const Dropout& d) {
  constexpr int HD = NT * 16;
  using Sh = BackwardShared<HD>;
  const int64_t L = hd.q.L, w0 = hd.warp_first();
  const int lane = hd.lane;
  const bool active = w0 < L;
  X* const own = reinterpret_cast<X*>(shared);
  stage(own, hd.part(qkv, 0), hd.C3, hd.first, kRows, L, HD);
  stage_dctx(own + kRows * HD, hd, dctx, hd.first, kRows);
  __syncthreads();
  FragA<X> qf[NT], gf[NT];
  load_rows(qf, own + 16 * hd.warp * HD);
  load_rows(gf, own + (kRows + 16 * hd.warp) * HD);
  float row_lse[16], dot[16];
  for (int r = 0; r < 16; ++r) {
    row_lse[r] = w0 + r < L ? lse[hd.row_value(w0 + r)] : 0.0f;
    dot[r] = row_dot(hd, dctx, ctx16, w0 + r);
  }
  X* const kt = reinterpret_cast<X*>(shared);
  X* const vt = kt + kChunk * HD;
  float* const st = reinterpret_cast<float*>(shared + Sh::kS) + hd.warp * Sh::kPairs;
  float* const gt = reinterpret_cast<float*>(shared + Sh::kDd) + hd.warp * Sh::kPairs;
  X* const ds = reinterpret_cast<X*>(shared + Sh::kDs) + hd.warp * Sh::kPairs;
  const int32_t* m = hd.mask(mask);
  Acc dq[NT];
  for (int n = 0; n < NT; ++n) wmma::fill_fragment(dq[n], 0.0f);
  for (int64_t j0 = 0; j0 < L; j0 += kChunk) {
    __syncthreads();  // (every warp is done with the step before, and with its own rows)
    stage(kt, hd.part(qkv, 1), hd.C3, j0, kChunk, L, HD);
    stage(vt, hd.part(qkv, 2), hd.C3, j0, kChunk, L, HD);
    __syncthreads();
    if (!active) continue;
    // S and dd of keys [j0, j0 + 32): st and gt [16, 32].
    for (int kb = 0; kb < kChunk / 16; ++kb) {
      Acc acc;
      product_tile<X, NT>(acc, qf, kt + kb * 16 * HD, hd.scale);
      wmma::store_matrix_sync(st + kb * 16, acc, kChunk, wmma::mem_row_major);
      product_tile<X, NT>(acc, gf, vt + kb * 16 * HD, 1.0f);
      wmma::store_matrix_sync(gt + kb * 16, acc, kChunk, wmma::mem_row_major);
    }
    __syncwarp();
    const int64_t j = j0 + lane;
    for (int r = 0; r < 16; ++r) {
      const int64_t i = w0 + r;
      float v = 0.0f;
      if (j < L && i < L) {
        const BackwardElement e = backward_element(st[r * kChunk + lane], gt[r * kChunk + lane], m,
                                                   j, row_lse[r], d, hd.keep, hd.index0(d, i));
        v = e.P * (e.g - dot[r]);
      }
      rm::store(ds + r * kChunk + lane, v);
    }
    __syncwarp();
    for (int kb = 0; kb < kChunk / 16; ++kb) {
      FragA<X> a;
      wmma::load_matrix_sync(a, el(ds) + kb * 16, kChunk);
      for (int n = 0; n < NT; ++n) {
        FragB<X> k;
        wmma::load_matrix_sync(k, el(kt) + kb * 16 * HD + n * 16, HD);
        wmma::mma_sync(dq[n], a, k, dq[n]);
      }
    }
  }
  write_block<NT>(hd.part(dqkv, 0), hd.C3, hd.first, L, dq, reinterpret_cast<float*>(shared),
                  hd.scale, hd.warp, hd.part(dqkv16, 0), false, prow ? prow + hd.h * HD : nullptr);
}

// The dK, dV kind: a block's 64 keys (a warp's 16 K and V rows as fragments), over the queries
// 32 at a time: S, dd, P, g, D and dS again (the same 16 x 16 products of the same fragments and
// the same operations: the same bits as the dQ kind's), dV += dropped^T dO, dK += dS^T Q.
template <class X, int NT>
__device__ void dkv_rows(const Block& hd, unsigned char* shared, float* dqkv, X* dqkv16,
                         float* prow, Dctx<X> dctx, const X* qkv, const X* ctx16, const float* lse,
                         const int32_t* mask, const Dropout& d) {
  constexpr int HD = NT * 16;
  using Sh = BackwardShared<HD>;
  const AttentionShape& s = hd.s;
  const int64_t L = hd.q.L, w0 = hd.warp_first();
  const int lane = hd.lane;
  const bool active = w0 < L;
  X* const own = reinterpret_cast<X*>(shared);
  stage(own, hd.part(qkv, 1), hd.C3, hd.first, kRows, L, HD);
  stage(own + kRows * HD, hd.part(qkv, 2), hd.C3, hd.first, kRows, L, HD);
  __syncthreads();
  FragBT<X> kf[NT], vf[NT];  // (K^T and V^T: the products' right operands)
  load_rows(kf, own + 16 * hd.warp * HD);
  load_rows(vf, own + (kRows + 16 * hd.warp) * HD);
  X* const qs = reinterpret_cast<X*>(shared);
  X* const gs = qs + kChunk * HD;  // (dO)
  float* const st = reinterpret_cast<float*>(shared + Sh::kS) + hd.warp * Sh::kPairs;
  float* const gt = reinterpret_cast<float*>(shared + Sh::kDd) + hd.warp * Sh::kPairs;
  X* const ds = reinterpret_cast<X*>(shared + Sh::kDs) + hd.warp * Sh::kPairs;
  X* const dropped = reinterpret_cast<X*>(shared + Sh::kDropped) + hd.warp * Sh::kPairs;
  float* const dot = reinterpret_cast<float*>(shared + Sh::kD);
  float* const row_lse = reinterpret_cast<float*>(shared + Sh::kLse);
  const int32_t* m = hd.mask(mask);
  Acc dk[NT], dv[NT];
  for (int n = 0; n < NT; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  for (int64_t i0 = 0; i0 < L; i0 += kChunk) {
    __syncthreads();
    stage(qs, hd.part(qkv, 0), hd.C3, i0, kChunk, L, HD);
    stage_dctx(gs, hd, dctx, i0, kChunk);
    for (int r = hd.warp; r < kChunk; r += kWarps) {  // (the step's D and log-sum-exp)
      const int64_t i = i0 + r;
      const float v = row_dot(hd, dctx, ctx16, i);
      if (lane == 0) {
        dot[r] = v;
        row_lse[r] = i < L ? lse[hd.row_value(i)] : 0.0f;
      }
    }
    __syncthreads();
    if (!active) continue;
    // S and dd of queries [i0, i0 + 32) and the warp's keys: st and gt [32, 16].
    for (int qb = 0; qb < kChunk / 16; ++qb) {
      Acc acc;
      product_tile<X, NT>(acc, qs + qb * 16 * HD, kf, hd.scale);
      wmma::store_matrix_sync(st + qb * 256, acc, 16, wmma::mem_row_major);
      product_tile<X, NT>(acc, gs + qb * 16 * HD, vf, 1.0f);
      wmma::store_matrix_sync(gt + qb * 256, acc, 16, wmma::mem_row_major);
    }
    __syncwarp();
    for (int e = lane; e < Sh::kPairs; e += 32) {
      const int q = e / 16;
      const int64_t i = i0 + q, j = w0 + e % 16;
      float p = 0.0f, g = 0.0f;
      if (i < L && j < L) {
        const BackwardElement x =
            backward_element(st[e], gt[e], m, j, row_lse[q], d, hd.keep, hd.index0(d, i));
        p = x.P * x.k;
        g = x.P * (x.g - dot[q]);
      }
      rm::store(dropped + e, p);
      rm::store(ds + e, g);
    }
    __syncwarp();
    for (int qb = 0; qb < kChunk / 16; ++qb) {
      FragAT<X> pt, dst;  // dropped^T and dS^T: [keys, queries]
      wmma::load_matrix_sync(pt, el(dropped) + qb * 256, 16);
      wmma::load_matrix_sync(dst, el(ds) + qb * 256, 16);
      for (int n = 0; n < NT; ++n) {
        FragB<X> o, q;
        wmma::load_matrix_sync(o, el(gs) + qb * 16 * HD + n * 16, HD);
        wmma::load_matrix_sync(q, el(qs) + qb * 16 * HD + n * 16, HD);
        wmma::mma_sync(dv[n], pt, o, dv[n]);
        wmma::mma_sync(dk[n], dst, q, dk[n]);
      }
    }
  }
  float* const out = reinterpret_cast<float*>(shared);
  write_block<NT>(hd.part(dqkv, 1), hd.C3, hd.first, L, dk, out, hd.scale, hd.warp,
                  hd.part(dqkv16, 1), false, prow ? prow + s.C + hd.h * HD : nullptr);
  write_block<NT>(hd.part(dqkv, 2), hd.C3, hd.first, L, dv, out, 1.0f, hd.warp, hd.part(dqkv16, 2),
                  false, prow ? prow + 2 * s.C + hd.h * HD : nullptr);
}

// The backward in one launch: blockIdx.x below the tiles of T a dQ block (64 query rows), from
// there a dK, dV block (64 keys). The kinds share nothing (each computes the D it needs), so they
// run side by side. Where dbias is given, each block writes its tile's column sums of what it
// wrote (zeros where its tile is past the sequence) into partial row b * tiles + tile, and the
// last block of a head's Q, K or V columns adds those rows in order onto dbias
// (column_tickets.cuh): deterministic, one launch. At most 168 registers a thread up to head
// size 64 (three blocks, 12 warps, a multiprocessor; nvcc -Xptxas -v: 60-68 bytes spilled); 255
// at 128.
template <class X, int NT>
__global__ void __launch_bounds__(kThreads, NT <= 4 ? 3 : 1)
    fused_backward_kernel(float* dqkv, X* dqkv16, float* dbias, float* partial, unsigned* tickets,
                          const float* dctx, const X* dctx16, const X* qkv, const X* ctx16,
                          const float* lse, const int32_t* mask, AttentionShape s, Dropout d) {
  constexpr int HD = NT * 16;
  alignas(128) __shared__ unsigned char shared[BackwardShared<HD>::kBytes];
  if (blockIdx.z == s.B) {  // (the slice past the sequences: the rows none holds)
    for (int k = 0; k < 3; ++k)
      zero_tail(dqkv, reinterpret_cast<uint16_t*>(dqkv16), 3 * s.C, k * s.C + blockIdx.y * HD, HD,
                s);
    return;
  }
  d = kernels::resolved(d);  // (the step's arguments: Dropout::at)
  const int64_t tiles = gridDim.x / 2, x = blockIdx.x;
  const bool dq = x < tiles;
  const int64_t tile = dq ? x : x - tiles;
  const Block hd(s, d, tile);
  float* prow = dbias ? partial + (hd.b * tiles + tile) * hd.C3 : nullptr;
  const int first_part = dq ? 0 : 1, parts = dq ? 1 : 2;
  if (!hd.idle()) {
    const Dctx<X> g{dctx, dctx16};
    if (dq)
      dq_rows<X, NT>(hd, shared, dqkv, dqkv16, prow, g, qkv, ctx16, lse, mask, d);
    else
      dkv_rows<X, NT>(hd, shared, dqkv, dqkv16, prow, g, qkv, ctx16, lse, mask, d);
  } else if (prow) {
    for (int k = first_part; k < first_part + parts; ++k)
      for (int c = static_cast<int>(threadIdx.x); c < HD; c += kThreads)
        prow[k * s.C + hd.h * HD + c] = 0.0f;
  }
  if (!dbias) return;
  const unsigned blocks = static_cast<unsigned>(s.B * tiles);  // (a column's partial rows)
  for (int k = first_part; k < first_part + parts; ++k)
    if (last_ticket(tickets + k * s.NH + hd.h, blocks))
      for (int c = static_cast<int>(threadIdx.x); c < HD; c += kThreads)
        add_chunks(dbias, partial, blocks, hd.C3, k * s.C + hd.h * HD + c);
}

// f(X*, NT) with the precision's operand type and the head's 16-column tiles.
template <class F>
void with_fused_types(Precision p, int64_t head, F&& f) {
  auto tiles = [&](auto* x) {
    switch (head / 16) {
      case 1:
        return f(x, std::integral_constant<int, 1>{});
      case 2:
        return f(x, std::integral_constant<int, 2>{});
      case 4:
        return f(x, std::integral_constant<int, 4>{});
      case 8:
        return f(x, std::integral_constant<int, 8>{});
      default:
        fail("the fused attention takes head sizes 16, 32, 64 and 128, not ", head);
    }
  };
  if (p == Precision::BF16) return tiles(static_cast<rm::Bf16Bits*>(nullptr));
  return tiles(static_cast<rm::F16Bits*>(nullptr));
}

// The tensors the kernels stage and keep 16 bytes at a time: each at a 16-byte boundary (a
// head's rows then start at one too: head sizes are multiples of 16).
void check_aligned(const char* what, const void* p) {
  BT_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "the fused attention reads and writes ", what,
           " 16 bytes at a time, and it does not start at a 16-byte boundary (", p,
           "): an arena's tensors do; a caller's must too");
}

// Tiles of 64 rows by heads by sequences, and with variable lengths a slice more: the blocks
// that zero the rows past the sequences (whatever the batch: a graph's launch).
dim3 tile_grid(const AttentionShape& s) {
  return dim3(static_cast<unsigned>((s.T + kRows - 1) / kRows), static_cast<unsigned>(s.NH),
              static_cast<unsigned>(s.B + (s.starts ? 1 : 0)));
}

}  // namespace

void fused_attention_forward(Precision p, kernels::Kept ctx, float* lse, kernels::Kept qkv,
                             const int32_t* mask, const AttentionShape& s, const Dropout& d) {
  if (s.B == 0) return;
  BT_CHECK(
      qkv.bits,
      "the fused attention writes or reads QKV's 16-bit copy (Kept::bits), and none was given");
  if (qkv.f32) check_aligned("QKV", qkv.f32);
  check_aligned("QKV's 16-bit copy", qkv.bits);
  with_fused_types(p, s.C / s.NH, [&](auto* x, auto nt) {
    using X = std::remove_pointer_t<decltype(x)>;
    const auto attention_forward_fused = fused_forward_kernel<X, decltype(nt)::value>;
    BT_LAUNCH(attention_forward_fused, tile_grid(s), kThreads, 0, compute_stream())
    (ctx.f32, reinterpret_cast<X*>(ctx.bits), lse, qkv.f32, reinterpret_cast<X*>(qkv.bits), mask, s,
     d);
  });
  check_launch();
}

void fused_attention_backward(Precision p, kernels::Kept dqkv, float* dbias, kernels::KeptIn dctx,
                              const uint16_t* qkv, const uint16_t* ctx16, const float* lse,
                              const int32_t* mask, const AttentionShape& s, const Dropout& d) {
  if (s.B == 0) return;
  BT_CHECK(ctx16,
           "the fused attention's backward reads the context's 16-bit copy its forward wrote "
           "(AttentionSaved::ctx16), and none was given");
  check_aligned("QKV's 16-bit copy", qkv);
  BT_CHECK(dctx.f32 || dctx.bits,
           "the fused attention's backward: no dctx (neither its fp32 "
           "values nor its 16-bit copy)");
  if (dctx.f32)
    check_aligned("dctx", dctx.f32);
  else
    check_aligned("dctx's 16-bit copy", dctx.bits);
  BT_CHECK(dqkv.f32 || dqkv.bits,
           "the fused attention's backward: nowhere to write dQKV (neither fp32 values nor a "
           "16-bit copy)");
  const int64_t tiles = (s.T + kRows - 1) / kRows;
  float* partial = nullptr;
  unsigned* tickets = nullptr;
  if (dbias) {
    partial = static_cast<float*>(scratch(
        kColumnSumsSlot, fused_attention_tiles(s.B, s.T) * 3 * s.C * int64_t{sizeof(float)}));
    tickets = column_tickets(3 * s.NH);
  }
  with_fused_types(p, s.C / s.NH, [&](auto* x, auto nt) {
    using X = std::remove_pointer_t<decltype(x)>;
    const auto attention_backward_fused = fused_backward_kernel<X, decltype(nt)::value>;
    dim3 grid = tile_grid(s);
    grid.x = static_cast<unsigned>(2 * tiles);  // (the dQ blocks, then the dK, dV blocks)
    BT_LAUNCH(attention_backward_fused, grid, kThreads, 0, compute_stream())
    (dqkv.f32, reinterpret_cast<X*>(dqkv.bits), dbias, partial, tickets, dctx.f32,
     dctx.f32 ? nullptr : reinterpret_cast<const X*>(dctx.bits), reinterpret_cast<const X*>(qkv),
     reinterpret_cast<const X*>(ctx16), lse, mask, s, d);
  });
  check_launch();
}

}  // namespace bertrain::cuda
