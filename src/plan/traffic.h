// The traffic model of a training step on a GPU (issue 44): for each kernel the CUDA backend
// launches, the device memory it reads and writes and the products' floating-point operations,
// derived from the model's dimensions as the kernels use them (kernels/cuda/), and from them a
// predicted step time on a roofline. `bertrain estimate --device cuda --explain` prints it. On
// the emulated device (cuda_emu/) the bytes are checked against the pages each kernel touches
// (tests/cuda/test_cuda_counts.cpp, CudaCounts.TheBytesEachKernelTouchesAreTheModels).
//
// The bytes are the compulsory traffic: every array a launch reads counted once, every array it
// writes once (an in-place update in both), as a GPU moves them when its caches keep what a
// kernel reads again (the fused attention's K and V tiles, a product's operand tiles); an
// operand read as a strided slice (Q, K or V out of the QKV rows) counts its slice's bytes.
// Memsets (zeroing the gradients and dh) are rows of their own, not kernels. A step after the
// first: the full attention's pointer tables (cuda.h, pair_pointers) are made once and kept, but
// where forward and backward run as CUDA graphs (BertModel::set_graphs), which make them in
// each launch.
#pragma once

#include <string>
#include <vector>

#include "model/bert.h"

namespace bertrain::plan {

struct KernelTraffic {
  std::string kernel;  // as the emulator and CUDA_EMU_TRACE name it (cublasLtMatmul: a product)
  std::string part;    // "layer", "embeddings", "heads", "update", "memset"
  int64_t launches = 0;
  double read = 0, written = 0;  // bytes
  double flops = 0;  // the products' 2 M N K: cuBLAS's, the fused attention's tensor cores'
  // The arrays' whole extents, each array counted once a launch (a strided slice: its whole
  // array): what a page-granular count of the touched memory sees (the emulator's), and how
  // many arrays a launch names (each may start or end inside a page).
  double read_extent = 0, written_extent = 0;
  // At least what a page-granular count sees: each array's largest use a launch (a slice's
  // bytes, a gather's rows), beside the extents (at most).
  double read_floor = 0, written_floor = 0;
  int64_t arrays = 0;
};

struct StepTraffic {
  int64_t layers = 0;
  std::vector<KernelTraffic> layer;  // one encoder layer, forward and backward, by kernel
  std::vector<KernelTraffic> rest;   // embeddings, heads, update, memsets, by kernel and part
  // Over the whole step (layer x layers + rest).
  int64_t launches() const;
  double bytes() const;
  double flops() const;
  // The bytes of the kernels without products (memsets included; the fused attention, whose
  // products the tensor cores do, is one of those with).
  double non_gemm_bytes() const;
};

// Where the model applies: a pretraining step (the head `bench` and issue 44 measure) on a GPU
// backend's dims (model::on_backend's), padded, the attention full or fused, no recomputation.
// Empty when it applies, else what is not modelled (for a message).
std::string traffic_not_modelled(model::Head head, const model::ModelDims& d);

// The step's traffic; dims as model::on_backend made them for the GPU (Target cuda), `lamb`
// LAMB's update passes, else AdamW's; `graphs`: forward and backward run as CUDA graphs. Fails
// where traffic_not_modelled says why.
StepTraffic cuda_step_traffic(const model::BertConfig& cfg, model::Head head,
                              const model::ModelDims& d, bool lamb, bool graphs = false);

// A roofline: a kernel takes max(flops / tflops, bytes / bandwidth), and a step the sum (the
// fused attention's products at the same rate as cuBLASLt's: a lower bound on its time).
struct Roofline {
  double flops_per_s = 0, bytes_per_s = 0;
  std::string source;  // where the two numbers come from
};
// An H200's: bf16/fp16 products at the 530 TFLOP/s cuBLASLt reached at BERT-Large's shapes on
// one (docs/gpus.md, 2026-12-04), fp32's (CUBLAS_COMPUTE_32F, no TF32) at the 67 TFLOP/s of
// its datasheet; memory at the datasheet's 4.8 TB/s.
Roofline h200_roofline(Precision p);
double predicted_seconds(const KernelTraffic& k, const Roofline& r);

// The table `estimate --device cuda --explain` prints: each kernel's launches, bytes, flops and
// predicted time (a layer's, then the rest), the step's totals and predicted time.
std::string explain_traffic(const StepTraffic& t, const Roofline& r, Precision p);

}  // namespace bertrain::plan
