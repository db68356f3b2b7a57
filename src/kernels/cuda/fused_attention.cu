// The fused attention kernels (cuda.h, fused_attention_forward / _backward): the blocked
// (flash-style) algorithm of kernels/cpu/attention_blocked.cpp in two launches a layer (one
// forward, one backward), the scores never in global memory, for BF16 and FP16 with head sizes a
// multiple of 16 up to 128 and at most 512 tokens. The products on tensor cores (warp matrix
// operations, m16n16k16: 16-bit operands, fp32 accumulation), each block one warp and a tile of
// 16 rows:
//   forward      a block per 16 query rows of a (sequence, head): S = scale Q K^T for the whole
//                rows into shared memory, the row pass (row_math's attention_softmax_lse: the
//                same operations in the same order), the dropped probabilities rounded to the
//                operand in place, ctx = P V; the row log-sum-exp kept.
//   backward     two kinds of block side by side. dQ: a block per 16 query rows, S and
//                dd = dO V^T again, 32 keys at a time, dS = P (g - D) rounded, dQ = scale dS K.
//                dK, dV: a block per 16 keys, over the query tiles, S, dd, P, g and dS again
//                (the same operations on the same values: the same bits as dQ's),
//                dV += dropped^T dO, dK += scale dS^T Q. Each row's D = sum_j P_j g_j is
//                computed as dO . O (FlashAttention-2's identity: O = dropped P V), from the
//                context's kept 16-bit copy, by whichever block needs it, so neither kind waits
//                for the other (the CPU's blocked kernel sums P g: the two differ by the
//                context's rounding).
//                Where asked, each block also rounds what it writes into dQKV's 16-bit copy
//                (what QKV's backward reads) and sums its columns for QKV's bias gradient.
// Variable lengths directly: AttentionShape::starts (the sequences' first rows, as
// FlashAttention's cumulative offsets) makes one launch run every sequence of a packed or
// unpadded batch, each over its own length; without it sequence b is rows [b T, b T + T).
// QKV (forward) and dO (dctx) are read in fp32 and rounded to the operand as they are staged:
// the forward's blocks write QKV's kept bits (each its rows of its head) and the context with
// its 16-bit copy, so no rounding launch is left around attention.
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

constexpr int kTile =
    static_cast<int>(kernels::kFusedAttentionTile);  // a tile's rows, a fragment's side
constexpr int kChunk32 = 32;                         // dQ's keys at a time (a lane a column)
constexpr int kMaxT = static_cast<int>(kFusedAttentionTokens);
constexpr int kMaxHead = 128;           // the largest head size (fused_attention_runs)
constexpr int kRowValues = kMaxT / 32;  // a row's values a lane holds in the forward row pass

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
  // Row 0 of part (0 Q, 1 K, 2 V) of the head in a [rows, 3C] tensor.
  template <class T>
  __device__ T* part(T* qkv, int p) const {
    return qkv + q.start * C3 + p * s.C + h * HD;
  }
  __device__ int64_t row_value(int64_t i) const { return s.NH * q.start + h * q.L + i; }
  __device__ const int32_t* mask(const int32_t* m) const { return m + q.start; }
  __device__ uint64_t index0(const Dropout& d, int64_t i) const {
    return d.offset + s.dropout_row(b * s.NH + h, i);
  }
};

// A block's (sequence, head), the first row of its tile (16 rows a tile: queries, or keys for dK
// and dV; blockIdx.x's unless given), its lane, and the products' scale and dropout's keep factor.
struct Block : Head {
  int64_t first;
  int lane;
  float scale, keep;
  __device__ Block(const AttentionShape& shape, const Dropout& d, int64_t tile = blockIdx.x)
      : Head(shape, blockIdx.z, blockIdx.y),
        first(tile * kTile),
        lane(static_cast<int>(threadIdx.x)),
        scale(1.0f / sqrtf(static_cast<float>(HD))),
        keep(rm::keep_scale_of(d.p)) {}
  __device__ bool idle() const { return first >= q.L; }
  // Row 0 of the head's columns in a [rows, C] tensor (the context, dctx).
  template <class T>
  __device__ T* rows(T* t) const {
    return t + q.start * s.C + h * HD;
  }
};

// Rows [first, first + n) of a head's part (row stride ld) into dst [n, HD]; rows at or past L
// zero. fp32 sources are rounded to the operand X as they are written.
template <class X>
__device__ void stage(X* dst, const X* src, int64_t ld, int64_t first, int n, int64_t L, int64_t HD,
                      int lane) {
  __syncwarp();  // (the tile's last readers are done)
  for (int64_t e = lane; e < n * HD; e += 32) {
    const int64_t r = first + e / HD;
    dst[e] = r < L ? src[r * ld + e % HD] : X{0};
  }
  __syncwarp();
}
template <class X>
__device__ void stage(X* dst, const float* src, int64_t ld, int64_t first, int n, int64_t L,
                      int64_t HD, int lane) {
  __syncwarp();
  for (int64_t e = lane; e < n * HD; e += 32) {
    const int64_t r = first + e / HD;
    rm::store(dst + e, r < L ? src[r * ld + e % HD] : 0.0f);
  }
  __syncwarp();
}

// A staged tile's rows [first, first + 16) (those before L) to a head's part of the kept bits
// (row stride ld): QKV's 16-bit copy, written by the block that staged them from fp32.
template <class X>
__device__ void keep_rows(X* dst, int64_t ld, const X* tile, int64_t first, int64_t L, int64_t HD,
                          int lane) {
  for (int64_t e = lane; e < kTile * HD; e += 32) {
    const int64_t r = first + e / HD;
    if (r < L) dst[r * ld + e % HD] = tile[e];
  }
}

// A 16 x 16 product tile of a (16 x HD) and b^T (b: 16 x HD, both row-major with stride HD),
// times scale, into out (row stride ld).
template <class X>
__device__ void product_abt(float* out, int64_t ld, const X* a, const X* b, int64_t HD,
                            float scale) {
  Acc acc;
  wmma::fill_fragment(acc, 0.0f);
  for (int64_t k = 0; k < HD; k += 16) {
    FragA<X> fa;
    FragBT<X> fb;
    wmma::load_matrix_sync(fa, el(a) + k, static_cast<unsigned>(HD));
    wmma::load_matrix_sync(fb, el(b) + k, static_cast<unsigned>(HD));
    wmma::mma_sync(acc, fa, fb, acc);
  }
  for (int e = 0; e < acc.num_elements; ++e) acc.x[e] = scale * acc.x[e];
  wmma::store_matrix_sync(out, acc, static_cast<unsigned>(ld), wmma::mem_row_major);
}

// The accumulators' rows (row-major [16, HD] through `tile`, fp32) times scale, those before L,
// into a head's part (row stride ld) from row first; where `bits` is given also rounded to the
// operand X there (with `keep`, keep's contract: FP16 writes the rounded value in fp32 too).
// `tile` keeps the accumulators (tile_column_sums).
template <int NT, class X = rm::Bf16Bits>
__device__ void write_rows(float* dst, int64_t ld, int64_t first, int64_t L, Acc (&acc)[NT],
                           float* tile, float scale, int lane, X* bits = nullptr,
                           bool keep = true) {
  const int64_t HD = NT * 16;
  __syncwarp();
  for (int n = 0; n < NT; ++n)
    wmma::store_matrix_sync(tile + n * 16, acc[n], static_cast<unsigned>(HD), wmma::mem_row_major);
  __syncwarp();
  for (int64_t e = lane; e < kTile * HD; e += 32) {
    const int64_t r = first + e / HD, at = r * ld + e % HD;
    if (r >= L) continue;
    const float v = scale * tile[e];
    if (!bits) {
      dst[at] = v;
      continue;
    }
    rm::store(bits + at, v);
    dst[at] = keep && std::is_same_v<X, rm::F16Bits> ? rm::widen(bits[at]) : v;
  }
}

// The column sums of the rows write_rows wrote (scale times `tile`'s accumulators, the rows
// before L in order) into partial[HD]: a tile's partial sums of the bias gradient.
template <int NT>
__device__ void tile_column_sums(float* partial, const float* tile, float scale, int64_t first,
                                 int64_t L, int lane) {
  constexpr int HD = NT * 16;
  __syncwarp();
  for (int c = lane; c < HD; c += 32) {
    float v = 0.0f;
    for (int r = 0; r < kTile && first + r < L; ++r) v += scale * tile[r * HD + c];
    partial[c] = v;
  }
}

template <class X, int NT>
__global__ void __launch_bounds__(32)
    fused_forward_kernel(float* ctx, X* ctx16, float* lse, const float* qkv, X* qkv16,
                         const int32_t* mask, AttentionShape s, Dropout d) {
  constexpr int HD = NT * 16;
  d = kernels::resolved(d);  // (the step's arguments: Dropout::at)
  const Block hd(s, d);
  if (hd.idle()) return;
  const int64_t i0 = hd.first, L = hd.q.L;
  const int lane = hd.lane;
  // The tile's scores [16, ld] (fp32); each row then holds its dropped probabilities as
  // operands in its first half (row stride 2 ld elements); at the end the context [16, HD].
  alignas(32) __shared__ float sc[kTile * kMaxT];
  alignas(32) __shared__ X qs[kTile * kMaxHead];
  alignas(32) __shared__ X kv[kTile * kMaxHead];
  const int64_t tiles = (L + kTile - 1) / kTile, ld = tiles * kTile;
  const float scale = hd.scale;
  // Q, K and V rounded as they are staged; this block writes the kept bits of its rows.
  stage(qs, hd.part(qkv, 0), hd.C3, i0, kTile, L, HD, lane);
  keep_rows(hd.part(qkv16, 0), hd.C3, qs, i0, L, HD, lane);
  for (int64_t t = 0; t < tiles; ++t) {
    stage(kv, hd.part(qkv, 1), hd.C3, t * kTile, kTile, L, HD, lane);
    if (t * kTile == i0) keep_rows(hd.part(qkv16, 1), hd.C3, kv, i0, L, HD, lane);
    product_abt(sc + t * kTile, ld, qs, kv, HD, scale);
  }
  __syncwarp();
  // The row pass: row_math::attention_softmax_lse, the row's values held by its lanes so the
  // operands can be written over the scores.
  const WarpLanes l{lane};
  const int32_t* m = hd.mask(mask);
  const float ks = hd.keep;
  for (int r = 0; r < kTile; ++r) {
    const int64_t i = i0 + r;
    float* row = sc + r * ld;
    X* ops = reinterpret_cast<X*>(row);
    float v[kRowValues];
    if (i < L) {
      const auto [mx, sum] = rm::masked_exp_sum(row, m, L, l);
      const float inv = 1.0f / sum;
      const uint64_t index0 = hd.index0(d, i);
      int c = 0;
      for (int64_t j = lane; j < L; j += 32, ++c)
        v[c] = rm::dropout(expf(rm::masked(row, m, j) - mx) * inv, d.p, ks, d.key, index0 + j);
      if (lane == 0) lse[hd.row_value(i)] = mx + logf(sum);
    }
    __syncwarp();  // (every lane has read the row)
    int c = 0;
    for (int64_t j = lane; j < ld; j += 32, ++c) rm::store(ops + j, i < L && j < L ? v[c] : 0.0f);
  }
  // ctx = P V, 16 keys at a time.
  Acc o[NT];
  for (int n = 0; n < NT; ++n) wmma::fill_fragment(o[n], 0.0f);
  for (int64_t t = 0; t < tiles; ++t) {
    stage(kv, hd.part(qkv, 2), hd.C3, t * kTile, kTile, L, HD, lane);
    if (t * kTile == i0) keep_rows(hd.part(qkv16, 2), hd.C3, kv, i0, L, HD, lane);
    FragA<X> p;
    wmma::load_matrix_sync(p, el(reinterpret_cast<const X*>(sc)) + t * kTile,
                           static_cast<unsigned>(2 * ld));
    for (int n = 0; n < NT; ++n) {
      FragB<X> v;
      wmma::load_matrix_sync(v, el(kv) + n * 16, HD);
      wmma::mma_sync(o[n], p, v, o[n]);
    }
  }
  write_rows<NT>(hd.rows(ctx), s.C, i0, L, o, sc, 1.0f, lane, ctx16 ? hd.rows(ctx16) : nullptr);
}

// P, g = dropout(dd) and the keep factor of score (r, j) of a tile: row_math's
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

// D of rows [first, first + 16) of the block's head: dO . O over the head's columns (dctx in
// fp32, the context's kept 16-bit copy), each lane adding its columns in order, then the warp's
// sum; 0 past L. Equal to sum_j P_j g_j (attention_softmax_backward_lse's dot: O = dropped P V)
// up to the context's rounding, and the same bits in both roles of the backward kernel.
template <class X>
__device__ void row_dots(float (&dot)[kTile], const Block& hd, const float* dctx, const X* ctx16,
                         int64_t first) {
  const WarpLanes l{hd.lane};
  const float* g = hd.rows(dctx);
  const X* o = hd.rows(ctx16);
  for (int r = 0; r < kTile; ++r) {
    const int64_t i = first + r;
    float v = 0.0f;
    if (i < hd.q.L)
      for (int64_t c = hd.lane; c < hd.HD; c += 32)
        v += g[i * hd.s.C + c] * rm::widen(o[i * hd.s.C + c]);
    dot[r] = l.sum(v);
  }
}

// Shared memory carved into a role's arrays, each at 32 bytes (the fragments' alignment).
__host__ __device__ constexpr int64_t carved(int64_t bytes) {
  return (bytes + 31) / 32 * 32;
}
struct Carve {
  unsigned char* at;
  template <class T>
  __device__ T* take(int64_t n) {
    T* p = reinterpret_cast<T*>(at);
    at += carved(n * static_cast<int64_t>(sizeof(T)));
    return p;
  }
};
// The same carve counting bytes only: a role's size (shared_bytes) comes from its arrays' list.
struct CarveCount {
  int64_t used = 0;
  template <class T>
  __host__ __device__ constexpr T* take(int64_t n) {
    used += carved(n * static_cast<int64_t>(sizeof(T)));
    return nullptr;
  }
};
template <class Arrays>
__host__ __device__ constexpr int64_t shared_bytes() {
  CarveCount c;
  const Arrays a(c);
  return c.used;
}

// The dQ role's arrays: the query tile, its dO rows, 32 keys' K and V, S and dd of those keys,
// dS rounded, the output tile.
template <class X, int HD>
struct DqArrays {
  X *qs, *dos, *ks, *vs;
  float *st, *gt;
  X* ds;
  float* out;
  template <class C>
  __host__ __device__ constexpr explicit DqArrays(C& c)
      : qs(c.template take<X>(kTile * HD)),
        dos(c.template take<X>(kTile * HD)),
        ks(c.template take<X>(kChunk32 * HD)),
        vs(c.template take<X>(kChunk32 * HD)),
        st(c.template take<float>(kTile * kChunk32)),
        gt(c.template take<float>(kTile * kChunk32)),
        ds(c.template take<X>(kTile * kChunk32)),
        out(c.template take<float>(kTile * HD)) {}
};

// The dK, dV role's arrays: the key tile's K and V, a query tile and its dO rows, S and dd of the
// 16 x 16 pairs, the dropped probabilities and dS rounded, the output tile.
template <class X, int HD>
struct DkvArrays {
  X *kt, *vt, *qs, *dos;
  float *st, *gt;
  X *dropped, *ds;
  float* out;
  template <class C>
  __host__ __device__ constexpr explicit DkvArrays(C& c)
      : kt(c.template take<X>(kTile * HD)),
        vt(c.template take<X>(kTile * HD)),
        qs(c.template take<X>(kTile * HD)),
        dos(c.template take<X>(kTile * HD)),
        st(c.template take<float>(kTile * kTile)),
        gt(c.template take<float>(kTile * kTile)),
        dropped(c.template take<X>(kTile * kTile)),
        ds(c.template take<X>(kTile * kTile)),
        out(c.template take<float>(kTile * HD)) {}
};

// The dQ role: a block's 16 query rows. S and dd = dO V^T again, 32 keys at a time; dS = P (g - D)
// rounded, dQ = scale dS K.
template <class X, int NT>
__device__ void dq_tile(const Block& hd, Carve& sh, float* dqkv, X* dqkv16, float* prow,
                        const float* dctx, const X* qkv, const X* ctx16, const float* lse,
                        const int32_t* mask, const Dropout& d) {
  constexpr int HD = NT * 16;
  const AttentionShape& s = hd.s;
  const int64_t i0 = hd.first, L = hd.q.L;
  const int lane = hd.lane;
  const auto [qs, dos, ks_, vs, st, gt, ds, out] = DqArrays<X, HD>(sh);
  const float scale = hd.scale, keep = hd.keep;
  const int32_t* m = hd.mask(mask);
  stage(qs, hd.part(qkv, 0), hd.C3, i0, kTile, L, HD, lane);
  stage(dos, hd.rows(dctx), s.C, i0, kTile, L, HD, lane);
  float row_lse[kTile], dot[kTile];
  for (int r = 0; r < kTile; ++r) row_lse[r] = i0 + r < L ? lse[hd.row_value(i0 + r)] : 0.0f;
  row_dots(dot, hd, dctx, ctx16, i0);
  Acc dq[NT];
  for (int n = 0; n < NT; ++n) wmma::fill_fragment(dq[n], 0.0f);
  for (int64_t j0 = 0; j0 < L; j0 += kChunk32) {
    // S and dd of keys [j0, j0 + 32): st and gt [16, 32].
    stage(ks_, hd.part(qkv, 1), hd.C3, j0, kChunk32, L, HD, lane);
    stage(vs, hd.part(qkv, 2), hd.C3, j0, kChunk32, L, HD, lane);
    for (int half = 0; half < 2; ++half) {
      product_abt(st + half * 16, kChunk32, qs, ks_ + half * 16 * HD, HD, scale);
      product_abt(gt + half * 16, kChunk32, dos, vs + half * 16 * HD, HD, 1.0f);
    }
    __syncwarp();
    const int64_t j = j0 + lane;
    for (int r = 0; r < kTile; ++r) {
      float v = 0.0f;
      if (j < L && i0 + r < L) {
        const BackwardElement e = backward_element(st[r * kChunk32 + lane], gt[r * kChunk32 + lane],
                                                   m, j, row_lse[r], d, keep, hd.index0(d, i0 + r));
        v = e.P * (e.g - dot[r]);
      }
      rm::store(ds + r * kChunk32 + lane, v);
    }
    __syncwarp();
    for (int half = 0; half < 2; ++half) {
      FragA<X> a;
      wmma::load_matrix_sync(a, el(ds) + half * 16, kChunk32);
      for (int n = 0; n < NT; ++n) {
        FragB<X> k;
        wmma::load_matrix_sync(k, el(ks_) + half * 16 * HD + n * 16, HD);
        wmma::mma_sync(dq[n], a, k, dq[n]);
      }
    }
  }
  write_rows<NT>(hd.part(dqkv, 0), hd.C3, i0, L, dq, out, scale, lane,
                 dqkv16 ? hd.part(dqkv16, 0) : nullptr, false);
  if (prow) tile_column_sums<NT>(prow + hd.h * HD, out, scale, i0, L, lane);
}

// The dK, dV role: a block's 16 keys, over the query tiles: S, dd, P, g, D and dS again (the same
// operations on the same values: the same bits as the dQ role's), dV += dropped^T dO,
// dK += scale dS^T Q.
template <class X, int NT>
__device__ void dkv_tile(const Block& hd, Carve& sh, float* dqkv, X* dqkv16, float* prow,
                         const float* dctx, const X* qkv, const X* ctx16, const float* lse,
                         const int32_t* mask, const Dropout& d) {
  constexpr int HD = NT * 16;
  const AttentionShape& s = hd.s;
  const int64_t j0 = hd.first, L = hd.q.L;
  const int lane = hd.lane;
  const auto [kt, vt, qs, dos, st, gt, dropped, ds, out] = DkvArrays<X, HD>(sh);
  const float scale = hd.scale, keep = hd.keep;
  const int32_t* m = hd.mask(mask);
  stage(kt, hd.part(qkv, 1), hd.C3, j0, kTile, L, HD, lane);
  stage(vt, hd.part(qkv, 2), hd.C3, j0, kTile, L, HD, lane);
  Acc dk[NT], dv[NT];
  for (int n = 0; n < NT; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  for (int64_t i0 = 0; i0 < L; i0 += kTile) {
    stage(qs, hd.part(qkv, 0), hd.C3, i0, kTile, L, HD, lane);
    stage(dos, hd.rows(dctx), s.C, i0, kTile, L, HD, lane);
    float dot[kTile];
    row_dots(dot, hd, dctx, ctx16, i0);
    product_abt(st, kTile, qs, kt, HD, scale);
    product_abt(gt, kTile, dos, vt, HD, 1.0f);
    __syncwarp();
    for (int e = lane; e < kTile * kTile; e += 32) {
      const int64_t i = i0 + e / kTile, j = j0 + e % kTile;
      float p = 0.0f, g = 0.0f;
      if (i < L && j < L) {
        const BackwardElement x =
            backward_element(st[e], gt[e], m, j, lse[hd.row_value(i)], d, keep, hd.index0(d, i));
        p = x.P * x.k;
        g = x.P * (x.g - dot[e / kTile]);
      }
      rm::store(dropped + e, p);
      rm::store(ds + e, g);
    }
    __syncwarp();
    FragAT<X> pt, dst;  // dropped^T and dS^T: [keys, queries]
    wmma::load_matrix_sync(pt, el(dropped), kTile);
    wmma::load_matrix_sync(dst, el(ds), kTile);
    for (int n = 0; n < NT; ++n) {
      FragB<X> o, q;
      wmma::load_matrix_sync(o, el(dos) + n * 16, HD);
      wmma::load_matrix_sync(q, el(qs) + n * 16, HD);
      wmma::mma_sync(dv[n], pt, o, dv[n]);
      wmma::mma_sync(dk[n], dst, q, dk[n]);
    }
  }
  write_rows<NT>(hd.part(dqkv, 1), hd.C3, j0, L, dk, out, scale, lane,
                 dqkv16 ? hd.part(dqkv16, 1) : nullptr, false);
  if (prow) tile_column_sums<NT>(prow + s.C + hd.h * HD, out, scale, j0, L, lane);
  write_rows<NT>(hd.part(dqkv, 2), hd.C3, j0, L, dv, out, 1.0f, lane,
                 dqkv16 ? hd.part(dqkv16, 2) : nullptr, false);
  if (prow) tile_column_sums<NT>(prow + 2 * s.C + hd.h * HD, out, 1.0f, j0, L, lane);
}

// The backward in one launch: blockIdx.x below the tiles of T a dQ block (16 query rows), from
// there a dK, dV block (16 keys). The roles share nothing (each computes the D it needs), so they
// run side by side; their shared memory is one buffer, the larger role's size. Where dbias is
// given, each block writes its tile's column sums of what it wrote (zeros where its tile is past
// the sequence) into partial row b * tiles + tile, and the last block of a head's Q, K or V
// columns adds those rows in order onto dbias (column_tickets.cuh): deterministic, one launch.
template <class X, int NT>
__global__ void __launch_bounds__(32)
    fused_backward_kernel(float* dqkv, X* dqkv16, float* dbias, float* partial, unsigned* tickets,
                          const float* dctx, const X* qkv, const X* ctx16, const float* lse,
                          const int32_t* mask, AttentionShape s, Dropout d) {
  constexpr int HD = NT * 16;
  d = kernels::resolved(d);  // (the step's arguments: Dropout::at)
  constexpr int64_t dq_bytes = shared_bytes<DqArrays<X, HD>>(),
                    dkv_bytes = shared_bytes<DkvArrays<X, HD>>();
  alignas(128) __shared__ unsigned char shared[dq_bytes > dkv_bytes ? dq_bytes : dkv_bytes];
  const int64_t tiles = gridDim.x / 2, x = blockIdx.x;
  const bool dq = x < tiles;
  const int64_t tile = dq ? x : x - tiles;
  const Block hd(s, d, tile);
  float* prow = dbias ? partial + (hd.b * tiles + tile) * hd.C3 : nullptr;
  const int first_part = dq ? 0 : 1, parts = dq ? 1 : 2;
  if (!hd.idle()) {
    Carve sh{shared};
    if (dq)
      dq_tile<X, NT>(hd, sh, dqkv, dqkv16, prow, dctx, qkv, ctx16, lse, mask, d);
    else
      dkv_tile<X, NT>(hd, sh, dqkv, dqkv16, prow, dctx, qkv, ctx16, lse, mask, d);
  } else if (prow) {
    for (int k = first_part; k < first_part + parts; ++k)
      for (int c = hd.lane; c < HD; c += 32) prow[k * s.C + hd.h * HD + c] = 0.0f;
  }
  if (!dbias) return;
  const unsigned blocks = gridDim.z * static_cast<unsigned>(tiles);  // (a column's partial rows)
  for (int k = first_part; k < first_part + parts; ++k)
    if (last_ticket(tickets + k * s.NH + hd.h, blocks))
      for (int c = hd.lane; c < HD; c += 32)
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

dim3 tile_grid(const AttentionShape& s) {
  return dim3(static_cast<unsigned>((s.T + kTile - 1) / kTile), static_cast<unsigned>(s.NH),
              static_cast<unsigned>(s.B));
}

}  // namespace

void fused_attention_forward(Precision p, kernels::Kept ctx, float* lse, kernels::Kept qkv,
                             const int32_t* mask, const AttentionShape& s, const Dropout& d) {
  if (s.B == 0) return;
  with_fused_types(p, s.C / s.NH, [&](auto* x, auto nt) {
    using X = std::remove_pointer_t<decltype(x)>;
    const auto attention_forward_fused = fused_forward_kernel<X, decltype(nt)::value>;
    BT_LAUNCH(attention_forward_fused, tile_grid(s), 32, 0, compute_stream())
    (ctx.f32, reinterpret_cast<X*>(ctx.bits), lse, qkv.f32, reinterpret_cast<X*>(qkv.bits), mask, s,
     d);
  });
  check_launch();
}

void fused_attention_backward(Precision p, kernels::Kept dqkv, float* dbias, const float* dctx,
                              const uint16_t* qkv, const uint16_t* ctx16, const float* lse,
                              const int32_t* mask, const AttentionShape& s, const Dropout& d) {
  if (s.B == 0) return;
  BT_CHECK(ctx16,
           "the fused attention's backward reads the context's 16-bit copy its forward wrote "
           "(AttentionSaved::ctx16), and none was given");
  const int64_t tiles = (s.T + kTile - 1) / kTile;
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
    BT_LAUNCH(attention_backward_fused, grid, 32, 0, compute_stream())
    (dqkv.f32, reinterpret_cast<X*>(dqkv.bits), dbias, partial, tickets, dctx,
     reinterpret_cast<const X*>(qkv), reinterpret_cast<const X*>(ctx16), lse, mask, s, d);
  });
  check_launch();
}

}  // namespace bertrain::cuda
