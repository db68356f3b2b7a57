// The CUDA backend as a memory plan sees it (kernels/backend.h, Target): memory of its own, and
// the kernel scratch its kernels take from the model's plan
// (cuBLASLt's workspace, attention's score buffers, the reductions' partial sums) instead of
// allocating on the way. Plain C++, compiled in every build: `bertrain estimate --device cuda`
// plans a GPU run where there is no GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/backend.h"

namespace bertrain::cuda {

// The parts of the CUDA kernels' scratch (ScratchLayout::part, one thread): the bound region's
// part when it is large enough, else a buffer of the calling thread's own (cuda.h, scratch).
enum ScratchSlot : int {
  kReductionSlot,          // partial sums of a reduction: 2 x kReduceBlocks doubles
  kCrossEntropySlot,       // each row's loss and hit: 2 floats a row
  kAttentionScoresSlot,    // [B, NH, T, T] fp32 scores (16-bit precisions); blocked: a block's
  kAttentionDroppedSlot,   // [B, NH, T, T] fp32 dropped probabilities (FP32 backward); blocked:
                           // a block's two operand buffers (dropped probabilities, dS)
  kAttentionGradSlot,      // [B, NH, T, T] fp32 probability gradients; blocked: a block's
  kSquaredErrorSlot,       // a regression's squared errors: a double a row (the CPU's sum)
  kMatmulWorkspaceSlot,    // cuBLASLt's workspace
  kMultiTensorSlot,        // the optimizer's tensors, chunks, steps and partial sums
  kColumnSumsSlot,         // column sums per chunk of rows (bias and LayerNorm gradients)
  kEmbeddingSlot,          // embedding backward's partial rows (kernels::max_partials)
  kAttentionPointersSlot,  // attention's products: 3 pointers a (sequence, head) pair and
                           // product (4 products at once: kMaxPairProducts)
  kColumnTicketsSlot,      // the one-launch column sums' tickets (column_tickets.cuh): one a
                           // tile of 256 columns, zero between launches
  kScratchSlots
};
static_assert(kScratchSlots <= kernels::ScratchLayout::kParts);

constexpr int64_t kReduceBlocks = 1024;
constexpr size_t kMatmulWorkspaceBytes = size_t{32} << 20;

// Sums down the columns of [rows, columns] (a linear layer's bias gradient, LayerNorm's
// parameter gradients): rows in chunks of at least kColumnRows, at most kColumnChunks chunks, a
// block of kColumnTile columns per chunk writing its partial sums (LayerNorm: 2 floats a column);
// the last block of each column tile to finish adds the chunks in order (deterministic, one
// launch: column_tickets.cuh). A column per thread over all the rows would leave most of a GPU
// idle: a few thousand threads, each walking thousands of rows. (kernels/types.h: the numbers.)
using kernels::column_chunks;
using kernels::kColumnChunks;
using kernels::kColumnRows;
using kernels::kColumnTile;

// The optimizer's passes over many tensors (Backend's TensorSpan operations): each span cut into
// chunks of at most kChunk values, a block per chunk, one partial sum (two for LAMB's norms) per
// chunk added in chunk order (on the host, or by the gate's and trust ratios' kernels).
constexpr int64_t kChunk = int64_t{1} << 16;
struct Chunk {
  int64_t tensor, begin, n;  // values [begin, begin + n) of span `tensor`
};
// Bytes of the multi-tensor scratch for `tensors` spans over `parameters` values: the spans, the
// chunks, a step kind, a first chunk and a trust ratio per span, two partial sums per chunk, and
// the pass's steps themselves (rows.cu StepKinds: at most kStepArgsBytes).
constexpr int64_t kStepArgsBytes = 512;
int64_t multi_tensor_bytes(int64_t parameters, int64_t tensors);

// The scratch the CUDA kernels use for a model's shapes.
kernels::ScratchLayout scratch_layout(const kernels::KernelShapes& shapes);

// The CUDA backend's target (cuda_backend() is one too, where the build has it).
const kernels::Target& target();

// Where the fused attention (fused_attention.cu) runs: BF16 and FP16, head sizes 16, 32, 64 and
// 128, at most kFusedAttentionTokens tokens; and not with BT_CUDA_FUSED_ATTENTION=0 in the
// environment (the blocked kernel's products then, the reference), which set_fused_attention
// overrides (tests). fused_attention_length: at this precision and length for a head size it
// takes.
constexpr int64_t kFusedAttentionTokens = 512;
bool fused_attention_enabled();
void set_fused_attention(bool on);
bool fused_attention_length(Precision p, int64_t T);
bool fused_attention_runs(Precision p, const kernels::AttentionShape& s);
// What --attention auto runs on the GPU (Target::prefers_full_attention): the full kernel in
// BF16 and FP16 up to kFusedAttentionTokens tokens. Its batched products are cuBLAS's; the
// fused kernel (a warp a block, operands staged element by element) took 63% of a BERT-Large
// step at 128 tokens on an H200, and a step at 512 ran 3.6x faster on the full kernel
// (docs/gpus.md). FP32, and longer sequences, keep the CPU's rule (blocked from 512 tokens).
bool full_attention_preferred(Precision p, int64_t T);
// The fused backward's tiles of 16 rows over `sequences` sequences of at most T tokens: its rows
// of partial sums of QKV's bias gradient (kernels/types.h).
using kernels::fused_attention_tiles;

}  // namespace bertrain::cuda
