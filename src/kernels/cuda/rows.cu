// Attention's row passes, the cross-entropy and the optimizer on the GPU, running the row math
// the CPU tests check (kernels/row_math.h): one warp per row, one thread per element. The sums
// the host needs (the loss, LAMB's norms, the gradient norm) come back as per-row or per-block
// partial values, added on the host in double in a fixed order.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/lanes.cuh"

namespace bertrain::cuda {

namespace rm = kernels::row_math;

namespace {

// Row r of the [B, NH, T, T] scores is query i of (sequence, head) bh = r / T; b = bh / NH. The
// probabilities in fp32 (P float), or kept and dropped in 16 bits (rm::Bf16Bits, rm::F16Bits).
template <class P>
__global__ void attention_softmax_kernel(P* probs, P* dropped, const float* scores,
                                         const int32_t* mask, kernels::AttentionShape s, float p,
                                         uint64_t key, uint64_t offset, const uint64_t* at) {
  step_key(key, offset, at);
  const int64_t r = warp_row();
  if (r >= s.B * s.NH * s.T) return;
  const int64_t bh = r / s.T, i = r % s.T, T = s.T;
  P* out = dropped ? dropped + r * T : nullptr;
  const int32_t* m = mask + (bh / s.NH) * T;
  const uint64_t index0 = offset + s.dropout_row(bh, i);
  if constexpr (std::is_same_v<P, float>)
    rm::attention_softmax(probs + r * T, out, scores + r * T, m, T, p, key, index0, warp_lanes());
  else
    rm::attention_softmax_16(probs + r * T, out, scores + r * T, m, T, p, key, index0,
                             warp_lanes());
}

__global__ void attention_softmax_backward_kernel(float* ds, const float* dd, const float* probs,
                                                  kernels::AttentionShape s, float p, uint64_t key,
                                                  uint64_t offset, const uint64_t* at) {
  step_key(key, offset, at);
  const int64_t r = warp_row();
  if (r >= s.B * s.NH * s.T) return;
  const int64_t bh = r / s.T, i = r % s.T, T = s.T;
  rm::attention_softmax_backward(ds + r * T, dd + r * T, probs + r * T, T, p, key,
                                 offset + s.dropout_row(bh, i), warp_lanes());
}

// Row i of the cross-entropy on lanes l: row_sums[2i] = weight * loss, row_sums[2i + 1] =
// weight * hit; losses[i] and correct[i] where given.
template <class Lanes>
__device__ void cross_entropy_row(const Lanes& l, int64_t i, float* dlogits, float* row_sums,
                                  float* losses, int32_t* correct, const float* logits,
                                  const int32_t* targets, const float* weights, kernels::Classes c,
                                  kernels::Multiplier dscale) {
  const float w = weights ? weights[i] : 1.0f;
  const rm::CrossEntropyRow row =
      rm::cross_entropy(dlogits ? dlogits + i * c.stride : nullptr, logits + i * c.stride,
                        targets[i], w, c.V, c.stride, dscale.value(), l);
  if (l.lane == 0) {
    row_sums[2 * i] = w * row.loss;
    row_sums[2 * i + 1] = row.hit ? w : 0.0f;
    if (losses) losses[i] = row.loss;
    if (correct) correct[i] = row.hit;
  }
}

// A warp per row (narrow rows: next-sentence, classes, answer positions).
__global__ void cross_entropy_kernel(float* dlogits, float* row_sums, float* losses,
                                     int32_t* correct, const float* logits, const int32_t* targets,
                                     const float* weights, int64_t N, kernels::Classes c,
                                     kernels::Multiplier dscale) {
  const int64_t i = warp_row();
  if (i >= N) return;
  cross_entropy_row(warp_lanes(), i, dlogits, row_sums, losses, correct, logits, targets, weights,
                    c, dscale);
}

// A block per row, from kWideRow columns (the masked LM's vocabulary): a warp per row would
// leave most of a GPU idle at a few thousand rows; the gradient written in the same pass.
constexpr int64_t kWideRow = 1024;
constexpr unsigned kWideRowThreads = 256;
__global__ void cross_entropy_wide_kernel(float* dlogits, float* row_sums, float* losses,
                                          int32_t* correct, const float* logits,
                                          const int32_t* targets, const float* weights,
                                          kernels::Classes c, kernels::Multiplier dscale) {
  const BlockLanes<kWideRowThreads> l{static_cast<int>(threadIdx.x)};
  cross_entropy_row(l, blockIdx.x, dlogits, row_sums, losses, correct, logits, targets, weights, c,
                    dscale);
}

constexpr unsigned kThreads = 256;

// A block's sum of per-thread doubles into out[blockIdx.x] (kThreads threads).
__device__ void block_sum(double v, double* out) {
  __shared__ double part[kThreads];
  part[threadIdx.x] = v;
  __syncthreads();
  for (unsigned o = kThreads / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = part[0];
}

__global__ void sum_squares_kernel(double* partial, const float* g, int64_t n, double scale) {
  double acc = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x = static_cast<double>(g[i]) * scale;
    acc += x * x;
  }
  block_sum(acc, partial + blockIdx.x);
}

__global__ void adamw_kernel(kernels::AdamwStep a, float* p, uint16_t* p16, const float* g,
                             float* m, float* v, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) rm::adamw(a, p, p16, g, m, v, i);
}

// The multi-tensor passes (scratch.h): block b runs chunk b of span chunks[b].tensor, a
// thread its elements i, i + blockDim.x, ... of the chunk's [0, n) in that order, kIlp of them
// a turn: load(i, k) puts element i's values into the turn's slot k, for every slot before
// use(i, k) reads any (the turn's loads in flight together: with one element's at a time, a
// memory-bound pass leaves much of a GPU's memory bandwidth idle; NVIDIA's Apex multi-tensor
// kernels take 4 too). Each element's operations and each thread's order of them are the
// one-at-a-time loop's: the same bits. (A pass's arrays never overlap.)
constexpr int kIlp = 4;
template <class Load, class Use>
__device__ void chunk_turns(int64_t n, Load load, Use use) {
  const int64_t stride = blockDim.x;
  for (int64_t i0 = threadIdx.x; i0 < n; i0 += kIlp * stride) {
    for (int k = 0; k < kIlp; ++k)
      if (i0 + k * stride < n) load(i0 + k * stride, k);
    for (int k = 0; k < kIlp; ++k)
      if (i0 + k * stride < n) use(i0 + k * stride, k);
  }
}

__global__ void sum_squares_many_kernel(double* partial, const float* g,
                                        const kernels::TensorSpan* spans, const Chunk* chunks,
                                        double scale, const kernels::GradientGate* by = nullptr) {
  const Chunk c = chunks[blockIdx.x];
  const float* x = g + spans[c.tensor].offset + c.begin;
  // (a gate's: the gradients carry its loss scale, unscaled by it as next_gate does)
  if (by) scale = kernels::unscale_by(static_cast<float>(scale), by->scale);
  double acc = 0.0;
  float rx[kIlp];
  chunk_turns(
      c.n, [&](int64_t i, int k) { rx[k] = x[i]; },
      [&](int64_t, int k) {
        const double y = static_cast<double>(rx[k]) * scale;
        acc += y * y;
      });
  block_sum(acc, partial + blockIdx.x);
}

// A pass's steps (AdamW's or LAMB's): the optimizer's differ only in weight decay, so a step
// kind a span (Many::kind) and no table of steps a span. The kernels read them from the device
// (Many::steps), where each call sends them unless they are there already, so a CUDA graph that
// holds the update reads the step a launch was staged for (stage_update): the learning rate
// changes every step.
constexpr int kStepKinds = 8;
template <class StepArgs>
struct StepKinds {
  StepArgs kind[kStepKinds];
  int count = 0;
};
static_assert(sizeof(StepKinds<kernels::AdamwStep>) <= kStepArgsBytes &&
              sizeof(StepKinds<kernels::LambStep>) <= kStepArgsBytes);

// Span i's step, under the gate where there is one (types.h gated: its gscale and bias
// corrections).
template <class StepArgs>
__device__ StepArgs span_step(const StepKinds<StepArgs>* steps, const int32_t* kind, int64_t i,
                              const kernels::GradientGate* gate) {
  const StepArgs& a = steps->kind[kind[i]];
  return gate ? kernels::gated(a, *gate) : a;
}

// The next gate (types.h next_gate) from the chunks' partial sums, added in chunk order (the
// host's order: the same bits as add_sum_squares).
__global__ void gate_kernel(kernels::GradientGate* gate, const double* partial, int64_t count,
                            float unscale, float max_norm) {
  double sum = 0.0;
  for (int64_t b = 0; b < count; ++b) sum += partial[b];
  *gate = kernels::next_gate(*gate, sum, unscale, max_norm);
}

// A chunk's values, gradients and moments (from element c.begin of a span) and a turn's
// registers of them: Adam's moments and what reads them (AdamW, LAMB's first pass).
struct MomentTurn {
  const float *P, *G;
  float *M, *V;
  float p[kIlp], g[kIlp], m[kIlp], v[kIlp];
  __device__ MomentTurn(const float* p0, const float* g0, float* m0, float* v0,
                        const kernels::TensorSpan& t, const Chunk& c)
      : P(p0 + t.offset + c.begin),
        G(g0 + t.offset + c.begin),
        M(m0 + t.state + c.begin),
        V(v0 + t.state + c.begin) {}
  __device__ void load(int64_t i, int k) {
    g[k] = G[i];
    p[k] = P[i];
    m[k] = M[i];
    v[k] = V[i];
  }
  __device__ void store_moments(int64_t i, int k) {
    M[i] = m[k];
    V[i] = v[k];
  }
};

__global__ void adamw_many_kernel(const StepKinds<kernels::AdamwStep>* steps, const int32_t* kind,
                                  const kernels::GradientGate* gate, float* p, uint16_t* p16,
                                  const float* g, float* m, float* v,
                                  const kernels::TensorSpan* spans, const Chunk* chunks) {
  if (gate && !gate->apply) return;
  const Chunk c = chunks[blockIdx.x];
  const kernels::TensorSpan t = spans[c.tensor];
  const kernels::AdamwStep a = span_step(steps, kind, c.tensor, gate);
  float* P = p + t.offset + c.begin;
  uint16_t* P16 = p16 ? p16 + t.offset + c.begin : nullptr;
  MomentTurn r(p, g, m, v, t, c);
  chunk_turns(
      c.n, [&](int64_t i, int k) { r.load(i, k); },
      [&](int64_t i, int k) {
        rm::adamw_values(a, r.g[k], r.p[k], r.m[k], r.v[k]);
        r.store_moments(i, k);
        P[i] = r.p[k];
        if (P16) P16[i] = rm::weight_copy_16(a.f16_copy, r.p[k]);
      });
}

// partial[2 b] = sum of p^2 over chunk b, partial[2 b + 1] = sum of u^2.
__global__ void lamb_moments_many_kernel(double* partial, const StepKinds<kernels::LambStep>* steps,
                                         const int32_t* kind, const kernels::GradientGate* gate,
                                         const float* p, const float* g, float* m, float* v,
                                         const kernels::TensorSpan* spans, const Chunk* chunks) {
  if (gate && !gate->apply) return;
  const Chunk c = chunks[blockIdx.x];
  const kernels::TensorSpan t = spans[c.tensor];
  const kernels::LambStep a = span_step(steps, kind, c.tensor, gate);
  double pn = 0.0, un = 0.0;
  MomentTurn r(p, g, m, v, t, c);
  chunk_turns(
      c.n, [&](int64_t i, int k) { r.load(i, k); },
      [&](int64_t i, int k) {
        const float u = rm::lamb_moment_values(a, r.g[k], r.p[k], r.m[k], r.v[k]);
        r.store_moments(i, k);
        pn += static_cast<double>(r.p[k]) * r.p[k];
        un += static_cast<double>(u) * u;
      });
  block_sum(pn, partial + 2 * blockIdx.x);
  __syncthreads();
  block_sum(un, partial + 2 * blockIdx.x + 1);
}

// LAMB's step per span on the device: thread i adds span i's chunks' partial norms in chunk
// order (the order the host added them in: the same bits) and writes lr x trust ratio.
__global__ void lamb_trust_kernel(float* trust, const StepKinds<kernels::LambStep>* steps,
                                  const int32_t* kind, const double* partial, const int64_t* first,
                                  int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  double pn = 0.0, un = 0.0;
  for (int64_t b = first[i]; b < first[i + 1]; ++b) {
    pn += partial[2 * b];
    un += partial[2 * b + 1];
  }
  const kernels::LambStep& a = steps->kind[kind[i]];
  trust[i] = a.lr * kernels::lamb_trust(a, pn, un);
}

// (trust: each span's lr x trust ratio; the gate, where given, only says whether to move)
__global__ void lamb_apply_many_kernel(const StepKinds<kernels::LambStep>* steps,
                                       const int32_t* kind, const kernels::GradientGate* gate,
                                       const float* trust, float* p, uint16_t* p16, const float* m,
                                       const float* v, const kernels::TensorSpan* spans,
                                       const Chunk* chunks) {
  if (gate && !gate->apply) return;
  const Chunk c = chunks[blockIdx.x];
  const kernels::TensorSpan t = spans[c.tensor];
  const kernels::LambStep a = span_step(steps, kind, c.tensor, gate);
  const float step = trust[c.tensor];
  float* P = p + t.offset + c.begin;
  uint16_t* P16 = p16 ? p16 + t.offset + c.begin : nullptr;
  const float* M = m + t.state + c.begin;
  const float* V = v + t.state + c.begin;
  float rp[kIlp], rm_[kIlp], rv[kIlp];
  chunk_turns(
      c.n,
      [&](int64_t i, int k) {
        rp[k] = P[i];
        rm_[k] = M[i];
        rv[k] = V[i];
      },
      [&](int64_t i, int k) {
        rm::lamb_apply_value(a, rp[k], rm_[k], rv[k], step);
        P[i] = rp[k];
        if (P16) P16[i] = rm::weight_copy_16(a.f16_copy, rp[k]);
      });
}

// partial[block] = sum of p^2, partial[gridDim.x + block] = sum of u^2.
__global__ void lamb_moments_kernel(double* partial, kernels::LambStep a, const float* p,
                                    const float* g, float* m, float* v, int64_t n) {
  double pn = 0.0, un = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u = rm::lamb_moments(a, p, g, m, v, i);
    pn += static_cast<double>(p[i]) * p[i];
    un += static_cast<double>(u) * u;
  }
  block_sum(pn, partial + blockIdx.x);
  __syncthreads();
  block_sum(un, partial + gridDim.x + blockIdx.x);
}

__global__ void lamb_apply_kernel(kernels::LambStep a, float* p, uint16_t* p16, const float* m,
                                  const float* v, int64_t n, float step) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) rm::lamb_apply(a, p, p16, m, v, i, step);
}

unsigned reduce_blocks(int64_t n) {
  const auto b = blocks_for(n, kThreads);
  return b < kReduceBlocks ? (b > 0 ? b : 1) : static_cast<unsigned>(kReduceBlocks);
}

// The per-block partial sums of one reduction, added on the host in block order.
std::vector<double> download_partials(const double* partial, size_t count, cudaStream_t s) {
  std::vector<double> h(count);
  // (into pageable memory: returns when the stream has run through the copy)
  BT_CUDA_WAIT(
      cudaMemcpyAsync(h.data(), partial, count * sizeof(double), cudaMemcpyDeviceToHost, s));
  return h;
}

// A multi-tensor pass's arguments in the scratch (scratch.h, kMultiTensorSlot): the spans, their
// chunks, each span's first chunk (and the end) and step kind; then room for a trust ratio per
// span, two partials per chunk and the pass's steps (StepKinds).
struct Many {
  const kernels::TensorSpan* spans = nullptr;
  const Chunk* chunks = nullptr;
  const int64_t* first = nullptr;
  const int32_t* kind = nullptr;
  float* trust = nullptr;
  double* partials = nullptr;
  void* steps = nullptr;
  std::vector<Chunk> host_chunks;
};

size_t aligned(size_t b) {
  return (b + 255) / 256 * 256;
}

// Tables and a step's arguments cross from page-locked memory (a copy from pageable memory may
// make the host wait for the stream): kTurns buffers of the calling thread's in turn, each
// written again only once the copy from it has run (its event; a query finds it done unless
// the device is kTurns sends behind: a step sends two, the model's arguments and the optimizer's
// steps, and the host may run a few steps ahead of the device).
constexpr int kTurns = 16;
struct PinnedTables {
  struct Buffer {
    char* host = nullptr;
    size_t bytes = 0;
    cudaEvent_t copied = nullptr;
  } buffer[kTurns];
  int turn = 0;
  PinnedTables() = default;
  PinnedTables(const PinnedTables&) = delete;
  PinnedTables& operator=(const PinnedTables&) = delete;
  ~PinnedTables() {  // (the thread's end)
    for (Buffer& b : buffer) {
      if (b.host) {
        count_host_sync();
        cudaFreeHost(b.host);
      }
      if (b.copied) cudaEventDestroy(b.copied);
    }
  }
};
thread_local PinnedTables t_tables;

char* pinned_tables(size_t bytes) {
  PinnedTables::Buffer& b = t_tables.buffer[t_tables.turn];
  if (b.copied) {
    if (!done(cudaEventQuery(b.copied))) BT_CUDA_WAIT_AHEAD(cudaEventSynchronize(b.copied));
  } else {
    BT_CUDA_CHECK(cudaEventCreateWithFlags(&b.copied, cudaEventDisableTiming));
  }
  if (b.bytes < bytes) {
    if (b.host) {
      count_host_sync();
      cudaFreeHost(b.host);
    }
    void* p = nullptr;
    BT_CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(bytes, 4096), cudaHostAllocDefault));
    b.host = static_cast<char*>(p);
    b.bytes = std::max<size_t>(bytes, 4096);
  }
  return b.host;
}

}  // namespace

void send(void* device, const void* host, size_t bytes, void* stream) {
  if (bytes == 0) return;
  const cudaStream_t s = as_stream(stream);
  PinnedTables& t = t_tables;
  char* pinned = pinned_tables(bytes);
  std::memcpy(pinned, host, bytes);
  BT_CUDA_CHECK(cudaMemcpyAsync(device, pinned, bytes, cudaMemcpyHostToDevice, s));
  BT_CUDA_CHECK(cudaEventRecord(t.buffer[t.turn].copied, s));
  t.turn = (t.turn + 1) % kTurns;
}

namespace {

// The tables `host` copied to `device`.
void send_tables(char* device, const std::vector<char>& host, cudaStream_t s) {
  send(device, host.data(), host.size(), s);
}

// Each span's step kind (kind[i] into the returned kinds), as exact bits of every field a kernel
// reads (a gated step's bias corrections come from the learning rate: types.h gated): an
// optimizer's steps differ in weight decay only. (place_steps compares a step's with the last
// step's the same way.)
template <class StepArgs>
bool same_step(const StepArgs& a, const StepArgs& b);
template <>
bool same_step(const kernels::AdamwStep& a, const kernels::AdamwStep& b) {
  const float x[] = {a.gscale, a.beta1, a.beta2, a.step_size, a.sqrt_bc2, a.eps, a.decay, a.lr};
  const float y[] = {b.gscale, b.beta1, b.beta2, b.step_size, b.sqrt_bc2, b.eps, b.decay, b.lr};
  return std::memcmp(x, y, sizeof x) == 0 && a.f16_copy == b.f16_copy;
}
template <>
bool same_step(const kernels::LambStep& a, const kernels::LambStep& b) {
  const float x[] = {a.gscale, a.beta1, a.beta2, a.ibc1, a.ibc2, a.eps, a.wd, a.lr};
  const float y[] = {b.gscale, b.beta1, b.beta2, b.ibc1, b.ibc2, b.eps, b.wd, b.lr};
  return std::memcmp(x, y, sizeof x) == 0 && a.f16_copy == b.f16_copy;
}
template <class StepArgs>
StepKinds<StepArgs> step_kinds(const StepArgs* a, int64_t count, std::vector<int32_t>& kind) {
  StepKinds<StepArgs> k;
  kind.assign(static_cast<size_t>(count), 0);
  for (int64_t i = 0; a && i < count; ++i) {
    int j = 0;
    while (j < k.count && !same_step(k.kind[j], a[i])) ++j;
    if (j == k.count) {
      BT_CHECK(k.count < kStepKinds, "the CUDA optimizer passes take at most ", kStepKinds,
               " different steps over their tensors, ", count, " tensors had more");
      k.kind[k.count++] = a[i];
    }
    kind[static_cast<size_t>(i)] = j;
  }
  return k;
}

// What the calling thread last uploaded, and where: an optimizer's tables are the same every
// step, so they are built and cross once (while the spans, the kinds and the scratch stay, and
// no device memory is freed: memory_generation).
struct UploadedTables {
  std::vector<kernels::TensorSpan> spans;
  std::vector<int32_t> kind;  // empty: uploaded without kinds
  const char* to = nullptr;
  uint64_t generation = 0;
  Many w;
  std::vector<char> steps;  // the steps last sent to w.steps (their bytes; empty: none)
  int steps_type = 0;       // (theirs: 1 AdamW's, 2 LAMB's)
  bool holds(const kernels::TensorSpan* t, int64_t count, const std::vector<int32_t>* k,
             const char* base) const {
    return to == base && generation == memory_generation() &&
           spans.size() == static_cast<size_t>(count) &&
           std::memcmp(spans.data(), t, spans.size() * sizeof(kernels::TensorSpan)) == 0 &&
           (!k || kind == *k);
  }
};
thread_local UploadedTables t_uploaded;

// The pass's tables in the scratch; `kind` each span's step kind (step_kinds), null for a pass
// without steps (the kinds there, whichever they are, serve). The reference lasts until the
// thread's next upload.
const Many& upload(const kernels::TensorSpan* t, int64_t count, const std::vector<int32_t>* kind,
                   cudaStream_t s) {
  int64_t values = 0, chunks = 0;
  for (int64_t i = 0; i < count; ++i) {
    values += t[i].n;
    chunks += (t[i].n + kChunk - 1) / kChunk;
  }
  const size_t n = static_cast<size_t>(count), c = static_cast<size_t>(chunks);
  const size_t spans_b = aligned(n * sizeof(kernels::TensorSpan)),
               chunks_b = aligned(c * sizeof(Chunk)), first_b = aligned((n + 1) * sizeof(int64_t)),
               kind_b = aligned(n * 4), trust_b = aligned(n * 4),
               partial_b = aligned(2 * c * sizeof(double));
  const size_t table_b = spans_b + chunks_b + first_b + kind_b;
  auto* base = static_cast<char*>(scratch(
      kMultiTensorSlot, std::max<size_t>(table_b + trust_b + partial_b + kStepArgsBytes,
                                         static_cast<size_t>(multi_tensor_bytes(values, count)))));
  UploadedTables& u = t_uploaded;
  if (u.holds(t, count, kind, base)) return u.w;
  BT_CHECK(!capturing(),
           "the optimizer's tensor tables changed while a CUDA graph was captured: they cross to "
           "the device before the capture (stage_update)");
  Many& w = u.w;
  w.host_chunks.clear();
  std::vector<int64_t> first;
  for (int64_t i = 0; i < count; ++i) {
    first.push_back(static_cast<int64_t>(w.host_chunks.size()));
    for (int64_t b = 0; b < t[i].n; b += kChunk)
      w.host_chunks.push_back({i, b, std::min(kChunk, t[i].n - b)});
  }
  first.push_back(static_cast<int64_t>(w.host_chunks.size()));
  std::vector<char> host(table_b, 0);
  std::memcpy(host.data(), t, n * sizeof(kernels::TensorSpan));
  std::memcpy(host.data() + spans_b, w.host_chunks.data(), c * sizeof(Chunk));
  std::memcpy(host.data() + spans_b + chunks_b, first.data(), first.size() * sizeof(int64_t));
  if (kind) std::memcpy(host.data() + spans_b + chunks_b + first_b, kind->data(), n * 4);
  send_tables(base, host, s);
  u.spans.assign(t, t + count);
  u.kind = kind ? *kind : std::vector<int32_t>{};
  u.to = base;
  u.generation = memory_generation();
  w.spans = reinterpret_cast<const kernels::TensorSpan*>(base);
  w.chunks = reinterpret_cast<const Chunk*>(base + spans_b);
  w.first = reinterpret_cast<const int64_t*>(base + spans_b + chunks_b);
  w.kind = reinterpret_cast<const int32_t*>(base + spans_b + chunks_b + first_b);
  w.trust = reinterpret_cast<float*>(base + table_b);
  w.partials = reinterpret_cast<double*>(base + table_b + trust_b);
  w.steps = base + table_b + trust_b + partial_b;
  u.steps.clear();  // (what the steps' room holds: nothing sent there yet)
  return w;
}

template <class StepArgs>
constexpr int steps_type() {
  return std::is_same_v<StepArgs, kernels::AdamwStep> ? 1 : 2;
}

// The pass's steps where its kernels read them (Many::steps): sent unless the room holds them
// already (the same steps by same_step); inside a capture they must be there (a copy captured
// from the page-locked ring would read whatever the ring holds when the graph runs).
template <class StepArgs>
const StepKinds<StepArgs>* place_steps(const StepKinds<StepArgs>& k, const Many& w,
                                       cudaStream_t s) {
  UploadedTables& u = t_uploaded;
  bool there = u.steps_type == steps_type<StepArgs>() && u.steps.size() == sizeof k;
  if (there) {
    StepKinds<StepArgs> held;
    std::memcpy(static_cast<void*>(&held), u.steps.data(), sizeof held);
    there = held.count == k.count;
    for (int i = 0; there && i < k.count; ++i) there = same_step(held.kind[i], k.kind[i]);
  }
  if (!there) {
    BT_CHECK(!capturing(),
             "the optimizer's steps (its learning rate) changed while a CUDA graph was captured: "
             "they cross to the device before the capture (stage_update)");
    send(w.steps, &k, sizeof k, s);
    const auto* bytes = reinterpret_cast<const char*>(&k);
    u.steps.assign(bytes, bytes + sizeof k);
    u.steps_type = steps_type<StepArgs>();
  }
  return static_cast<const StepKinds<StepArgs>*>(w.steps);
}

// A pass's tables and steps on the device (what every pass with steps and stage_update do first):
// the tables and where the kernels read the steps.
template <class StepArgs>
struct Staged {
  const Many& w;
  const StepKinds<StepArgs>* steps;
};
template <class StepArgs>
Staged<StepArgs> stage_steps(const StepArgs* a, const kernels::TensorSpan* t, int64_t count,
                             cudaStream_t s) {
  std::vector<int32_t> kind;
  const StepKinds<StepArgs> k = step_kinds(a, count, kind);
  const Many& w = upload(t, count, &kind, s);
  return {w, place_steps(k, w, s)};
}

// The reductions' partial sums.
double* partials() {
  return static_cast<double*>(scratch(kReductionSlot, 2 * kReduceBlocks * sizeof(double)));
}

}  // namespace

void attention_softmax_forward(float* probs, float* dropped, const float* scores,
                               const int32_t* mask, const kernels::AttentionShape& s,
                               const kernels::Dropout& d, void* stream) {
  const int64_t rows = s.B * s.NH * s.T;
  if (rows == 0) return;
  BT_LAUNCH(attention_softmax_kernel, row_blocks(rows), kRowThreads, 0, as_stream(stream))
  (probs, dropped, scores, mask, s, d.p, d.key, d.offset, d.at);
  BT_CUDA_CHECK(cudaGetLastError());
}

void attention_softmax_forward_16(Precision p, uint16_t* probs16, uint16_t* dropped16,
                                  const float* scores, const int32_t* mask,
                                  const kernels::AttentionShape& s, const kernels::Dropout& d,
                                  void* stream) {
  const int64_t rows = s.B * s.NH * s.T;
  if (rows == 0) return;
  auto run = [&](auto* probs, auto* dropped) {
    BT_LAUNCH(attention_softmax_kernel, row_blocks(rows), kRowThreads, 0, as_stream(stream))
    (probs, dropped, scores, mask, s, d.p, d.key, d.offset, d.at);
  };
  BT_CHECK(p != Precision::FP32, "attention_softmax_forward_16: fp32 is not a 16-bit precision");
  if (p == Precision::FP16)
    run(reinterpret_cast<rm::F16Bits*>(probs16), reinterpret_cast<rm::F16Bits*>(dropped16));
  else
    run(reinterpret_cast<rm::Bf16Bits*>(probs16), reinterpret_cast<rm::Bf16Bits*>(dropped16));
  BT_CUDA_CHECK(cudaGetLastError());
}

void attention_softmax_backward(float* ds, const float* dd, const float* probs,
                                const kernels::AttentionShape& s, const kernels::Dropout& d,
                                void* stream) {
  const int64_t rows = s.B * s.NH * s.T;
  if (rows == 0) return;
  BT_LAUNCH(attention_softmax_backward_kernel, row_blocks(rows), kRowThreads, 0, as_stream(stream))
  (ds, dd, probs, s, d.p, d.key, d.offset, d.at);
  BT_CUDA_CHECK(cudaGetLastError());
}

namespace {

// The rows' cross-entropy; returns the scratch of their weighted losses and hits (2 per row).
float* cross_entropy_rows(float* dlogits, float* losses, int32_t* correct, const float* logits,
                          const int32_t* targets, const float* weights, int64_t N,
                          kernels::Classes c, kernels::Multiplier dscale, cudaStream_t s) {
  auto* row_sums = static_cast<float*>(scratch(kCrossEntropySlot, 2 * N * sizeof(float)));
  if (c.V >= kWideRow)
    BT_LAUNCH(cross_entropy_wide_kernel, static_cast<unsigned>(N), kWideRowThreads, 0, s)
  (dlogits, row_sums, losses, correct, logits, targets, weights, c, dscale);
  else BT_LAUNCH(cross_entropy_kernel, row_blocks(N), kRowThreads, 0, s)(
      dlogits, row_sums, losses, correct, logits, targets, weights, N, c, dscale);
  BT_CUDA_CHECK(cudaGetLastError());
  return row_sums;
}

// One block adds the rows' sums (each thread a stride of rows, then a fixed tree: the same
// bits every run) into `into`'s doubles.
__global__ void add_row_sums_kernel(const float* row_sums, int64_t N, kernels::SumsInto into) {
  double loss = 0.0, hits = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    loss += row_sums[2 * i];
    hits += row_sums[2 * i + 1];
  }
  __shared__ double total[2];
  block_sum(loss, total);
  __syncthreads();
  block_sum(hits, total + 1);
  __syncthreads();
  if (threadIdx.x != 0) return;
  const double l = total[0] / into.divisor();
  if (into.loss) *into.loss += l;
  if (into.hits) *into.hits += total[1];
  if (into.nonfinite && !isfinite(l)) *into.nonfinite += 1.0;
}

}  // namespace

void cross_entropy_into(const kernels::SumsInto& into, float* dlogits, float* losses,
                        int32_t* correct, const float* logits, const int32_t* targets,
                        const float* weights, int64_t N, kernels::Classes c,
                        kernels::Multiplier dscale, void* stream) {
  if (N == 0) return;
  const cudaStream_t s = as_stream(stream);
  const float* row_sums =
      cross_entropy_rows(dlogits, losses, correct, logits, targets, weights, N, c, dscale, s);
  BT_LAUNCH(add_row_sums_kernel, 1, kThreads, 0, s)(row_sums, N, into);
  BT_CUDA_CHECK(cudaGetLastError());
}

kernels::CrossEntropySums cross_entropy(float* dlogits, float* losses, int32_t* correct,
                                        const float* logits, const int32_t* targets,
                                        const float* weights, int64_t N, kernels::Classes c,
                                        kernels::Multiplier dscale, void* stream, bool want_sums) {
  kernels::CrossEntropySums sums;
  if (N == 0) return sums;
  const cudaStream_t s = as_stream(stream);
  const float* row_sums =
      cross_entropy_rows(dlogits, losses, correct, logits, targets, weights, N, c, dscale, s);
  if (!want_sums) return sums;
  std::vector<float> h(2 * N);
  // (into pageable memory: returns when the stream has run through the copy)
  BT_CUDA_WAIT(
      cudaMemcpyAsync(h.data(), row_sums, h.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
  for (int64_t i = 0; i < N; ++i) {
    sums.loss += h[2 * i];
    sums.correct += h[2 * i + 1];
  }
  return sums;
}

void add_sum_squares(double& sum, const float* g, int64_t n, double scale, void* stream) {
  if (n == 0) return;
  const cudaStream_t s = as_stream(stream);
  const unsigned blocks = reduce_blocks(n);
  double* part = partials();
  BT_LAUNCH(sum_squares_kernel, blocks, kThreads, 0, s)(part, g, n, scale);
  BT_CUDA_CHECK(cudaGetLastError());
  for (double x : download_partials(part, blocks, s)) sum += x;
}

void adamw_update(const kernels::AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m,
                  float* v, int64_t n, void* stream) {
  if (n == 0) return;
  BT_LAUNCH(adamw_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))
  (a, p, p16, g, m, v, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

void lamb_moments(const kernels::LambStep& a, const float* p, const float* g, float* m, float* v,
                  int64_t n, double& pn, double& un, void* stream) {
  if (n == 0) return;
  const cudaStream_t s = as_stream(stream);
  const unsigned blocks = reduce_blocks(n);
  double* part = partials();
  BT_LAUNCH(lamb_moments_kernel, blocks, kThreads, 0, s)(part, a, p, g, m, v, n);
  BT_CUDA_CHECK(cudaGetLastError());
  const std::vector<double> h = download_partials(part, 2 * blocks, s);
  for (unsigned b = 0; b < blocks; ++b) {
    pn += h[b];
    un += h[blocks + b];
  }
}

void lamb_apply(const kernels::LambStep& a, float* p, uint16_t* p16, const float* m, const float* v,
                int64_t n, float step, void* stream) {
  if (n == 0) return;
  BT_LAUNCH(lamb_apply_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))
  (a, p, p16, m, v, n, step);
  BT_CUDA_CHECK(cudaGetLastError());
}

void add_sum_squares(double& sum, const float* g, const kernels::TensorSpan* t, int64_t count,
                     double scale, void* stream) {
  if (count == 0) return;
  const cudaStream_t s = as_stream(stream);
  const Many& w = upload(t, count, nullptr, s);
  const auto blocks = static_cast<unsigned>(w.host_chunks.size());
  if (blocks == 0) return;
  BT_LAUNCH(sum_squares_many_kernel, blocks, kThreads, 0, s)
  (w.partials, g, w.spans, w.chunks, scale);
  BT_CUDA_CHECK(cudaGetLastError());
  for (double x : download_partials(w.partials, blocks, s)) sum += x;
}

void gate_gradients(kernels::GradientGate* gate, const float* g, const kernels::TensorSpan* t,
                    int64_t count, float unscale, float max_norm, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const Many& w = upload(t, count, nullptr, s);
  const auto blocks = static_cast<unsigned>(w.host_chunks.size());
  if (blocks > 0) BT_LAUNCH(sum_squares_many_kernel, blocks, kThreads, 0, s)
  (w.partials, g, w.spans, w.chunks, static_cast<double>(unscale), gate);
  BT_CUDA_CHECK(cudaGetLastError());
  BT_LAUNCH(gate_kernel, 1, 1, 0, s)(gate, w.partials, blocks, unscale, max_norm);
  BT_CUDA_CHECK(cudaGetLastError());
}

void adamw_update(const kernels::AdamwStep* a, float* p, uint16_t* p16, const float* g, float* m,
                  float* v, const kernels::TensorSpan* t, int64_t count,
                  const kernels::GradientGate* gate, void* stream) {
  if (count == 0) return;
  const cudaStream_t s = as_stream(stream);
  const auto [w, steps] = stage_steps(a, t, count, s);
  const auto blocks = static_cast<unsigned>(w.host_chunks.size());
  if (blocks == 0) return;
  BT_LAUNCH(adamw_many_kernel, blocks, kThreads, 0, s)
  (steps, w.kind, gate, p, p16, g, m, v, w.spans, w.chunks);
  BT_CUDA_CHECK(cudaGetLastError());
}

void lamb_update(const kernels::LambStep* a, float* p, uint16_t* p16, const float* g, float* m,
                 float* v, const kernels::TensorSpan* t, int64_t count, double* pn, double* un,
                 bool apply, const kernels::GradientGate* gate, void* stream) {
  if (count == 0) return;
  const cudaStream_t s = as_stream(stream);
  const auto [w, steps] = stage_steps(a, t, count, s);
  const auto blocks = static_cast<unsigned>(w.host_chunks.size());
  if (blocks == 0) return;
  BT_LAUNCH(lamb_moments_many_kernel, blocks, kThreads, 0, s)
  (w.partials, steps, w.kind, gate, p, g, m, v, w.spans, w.chunks);
  BT_CUDA_CHECK(cudaGetLastError());
  if (!apply) {  // the moments only: the norms to the host
    const std::vector<double> h = download_partials(w.partials, 2 * blocks, s);
    for (unsigned b = 0; b < blocks; ++b) {
      pn[w.host_chunks[b].tensor] += h[2 * b];
      un[w.host_chunks[b].tensor] += h[2 * b + 1];
    }
    return;
  }
  BT_LAUNCH(lamb_trust_kernel, blocks_for(count, kThreads), kThreads, 0, s)
  (w.trust, steps, w.kind, w.partials, w.first, count);
  BT_CUDA_CHECK(cudaGetLastError());
  BT_LAUNCH(lamb_apply_many_kernel, blocks, kThreads, 0, s)
  (steps, w.kind, gate, w.trust, p, p16, m, v, w.spans, w.chunks);
  BT_CUDA_CHECK(cudaGetLastError());
}

void stage_update(const kernels::AdamwStep* a, const kernels::TensorSpan* t, int64_t count,
                  void* stream) {
  if (count > 0) stage_steps(a, t, count, as_stream(stream));
}

void stage_update(const kernels::LambStep* a, const kernels::TensorSpan* t, int64_t count,
                  void* stream) {
  if (count > 0) stage_steps(a, t, count, as_stream(stream));
}

void lamb_apply(const kernels::LambStep* a, float* p, uint16_t* p16, const float* m, const float* v,
                const kernels::TensorSpan* t, int64_t count, const float* step, void* stream) {
  if (count == 0) return;
  const cudaStream_t s = as_stream(stream);
  const auto [w, steps] = stage_steps(a, t, count, s);
  const auto blocks = static_cast<unsigned>(w.host_chunks.size());
  if (blocks == 0) return;
  // (from pageable memory: the host may wait for the stream first)
  BT_CUDA_WAIT(cudaMemcpyAsync(w.trust, step, static_cast<size_t>(count) * sizeof(float),
                               cudaMemcpyHostToDevice, s));
  BT_LAUNCH(lamb_apply_many_kernel, blocks, kThreads, 0, s)
  (steps, w.kind, nullptr, w.trust, p, p16, m, v, w.spans, w.chunks);
  BT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace bertrain::cuda
