#include "kernels/cuda/scratch.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/attention_products.h"
#include "kernels/embedding_runs.h"

namespace bertrain::cuda {

kernels::ScratchLayout scratch_layout(const kernels::KernelShapes& k) {
  kernels::ScratchLayout l;  // one thread, no caller part: the kernels run on the GPU
  const kernels::AttentionShape& a = k.attention;
  const int64_t probs = a.B * a.NH * a.T * a.T * int64_t{sizeof(float)};
  const bool attention = a.B > 0 && !k.blocked_attention;
  const bool fused = a.B > 0 && k.blocked_attention && fused_attention_runs(k.precision, a);
  const int64_t el = k.precision == Precision::FP32 ? 4 : 2;
  auto part = [&](ScratchSlot s) -> int64_t& { return l.part[s]; };
  part(kReductionSlot) = 2 * kReduceBlocks * int64_t{sizeof(double)};
  part(kCrossEntropySlot) = 2 * k.loss_rows * int64_t{sizeof(float)};
  part(kSquaredErrorSlot) = k.loss_rows * int64_t{sizeof(double)};
  if (attention) {
    // (backend.cu's attention: FP32 scores are the kept probabilities themselves, its dropped
    // ones backward's buffer here; BF16's and FP16's dropped probabilities are their 16-bit
    // operand, a Workspace region of the model's.)
    part(kAttentionScoresSlot) = k.precision == Precision::FP32 ? 0 : probs;
    part(kAttentionDroppedSlot) = k.precision == Precision::FP32 ? probs : 0;
    part(kAttentionGradSlot) = probs;
  } else if (a.B > 0 && !fused) {  // (the fused kernels need no scratch: fused_attention.cu)
    // The blocked kernel's block buffers (attention_products.h): scores and dd in fp32, the two
    // operand buffers (the dropped probabilities, dS) in the products' elements.
    part(kAttentionScoresSlot) = block_values(a) * int64_t{sizeof(float)};
    part(kAttentionGradSlot) = block_values(a) * int64_t{sizeof(float)};
    part(kAttentionDroppedSlot) = 2 * block_operand_bytes(a, el);
  }
  if (a.B > 0 && !fused)  // (kPairTables tables kept, each for up to four products' arrays)
    part(kAttentionPointersSlot) =
        kPairTables * 3 * kMaxPairProducts * a.B * a.NH * int64_t{sizeof(void*)};
  part(kMatmulWorkspaceSlot) = k.num_linears > 0 ? static_cast<int64_t>(kMatmulWorkspaceBytes) : 0;
  part(kMultiTensorSlot) = multi_tensor_bytes(k.parameters, k.tensors);
  // (LayerNorm's: dgamma, dbeta and the bias gradient of the projection before it)
  int64_t columns = 3 * column_chunks(k.tokens) * k.layernorm_width;
  for (int64_t i = 0; i < k.num_linears; ++i)  // a bias gradient's
    columns = std::max(columns, column_chunks(k.linears[i].M) * k.linears[i].N);
  // (the fused attention's backward: QKV's bias gradient, a row of partial sums a tile of rows
  // of every sequence, a ticket a head's Q, K or V columns)
  if (fused)
    columns = std::max(columns, fused_attention_tiles(std::max(a.B, k.sequences), a.T) * 3 * a.C);
  part(kColumnSumsSlot) = columns * int64_t{sizeof(float)};
  int64_t widest = k.layernorm_width;
  for (int64_t i = 0; i < k.num_linears; ++i) widest = std::max(widest, k.linears[i].N);
  int64_t tickets = (widest + kColumnTile - 1) / kColumnTile;
  if (fused) tickets = std::max(tickets, 3 * a.NH);
  part(kColumnTicketsSlot) = tickets * int64_t{sizeof(unsigned)};
  part(kEmbeddingSlot) =
      kernels::max_partials(k.tokens) * k.layernorm_width * int64_t{sizeof(float)};
  return l;
}

int64_t multi_tensor_bytes(int64_t parameters, int64_t tensors) {
  if (tensors == 0) return 0;
  const int64_t chunks = parameters / kChunk + tensors;  // each span's last chunk may be short
  // (a step kind, a trust ratio and a first chunk a span; one more first chunk: where the
  // chunks end)
  return tensors * (int64_t{sizeof(kernels::TensorSpan)} + int64_t{sizeof(int32_t)} +
                    int64_t{sizeof(float)} + int64_t{sizeof(int64_t)}) +
         int64_t{sizeof(int64_t)} +
         chunks * (int64_t{sizeof(Chunk)} + 2 * int64_t{sizeof(double)}) + kStepArgsBytes +
         6 * 256;  // alignment
}

namespace {
int g_fused = -1;  // set_fused_attention's; -1: the environment's
}  // namespace

bool fused_attention_enabled() {
  if (g_fused >= 0) return g_fused != 0;
  static const bool env = [] {
    const char* v = std::getenv("BT_CUDA_FUSED_ATTENTION");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return env;
}

void set_fused_attention(bool on) {
  g_fused = on ? 1 : 0;
}

bool fused_attention_length(Precision p, int64_t T) {
  return fused_attention_enabled() && p != Precision::FP32 && T <= kFusedAttentionTokens;
}

bool full_attention_preferred(Precision p, int64_t T) {
  return p != Precision::FP32 && T <= kFusedAttentionTokens;
}

bool fused_attention_runs(Precision p, const kernels::AttentionShape& s) {
  const int64_t head = s.NH > 0 ? s.C / s.NH : 0;
  return fused_attention_length(p, s.T) &&
         (head == 16 || head == 32 || head == 64 || head == 128) && head * s.NH == s.C;
}

namespace {
class CudaTarget final : public kernels::Target {
 public:
  const char* name() const override { return "cuda"; }
  bool host_memory() const override { return false; }
  bool fp16_operands() const override { return true; }
  bool prefers_full_attention(Precision p, int64_t seq_len) const override {
    return full_attention_preferred(p, seq_len);
  }
  bool fused_attention(Precision p, const kernels::AttentionShape& s) const override {
    return fused_attention_runs(p, s);
  }
  bool writes_16bit_outputs() const override { return true; }
  kernels::ScratchLayout scratch_layout(const kernels::KernelShapes& s) const override {
    return cuda::scratch_layout(s);
  }
};
}  // namespace

const kernels::Target& target() {
  static const CudaTarget t;
  return t;
}

}  // namespace bertrain::cuda
