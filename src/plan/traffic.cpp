#include "plan/traffic.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "core/error.h"
#include "kernels/types.h"
#include "model/params.h"

namespace bertrain::plan {

namespace {

// An array a launch reads or writes: its bytes, and the extent of the array it lies in (a
// strided slice's whole array; the same name twice in a launch is one extent). `after_write`:
// read back after the launch wrote it (a reduction's partial sums): traffic, but no page a
// first touch would find unwritten.
struct Use {
  std::string array;
  double bytes = 0, extent = 0;
  bool after_write = false;
};
Use whole(std::string array, double bytes) {
  return {std::move(array), bytes, bytes};
}
Use slice(std::string array, double bytes, double extent) {
  return {std::move(array), bytes, extent};
}
Use read_back(std::string array, double bytes) {
  return {std::move(array), bytes, bytes, true};
}
// `rows` rows of `row` bytes gathered from (or scattered into) an array of `total` bytes: at
// most a page of it a row.
constexpr double kPage = 4096;
Use rows_of(std::string array, double rows, double row, double total) {
  return {std::move(array), rows * row, std::min(total, rows * std::ceil(row / kPage) * kPage)};
}

// The kernels of the step's parts, a row a kernel and part, in the order they first run.
class Kernels {
 public:
  explicit Kernels(std::string part) : part_(std::move(part)) {}
  void run(const std::string& kernel, const std::vector<Use>& reads, const std::vector<Use>& writes,
           double flops = 0) {
    auto it = std::find_if(rows_.begin(), rows_.end(), [&](const KernelTraffic& k) {
      return k.kernel == kernel && k.part == part_;
    });
    if (it == rows_.end()) {
      rows_.push_back(KernelTraffic{kernel, part_});
      it = rows_.end() - 1;
    }
    KernelTraffic& k = *it;
    ++k.launches;
    k.flops += flops;
    // (each array's largest use and largest extent, once a launch)
    std::map<std::string, std::pair<double, double>> read_pages, write_pages;
    std::set<std::string> named;
    const auto note = [](std::pair<double, double>& at, const Use& u) {
      at = {std::max(at.first, u.bytes), std::max(at.second, u.extent)};
    };
    for (const Use& u : reads) {
      k.read += u.bytes;
      if (!u.after_write) note(read_pages[u.array], u);
      named.insert(u.array);
    }
    for (const Use& u : writes) {
      k.written += u.bytes;
      note(write_pages[u.array], u);
      named.insert(u.array);
    }
    for (const auto& [a, e] : read_pages) {
      k.read_floor += e.first;
      k.read_extent += e.second;
    }
    for (const auto& [a, e] : write_pages) {
      k.written_floor += e.first;
      k.written_extent += e.second;
    }
    k.arrays += static_cast<int64_t>(named.size());
  }
  void set_part(std::string part) { part_ = std::move(part); }
  std::vector<KernelTraffic> take() { return std::move(rows_); }

 private:
  std::string part_;
  std::vector<KernelTraffic> rows_;
};

constexpr double kF = 4;  // an fp32 value's bytes

// The step's dimensions as the kernels see them.
struct Dims {
  bool half, fp16, fused, qkv16_output, inter16_output, proj16_output;
  bool graphs = false;  // forward and backward as CUDA graphs: the pointer tables made each step
  double h;             // the products' operand bytes: 2 in bf16 and fp16, 4 in fp32
  double R, T, N, C, I, NH, S, head, BP, Vr, P;
  double dropout_attn;
  int64_t layers;
  // The 16-bit rounding kernels' names: keep (QKV, ctx) and round_to_16.
  std::string keep_kernel, round_kernel, dropped_kernel;
};

Dims dims_of(const model::BertConfig& cfg, model::Head head, const model::ModelDims& d) {
  Dims g;
  g.half = d.precision != Precision::FP32;
  g.fp16 = d.precision == Precision::FP16;
  g.fused = d.fused_attention;
  g.qkv16_output = d.qkv16_output;
  g.inter16_output = d.inter16_output;
  g.proj16_output = d.proj16_output;
  g.h = g.half ? 2 : 4;
  g.R = static_cast<double>(d.token_rows());
  g.T = static_cast<double>(d.seq_len);
  g.N = g.R * g.T;
  g.C = static_cast<double>(cfg.hidden_size);
  g.I = static_cast<double>(cfg.intermediate_size);
  g.NH = static_cast<double>(cfg.num_attention_heads);
  g.S = g.R * g.NH * g.T * g.T;
  g.head = g.C / g.NH;
  g.BP = g.R * static_cast<double>(d.max_predictions);
  g.Vr = static_cast<double>(model::vocab_rows(cfg));
  double params = 0;
  const model::ParamTable table(cfg, head);
  for (const model::ParamInfo& pi : table.params()) params += static_cast<double>(pi.numel());
  g.P = params;
  g.dropout_attn = cfg.attention_probs_dropout_prob;
  g.layers = cfg.num_hidden_layers;
  g.keep_kernel = g.fp16 ? "keep_f16_kernel" : "round_bf16_kernel";
  g.round_kernel = g.fp16 ? "round_f16_kernel" : "round_bf16_kernel";
  g.dropped_kernel = !g.half  ? "attention_dropped_kernel<float>"
                     : g.fp16 ? "attention_dropped_kernel<rm::F16Bits>"
                              : "attention_dropped_kernel<rm::Bf16Bits>";
  return g;
}

// A column-sum pass's partial sums and tickets (matmul.cu's column_sums_of, layernorm.cu's
// backward): `sums` rows of chunks x `columns` written, then read back by each tile's last
// block, which adds them onto the gradients (read and written).
void column_pass(std::vector<Use>& reads, std::vector<Use>& writes, double rows, double columns,
                 int sums, const std::vector<std::string>& gradients) {
  const double chunks = static_cast<double>(kernels::column_chunks(static_cast<int64_t>(rows)));
  const double tiles = std::ceil(columns / static_cast<double>(kernels::kColumnTile));
  writes.push_back(whole("partial", sums * chunks * columns * kF));
  reads.push_back(read_back("partial", sums * chunks * columns * kF));
  for (const std::string& g : gradients) {
    reads.push_back(whole(g, columns * kF));
    writes.push_back(whole(g, columns * kF));
  }
  reads.push_back(whole("tickets", tiles * 4));
  writes.push_back(whole("tickets", tiles * 4));
}

// A LayerNorm's backward without dropout or a 16-bit copy (the heads', the embeddings'): the rows
// (dinp from dout, the input and its statistics), then the parameter gradients' column sums.
void layernorm_backward(Kernels& k, double rows, double C, const std::string& dout,
                        const std::string& in, const std::string& dinp) {
  std::vector<Use> reads = {whole(dout, rows * C * kF), whole(in, rows * C * kF),
                            whole("gamma", C * kF), whole("mean", 2 * rows * kF)},
                   writes = {whole(dinp, rows * C * kF)};
  column_pass(reads, writes, rows, C, 2, {"dgamma", "dbeta"});
  k.run("layernorm_backward_kernel", reads, writes);
}

// A product on cuBLASLt, [M, K] x [K, Nn] (the weight's 16-bit copy or fp32 values), its output
// (fp32, or out_bytes 2: the operands' 16-bit type) written, or added to (beta 1: read too).
void product(Kernels& k, const Dims& g, double M, double Nn, double K, const std::string& a,
             const std::string& b, const std::string& out, bool accumulate, bool bias = false,
             double out_bytes = kF) {
  std::vector<Use> reads = {whole(a, M * K * g.h), whole(b, K * Nn * g.h)};
  if (bias) reads.push_back(whole("bias", Nn * out_bytes));  // (a 16-bit output's: 16-bit)
  if (accumulate) reads.push_back(whole(out, M * Nn * out_bytes));
  k.run("cublasLtMatmul", reads, {whole(out, M * Nn * out_bytes)}, 2 * M * Nn * K);
}

// A linear layer's forward (y = x W + b) on an fp32 input of the heads: rounded first where the
// products read 16 bits (into the operand scratch).
void head_linear_forward(Kernels& k, const Dims& g, double M, double Nn, double K) {
  if (g.half) k.run(g.round_kernel, {whole("x", M * K * kF)}, {whole("x16", M * K * g.h)});
  product(k, g, M, Nn, K, "x16", "W", "y", false, true);
}

// Its backward with the bias gradient: the rounding pass of dout sums it (column_sums), the
// input rounded again, then dinp and dW; fp32 sums dout's columns after the products.
void head_linear_backward(Kernels& k, const Dims& g, double M, double Nn, double K, bool dinp) {
  std::vector<Use> reads = {whole("dout", M * Nn * kF)}, writes;
  if (g.half) writes.push_back(whole("dout16", M * Nn * g.h));
  column_pass(reads, writes, M, Nn, 1, {"db"});
  const auto sums = [&] { k.run("column_sums_kernel<Value>", reads, writes); };
  if (g.half) {
    sums();
    k.run(g.round_kernel, {whole("x", M * K * kF)}, {whole("x16", M * K * g.h)});
  }
  if (dinp) product(k, g, M, K, Nn, "dout16", "W", "dinp", false);
  product(k, g, K, Nn, M, "x16", "dout16", "dW", true);
  if (!g.half) sums();
}

// The fused attention's products (kernels/types.h: as its warps run them).
double fused_attention_flops(const Dims& g, bool forward) {
  const auto n = [](double x) { return static_cast<int64_t>(x); };
  return kernels::fused_attention_flops(n(g.R), n(g.NH), n(g.T), n(g.head), forward);
}

// One encoder layer, forward and backward (bert.cpp's layer_forward, layer_backward), its input
// kept in 16 bits where the products read them (every layer's but the first: `first` adds the
// input's rounding, forward and backward).
void encoder_layer(Kernels& k, const Dims& g, bool first) {
  const double N = g.N, C = g.C, I = g.I, S = g.S, h = g.h, mask = g.R * g.T * 4;
  const double lse = g.R * g.NH * g.T * kF, pointers = 3 * g.R * g.NH * 8;
  const std::string qkvh = g.half ? "qkv16" : "qkv", ctxh = g.half ? "ctx16" : "ctx";
  // ---- forward
  if (first && g.half) k.run(g.round_kernel, {whole("x", N * C * kF)}, {whole("x16", N * C * h)});
  if (g.qkv16_output)  // (its 16-bit copy alone: ModelDims::qkv16_output)
    product(k, g, N, 3 * C, C, "x16", "W_qkv", "qkv16", false, true, h);
  else
    product(k, g, N, 3 * C, C, "x16", "W_qkv", "qkv", false, true);
  if (g.fused && g.qkv16_output) {  // (QKV's 16-bit copy, as its product wrote it; ctx's alone)
    k.run("attention_forward_fused", {whole("qkv16", N * 3 * C * h), whole("mask", mask)},
          {whole("ctx16", N * C * h), whole("lse", lse)}, fused_attention_flops(g, true));
  } else if (g.fused) {  // (QKV's fp32 values, its copy written as they are staged)
    k.run("attention_forward_fused", {whole("qkv", N * 3 * C * kF), whole("mask", mask)},
          {whole("qkv16", N * 3 * C * h), whole("ctx", N * C * kF), whole("ctx16", N * C * h),
           whole("lse", lse)},
          fused_attention_flops(g, true));
  } else {
    // QKV rounded (fp16: the fp32 values become the rounded ones too), unless its product wrote
    // the 16-bit copy
    if (g.fp16 && !g.qkv16_output)
      k.run(g.keep_kernel, {whole("qkv", N * 3 * C * kF)},
            {whole("qkv16", N * 3 * C * h), whole("qkv", N * 3 * C * kF)});
    else if (g.half && !g.qkv16_output)
      k.run(g.keep_kernel, {whole("qkv", N * 3 * C * kF)}, {whole("qkv16", N * 3 * C * h)});
    // (the batched products' pointer tables, forward's two: made in the first step and kept, or
    // in each launch of a graph: pair_pointers)
    if (g.graphs) k.run("pair_pointers_kernel", {}, {whole("pointers", 2 * pointers)});
    k.run("cublasGemmBatchedEx",
          {slice(qkvh, N * C * h, N * 3 * C * h), slice(qkvh, N * C * h, N * 3 * C * h),
           whole("pointers", pointers)},
          {whole("scores", S * kF)}, 2 * S * g.head);
    const bool dropped = g.half || g.dropout_attn > 0;
    std::vector<Use> writes = {whole("probs", S * h)};
    if (dropped) writes.push_back(whole("dropped", S * h));
    k.run("attention_softmax_kernel", {whole("scores", S * kF), whole("mask", mask)}, writes);
    // (16-bit operands: the context's 16-bit copy written by the product itself)
    k.run("cublasGemmBatchedEx",
          {whole(dropped ? "dropped" : "probs", S * h), slice(qkvh, N * C * h, N * 3 * C * h),
           whole("pointers", pointers)},
          {whole(ctxh, N * C * (g.half ? h : kF))}, 2 * S * g.head);
  }
  // A projection's output y and its residual LayerNorm: x = dropout(y) + residual, y written in
  // fp32 into x's memory (read, then written), or its 16-bit copy alone into the buffer the
  // layers share (ModelDims::proj16_output: read, x written).
  const auto project = [&](double K, const std::string& in, const std::string& w,
                           const std::string& x, const std::string& residual,
                           const std::string& out) {
    const std::string y = g.proj16_output ? "proj16" : x;
    product(k, g, N, C, K, in, w, y, false, true, g.proj16_output ? h : kF);
    std::vector<Use> writes = {whole(x, N * C * kF), whole(out, N * C * kF), whole("mean", N * kF),
                               whole("rstd", N * kF)};
    if (g.half) writes.push_back(whole(out + "16", N * C * h));
    k.run("layernorm_forward_kernel",
          {whole(y, N * C * (g.proj16_output ? h : kF)), whole(residual, N * C * kF),
           whole("gamma", C * kF), whole("beta", C * kF)},
          writes);
  };
  project(C, ctxh, "W_o", "attn_res", "x", "ln1");
  if (g.inter16_output) {  // (GELU's input's 16-bit copy alone: ModelDims::inter16_output)
    product(k, g, N, I, C, "ln116", "W_i", "pre16", false, true, h);
    k.run("activation_forward_16_kernel", {whole("pre16", N * I * h)}, {whole("act16", N * I * h)});
  } else if (g.half) {
    product(k, g, N, I, C, "ln116", "W_i", "pre", false, true);
    k.run("activation_forward_16_kernel", {whole("pre", N * I * kF)},
          {whole("pre16", N * I * h), whole("act16", N * I * h)});
  } else {
    product(k, g, N, I, C, "ln1", "W_i", "pre", false, true);
    k.run("activation_forward_kernel", {whole("pre", N * I * kF)}, {whole("act", N * I * kF)});
  }
  project(I, g.half ? "act16" : "act", "W_o2", "ffn_res", "ln1", "ln2");
  // ---- backward
  const std::string dBh = g.half ? "dB16" : "dB", dIh = g.half ? "dI16" : "dI";
  const auto layernorm_backward = [&](const std::string& dout, const std::string& in,
                                      const std::string& dinp) {
    // (one launch: the rows, then the parameter gradients and the projection's bias gradient
    // over the rows each block has just read and written; each array counted once. The output
    // gradient dB: its 16-bit copy alone in 16 bits, as dGELU's)
    std::vector<Use> writes = {whole(dinp, N * C * kF),
                               g.half ? whole("dB16", N * C * h) : whole("dB", N * C * kF)};
    std::vector<Use> reads = {whole(dout, N * C * kF), whole(in, N * C * kF),
                              whole("gamma", C * kF), whole("mean", N * kF), whole("rstd", N * kF)};
    column_pass(reads, writes, N, C, 3, {"dgamma", "dbeta", "dbias"});
    k.run("layernorm_backward_kernel", reads, writes);
  };
  layernorm_backward("dh", "ffn_res", "dA");
  // (GELU's output gradient: its 16-bit copy alone where its input's is: inter16_output)
  if (g.inter16_output)
    product(k, g, N, I, C, dBh, "W_o2", "dact16", false, false, h);
  else
    product(k, g, N, I, C, dBh, "W_o2", "dI", false);
  product(k, g, I, C, N, g.half ? "act16" : "act", dBh, "dW_o2", true);
  {  // dGELU with the intermediate bias gradient: dI's 16-bit copy alone in 16 bits (nothing
     // reads its fp32 values there), dI in fp32
    std::vector<Use> reads = {
        whole(g.half ? "pre16" : "pre", N * I * (g.half ? h : kF)),
        g.inter16_output ? whole("dact16", N * I * h) : whole("dI", N * I * kF)};
    std::vector<Use> writes = {g.half ? whole("dI16", N * I * h) : whole("dI", N * I * kF)};
    column_pass(reads, writes, N, I, 1, {"db_i"});
    k.run("column_sums_kernel<Value>", reads, writes);
  }
  product(k, g, N, C, I, dIh, "W_i", "dA", true);
  product(k, g, C, I, N, g.half ? "ln116" : "ln1", dIh, "dW_i", true);
  layernorm_backward("dA", "attn_res", "dh");
  if (g.qkv16_output)  // (dctx's 16-bit copy alone, what the attention's products read)
    product(k, g, N, C, C, dBh, "W_o", "dctx16", false, false, h);
  else
    product(k, g, N, C, C, dBh, "W_o", "dA", false);
  product(k, g, C, C, N, ctxh, dBh, "dW_o", true);
  const std::string dqkvh = g.half ? "dqkv16" : "dqkv";
  if (g.fused) {
    std::vector<Use> reads = {g.qkv16_output ? whole("dctx16", N * C * h) : whole("dA", N * C * kF),
                              whole("qkv16", N * 3 * C * h), whole("ctx16", N * C * h),
                              whole("lse", lse), whole("mask", mask)};
    // (dQKV's 16-bit copy alone: the fused kernel runs in 16 bits, where the products read that)
    std::vector<Use> writes = {whole("dqkv16", N * 3 * C * h)};
    // (the bias gradient's partial sums: a row a tile of 64 rows of each sequence)
    const double tiles = static_cast<double>(
        kernels::fused_attention_tiles(static_cast<int64_t>(g.R), static_cast<int64_t>(g.T)));
    writes.push_back(whole("partial", tiles * 3 * C * kF));
    reads.push_back(read_back("partial", tiles * 3 * C * kF));
    for (auto* uses : {&reads, &writes}) {
      uses->push_back(whole("db_qkv", 3 * C * kF));
      uses->push_back(whole("tickets", 3 * g.NH * 4));
    }
    k.run("attention_backward_fused", reads, writes, fused_attention_flops(g, false));
  } else {
    const std::string dctx = g.half ? "dctx16" : "dA";
    if (g.half && !g.qkv16_output)
      k.run(g.round_kernel, {whole("dA", N * C * kF)}, {whole("dctx16", N * C * h)});
    const bool dropped = g.half || g.dropout_attn > 0;
    if (dropped) k.run(g.dropped_kernel, {whole("probs", S * h)}, {whole("dropped", S * h)});
    const std::string p = dropped ? "dropped" : "probs";
    const double qkv_extent = N * 3 * C * h, dqkv_extent = N * 3 * C * kF;
    const Use ptrs = whole("pointers", pointers);
    if (g.graphs) k.run("pair_pointers_kernel", {}, {whole("pointers", 4 * pointers)});
    k.run("cublasGemmBatchedEx", {whole(p, S * h), whole(dctx, N * C * h), ptrs},  // dV
          {slice("dqkv", N * C * kF, dqkv_extent)}, 2 * S * g.head);
    k.run("cublasGemmBatchedEx",  // dd
          {whole(dctx, N * C * h), slice(qkvh, N * C * h, qkv_extent), ptrs}, {whole("dd", S * kF)},
          2 * S * g.head);
    if (g.half)
      k.run("softmax_backward_rows_kernel", {whole("dd", S * kF), whole("probs", S * h)},
            {whole("ds16", S * h)});
    else
      k.run("softmax_backward_rows_kernel", {whole("dd", S * kF), whole("probs", S * kF)},
            {whole("dd", S * kF)});
    const std::string ds = g.half ? "ds16" : "dd";
    for (int j = 0; j < 2; ++j)  // dQ, dK
      k.run("cublasGemmBatchedEx", {whole(ds, S * h), slice(qkvh, N * C * h, qkv_extent), ptrs},
            {slice("dqkv", N * C * kF, dqkv_extent)}, 2 * S * g.head);
    std::vector<Use> reads = {whole("dqkv", N * 3 * C * kF)}, writes;
    if (g.half) writes.push_back(whole("dqkv16", N * 3 * C * h));
    column_pass(reads, writes, N, 3 * C, 1, {"db_qkv"});
    k.run("column_sums_kernel<Value>", reads, writes);
  }
  product(k, g, N, C, 3 * C, dqkvh, "W_qkv", "dh", true);
  if (first && g.half) k.run(g.round_kernel, {whole("x", N * C * kF)}, {whole("x16", N * C * h)});
  product(k, g, C, 3 * C, N, "x16", dqkvh, "dW_qkv", true);
}

}  // namespace

int64_t StepTraffic::launches() const {
  int64_t n = 0;
  for (const KernelTraffic& k : layer) n += k.launches * layers;
  for (const KernelTraffic& k : rest)
    if (k.part != "memset") n += k.launches;
  return n;
}

double StepTraffic::bytes() const {
  double b = 0;
  for (const KernelTraffic& k : layer) b += (k.read + k.written) * static_cast<double>(layers);
  for (const KernelTraffic& k : rest) b += k.read + k.written;
  return b;
}

double StepTraffic::non_gemm_bytes() const {
  double b = 0;
  for (const KernelTraffic& k : layer)
    if (k.flops == 0) b += (k.read + k.written) * static_cast<double>(layers);
  for (const KernelTraffic& k : rest)
    if (k.flops == 0) b += k.read + k.written;
  return b;
}

double StepTraffic::flops() const {
  double f = 0;
  for (const KernelTraffic& k : layer) f += k.flops * static_cast<double>(layers);
  for (const KernelTraffic& k : rest) f += k.flops;
  return f;
}

std::string traffic_not_modelled(model::Head head, const model::ModelDims& d) {
  if (head != model::Head::Pretraining) return "the pretraining step's (this head's is not)";
  if (d.unpadded || d.pack_rows > 0) return "a padded batch's (--padding skip and --pack are not)";
  if (d.recompute_layers) return "a step without recomputation";
  if (d.blocked_attention() && !d.fused_attention)
    return "the full and the fused attention's (the blocked products' are not)";
  return "";
}

StepTraffic cuda_step_traffic(const model::BertConfig& cfg, model::Head head,
                              const model::ModelDims& d, bool lamb, bool graphs) {
  const std::string why = traffic_not_modelled(head, d);
  BT_CHECK(why.empty(), "the traffic model covers ", why);
  Dims g = dims_of(cfg, head, d);
  g.graphs = graphs;
  StepTraffic t;
  t.layers = g.layers;
  Kernels layer("layer");
  encoder_layer(layer, g, false);
  t.layer = layer.take();
  const double N = g.N, C = g.C, B = g.R, BP = g.BP, Vr = g.Vr, P = g.P;
  Kernels k("embeddings");
  // ---- forward: the embeddings (the word rows gathered: a row a token), the first layer's
  // input rounded (encoder_layer adds the difference from another layer's)
  // (the word rows: as many as the batch has distinct tokens, at most min(N, V))
  const double words = std::min(N, static_cast<double>(cfg.vocab_size));
  k.run("embedding_layernorm_kernel",
        {whole("ids", N * 4), whole("segments", N * 4), whole("word", words * C * kF),
         whole("position", g.T * C * kF), whole("token_type", 2 * C * kF), whole("gamma", C * kF),
         whole("beta", C * kF)},
        {whole("sum", N * C * kF), whole("h0", N * C * kF), whole("mean", N * kF),
         whole("rstd", N * kF)});
  if (g.half) {
    k.run(g.round_kernel, {whole("x", N * C * kF)}, {whole("x16", N * C * g.h)});
    k.run(g.round_kernel, {whole("x", N * C * kF)}, {whole("x16", N * C * g.h)});
  }
  // ---- the heads: the pooler and next-sentence prediction on [CLS], the masked LM on the
  // masked positions (bert.cpp's pooler_forward, pretraining_forward and their backward)
  k.set_part("heads");
  const auto gather = [&](double rows, const char* out) {
    k.run("gather_rows_kernel", {rows_of("seq", rows, C * kF, N * C * kF), whole("at", rows * 4)},
          {whole(out, rows * C * kF)});
  };
  gather(B, "cls");
  head_linear_forward(k, g, B, C, C);
  k.run("tanh_forward_kernel", {whole("pooled", B * C * kF)}, {whole("pooled", B * C * kF)});
  head_linear_forward(k, g, B, 2, C);
  // (forward's: the gradient written over the logits; each row's loss and hit kept; the rows'
  // sums added into the step's on the device)
  const auto cross_entropy = [&](double rows, double width, bool wide, bool weights) {
    std::vector<Use> reads = {whole("logits", rows * width * kF), whole("targets", rows * 4)};
    if (weights) reads.push_back(whole("weights", rows * kF));
    k.run(wide ? "cross_entropy_wide_kernel" : "cross_entropy_kernel", reads,
          {whole("logits", rows * width * kF), whole("row_sums", 2 * rows * kF),
           whole("losses", rows * kF), whole("correct", rows * 4)});
    k.run("add_row_sums_kernel", {whole("row_sums", 2 * rows * kF), whole("step_sums", 64)},
          {whole("step_sums", 64)});
  };
  cross_entropy(B, 2, false, false);
  gather(BP, "mlm_in");
  head_linear_forward(k, g, BP, C, C);
  k.run("activation_forward_kernel", {whole("pre", BP * C * kF)}, {whole("act", BP * C * kF)});
  k.run("layernorm_forward_kernel", {whole("act", BP * C * kF), whole("gamma", 2 * C * kF)},
        {whole("ln", BP * C * kF), whole("mean", 2 * BP * kF)});
  head_linear_forward(k, g, BP, Vr, C);
  cross_entropy(BP, Vr, Vr >= 1024, true);
  // backward
  k.run("cross_entropy_kernel", {whole("logits", B * 2 * kF), whole("targets", B * 4)},
        {whole("dlogits", B * 2 * kF), whole("row_sums", 2 * B * kF)});
  head_linear_backward(k, g, B, 2, C, true);
  if (g.fp16)  // (the loss scale, on the device, multiplies forward's gradient of the logits)
    k.run("scale_kernel", {whole("dlogits", BP * Vr * kF)}, {whole("dlogits", BP * Vr * kF)});
  head_linear_backward(k, g, BP, Vr, C, true);
  layernorm_backward(k, BP, C, "dout", "in", "dinp");
  k.run("activation_backward_kernel", {whole("pre", BP * C * kF), whole("d", BP * C * kF)},
        {whole("d", BP * C * kF)});
  head_linear_backward(k, g, BP, C, C, true);
  const auto scatter_add = [&](double rows) {
    const Use dh = rows_of("dh", rows, C * kF, N * C * kF);
    k.run("scatter_add_rows_kernel", {whole("d", rows * C * kF), whole("at", rows * 4), dh}, {dh});
  };
  scatter_add(BP);
  k.run("tanh_backward_kernel", {whole("pooled", B * C * kF), whole("d", B * C * kF)},
        {whole("d", B * C * kF)});
  head_linear_backward(k, g, B, C, C, true);
  scatter_add(B);
  // ---- the embeddings' backward: dropout's, the LayerNorm's, the tables' (by row: each
  // table's chunks read every token's gradient row)
  k.set_part("embeddings");
  k.run("dropout_backward_kernel", {whole("dh", N * C * kF)}, {whole("dh", N * C * kF)});
  layernorm_backward(k, N, C, "dh", "sum", "dA");
  // Each table's pass reads every token's gradient row and adds into the rows it uses, a row's
  // tokens in chunks of kEmbeddingChunk: a row of more chunks gets partial rows, which a second
  // launch adds (the token types' two rows, from 2 x 64 tokens; a position's from 64 sequences;
  // a word's from 64 of its tokens in a batch, which the model leaves out).
  const double chunk = static_cast<double>(kernels::kEmbeddingChunk);
  struct Table {
    const char* name;
    double rows, tokens_a_row;
  };
  for (const Table& t :
       {Table{"dword", words, 1}, Table{"dposition", g.T, g.R}, Table{"dtoken_type", 2, N / 2}}) {
    const double partial_rows =
        t.tokens_a_row > chunk ? t.rows * std::ceil(t.tokens_a_row / chunk) : 0;
    const double chunks = partial_rows > 0 ? partial_rows : std::ceil(N / chunk);
    std::vector<Use> reads = {whole("dA", N * C * kF), whole("order", N * 4),
                              whole("chunks", chunks * 16)},
                     writes;
    if (partial_rows > 0) {
      writes.push_back(whole("partial", partial_rows * C * kF));
    } else {
      reads.push_back(whole(t.name, t.rows * C * kF));
      writes.push_back(whole(t.name, t.rows * C * kF));
    }
    k.run("embedding_chunks_kernel", reads, writes);
    if (partial_rows > 0)
      k.run("embedding_sums_kernel",
            {whole("partial", partial_rows * C * kF), whole("sums", t.rows * 12),
             whole(t.name, t.rows * C * kF)},
            {whole(t.name, t.rows * C * kF)});
    else if (g.graphs)  // (a graph's launch whatever the batch: its blocks find no sums, idle)
      k.run("embedding_sums_kernel", {whole("counts", 8)}, {});
  }
  // ---- the update over every parameter: the gradients' norm (the gate's sum), then AdamW's
  // or LAMB's passes; the weights' 16-bit copy written by the update where the products read it
  k.set_part("update");
  const double copy = d.weight_copy() ? 2 * P : 0;
  k.run("sum_squares_many_kernel", {whole("grads", P * kF)}, {whole("chunk_sums", 8 * P / 65536)});
  k.run("gate_kernel", {whole("chunk_sums", 8 * P / 65536)}, {whole("gate", 64)});
  std::vector<Use> copy_written;
  if (copy > 0) copy_written.push_back(whole("weights16", copy));
  const auto with_copy = [&](std::vector<Use> w) {
    w.insert(w.end(), copy_written.begin(), copy_written.end());
    return w;
  };
  if (lamb) {
    k.run("lamb_moments_many_kernel",
          {whole("params", P * kF), whole("grads", P * kF), whole("m", P * kF), whole("v", P * kF)},
          {whole("m", P * kF), whole("v", P * kF), whole("chunk_sums", 16 * P / 65536)});
    k.run("lamb_trust_kernel", {whole("chunk_sums", 16 * P / 65536)}, {whole("trust", 4)});
    k.run("lamb_apply_many_kernel",
          {whole("params", P * kF), whole("m", P * kF), whole("v", P * kF)},
          with_copy({whole("params", P * kF)}));
  } else {
    k.run("adamw_many_kernel",
          {whole("params", P * kF), whole("grads", P * kF), whole("m", P * kF), whole("v", P * kF)},
          with_copy({whole("params", P * kF), whole("m", P * kF), whole("v", P * kF)}));
  }
  // ---- memsets: the gradients before the step's backward, dh before the heads'
  k.set_part("memset");
  k.run("cudaMemsetAsync", {}, {whole("grads", P * kF)});
  k.run("cudaMemsetAsync", {}, {whole("dh", N * C * kF)});
  t.rest = k.take();
  return t;
}

Roofline h200_roofline(Precision p) {
  Roofline r;
  r.bytes_per_s = 4.8e12;
  if (p == Precision::FP32) {
    r.flops_per_s = 67e12;
    r.source =
        "an H200's datasheet: fp32 67 TFLOP/s (the products compute in fp32, no TF32), "
        "HBM3e 4.8 TB/s";
  } else {
    r.flops_per_s = 530e12;
    r.source =
        "cuBLASLt measured on an H200 at BERT-Large's shapes, 526-533 TFLOP/s "
        "(docs/gpus.md, 2026-12-04); HBM3e 4.8 TB/s (datasheet)";
  }
  return r;
}

double predicted_seconds(const KernelTraffic& k, const Roofline& r) {
  return std::max(k.flops / r.flops_per_s, (k.read + k.written) / r.bytes_per_s);
}

std::string explain_traffic(const StepTraffic& t, const Roofline& r, Precision p) {
  std::string out;
  char line[1024];
  const auto row = [&](const KernelTraffic& k, double times) {
    const double s = predicted_seconds(k, r) * times;
    std::snprintf(
        line, sizeof line, "  %-40s %-10s %6lld %10.1f %10.1f %9.1f %9.3f %s\n", k.kernel.c_str(),
        k.part.c_str(), static_cast<long long>(k.launches * times), k.read * times / 1e6,
        k.written * times / 1e6, k.flops * times / 1e9, s * 1e3,
        k.flops / r.flops_per_s >= (k.read + k.written) / r.bytes_per_s ? "flops" : "bytes");
    out += line;
    return s;
  };
  std::snprintf(line, sizeof line,
                "GPU traffic model (%s): each kernel's compulsory device-memory traffic and its "
                "products' work, a step\n",
                precision_name(p));
  out += line;
  std::snprintf(line, sizeof line, "  %-40s %-10s %6s %10s %10s %9s %9s %s\n", "kernel", "part",
                "calls", "read MB", "write MB", "GFLOP", "ms", "bound");
  out += line;
  double total = 0, gemm = 0, other = 0;
  const auto add = [&](const KernelTraffic& k, double s) {
    total += s;
    (k.flops > 0 ? gemm : other) += s;
  };
  double own = 0;  // the products of kernels of our own (the fused attention's)
  for (const KernelTraffic& k : t.layer) {
    add(k, row(k, static_cast<double>(t.layers)));
    if (k.flops > 0 && k.kernel.rfind("cublas", 0) != 0)
      own += k.flops * static_cast<double>(t.layers);
  }
  for (const KernelTraffic& k : t.rest) add(k, row(k, 1.0));
  std::snprintf(line, sizeof line,
                "  (the layer's rows are its %lld layers' together)\n"
                "step: %lld launches (memsets apart), %.2f GB moved, %.1f TFLOP\n"
                "predicted on %s:\n  %.2f ms a step: the products %.2f ms, the rest %.2f ms "
                "(the sum of each kernel's max(flops / peak, bytes / bandwidth); launch gaps, "
                "caches' misses and tails are not in it)\n",
                static_cast<long long>(t.layers), static_cast<long long>(t.launches()),
                t.bytes() / 1e9, t.flops() / 1e12, r.source.c_str(), total * 1e3, gemm * 1e3,
                other * 1e3);
  out += line;
  if (own > 0) {
    std::snprintf(line, sizeof line,
                  "  (the fused attention's %.2f TFLOP on the tensor cores are put at that rate "
                  "too: a lower bound on its time, its own rate on a GPU unmeasured)\n",
                  own / 1e12);
    out += line;
  }
  return out;
}

}  // namespace bertrain::plan
