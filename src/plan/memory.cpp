#include "plan/memory.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <tuple>

#include "core/error.h"
#include "kernels/types.h"

namespace bertrain::plan {

void plan_optimizer_state(MemoryPlan& plan, int64_t parameters, int slots) {
  const size_t bytes = static_cast<size_t>(parameters) * sizeof(float);
  for (int s = 0; s < slots; ++s)
    plan.add("optimizer",
             s == 0   ? "optimizer.m"
             : s == 1 ? "optimizer.v"
                      : "optimizer.slot" + std::to_string(s),
             bytes);
  plan.add("optimizer", "optimizer.gate", sizeof(kernels::GradientGate));
}

std::pair<int64_t, int64_t> shard_range(int64_t total, int rank, int world) {
  const int64_t units = (total + 15) / 16;  // 16-value units: parts start 64-byte aligned
  auto cut = [&](int r) { return std::min(total, units * r / world * 16); };
  return {cut(rank), rank + 1 == world ? total : cut(rank + 1)};
}

int64_t largest_shard(int64_t total, int world) {
  int64_t most = 0;
  for (int r = 0; r < world; ++r) {
    const auto [b, e] = shard_range(total, r, world);
    most = std::max(most, e - b);
  }
  return most;
}

model::ModelDims with_master_shard(const model::BertConfig& cfg, model::Head head,
                                   model::ModelDims dims, int rank, int world,
                                   const kernels::Target& target) {
  if (!dims.bf16() || world <= 1 || !target.host_memory()) return dims;
  const int64_t total = model::ParamTable(cfg, head).total();
  auto of_rank = [&](int r) {
    model::ModelDims d = dims;
    d.master_shard = true;
    std::tie(d.master_begin, d.master_end) = shard_range(total, r, world);
    return d;
  };
  if (rank >= 0) return of_rank(rank);
  // The rank whose part leaves the fewest bytes of holes holds the most.
  const model::ParamTable table(cfg, head);
  int most = 0;
  size_t fewest = SIZE_MAX;
  for (int r = 0; r < world; ++r) {
    const auto [b, e] = shard_range(total, r, world);
    size_t holes = 0;
    for (const auto& [hb, he] : model::master_holes(table, b, e)) holes += he - hb;
    if (holes < fewest) std::tie(most, fewest) = std::pair(r, holes);
  }
  return of_rank(most);
}

MemoryPlan training_plan(const model::BertConfig& cfg, model::Head head,
                         const model::ModelDims& dims, int optimizer_slots, int shard_world,
                         const kernels::Target& target) {
  // bf16 with a sharded optimizer shards the fp32 master (planned for the rank holding the most).
  MemoryPlan plan = model::BertModel::make_plan(
      cfg, head,
      dims.master_shard ? dims
                        : with_master_shard(cfg, head, dims, -1, std::max(1, shard_world), target),
      target);
  plan_optimizer_state(
      plan, largest_shard(model::ParamTable(cfg, head).total(), std::max(1, shard_world)),
      optimizer_slots);
  return plan;
}

std::string explain_plan(const model::BertConfig& cfg, model::Head head, const model::ModelDims& d,
                         int slots, int shard_world, const MemoryPlan& plan) {
  const double P = static_cast<double>(model::ParamTable(cfg, head).total());
  const double L = static_cast<double>(cfg.num_hidden_layers),
               h = static_cast<double>(cfg.hidden_size),
               a = static_cast<double>(cfg.num_attention_heads), s = static_cast<double>(d.seq_len),
               b = static_cast<double>(d.batch);
  const double rule_states = 16.0 * P;
  const double rule_attention = L * 5.0 * a * s * s * b;  // scores, softmax (2 B), mask (1 B)
  const double rule_act = L * s * b * h * 34.0 + rule_attention;
  auto g = [&](const char* group) { return static_cast<double>(plan.group_bytes(group)); };
  const double states = g("parameters") + g("gradients") + g("optimizer");
  const double act = g("activations") + g("scratch"), kernels = g("kernels");
  std::string out;
  char line[256];
  auto row = [&](const char* what, const std::string& how, double bytes, const std::string& note) {
    std::snprintf(line, sizeof line, "  %-13s %-34s %11s  %s\n", what, how.c_str(),
                  human_bytes(bytes).c_str(), note.c_str());
    out += line;
  };
  out += "rule of thumb (what out-of-memory advice quotes):\n";
  row("model states",
      str("16 B x ",
          P / 1e6 > 10 ? str(static_cast<int64_t>(P / 1e6 + 0.5), "M")
                       : str(static_cast<int64_t>(P)),
          " parameters"),
      rule_states, "fp32 weights 4, gradients 4, Adam m and v 8");
  row("activations", "L s b h (34 + 5 a s / h) B", rule_act,
      "Korthikanti et al. 2022: 16-bit activations, 1-byte dropout masks");
  row("  per token", "L s b h 34 B", rule_act - rule_attention,
      "what formulas without the attention's s^2 terms count");
  row("  s^2 terms", "L 5 a s^2 b B", rule_attention, "scores, softmax, dropout mask");
  row("total", "", rule_states + rule_act, "");
  out += "the plan (what train allocates, byte for byte):\n";
  row("model states", "parameters + gradients + optimizer", states,
      str(human_bytes(g("parameters")), " + ", human_bytes(g("gradients")), " + ",
          human_bytes(g("optimizer"))));
  row("activations", "activations + backward scratch", act,
      str(human_bytes(g("activations")), " + ", human_bytes(g("scratch"))));
  // A device's plan stages the batch it reads (group "input") and holds its kernels' scratch.
  const bool device = g("input") > 0;
  row("kernels", "library and kernel workspaces", kernels,
      device ? "cuBLASLt's workspace, attention's buffers, partial sums"
             : "oneDNN's GEMM scratchpad, partials");
  for (const std::string& other : plan.groups())
    if (other != "parameters" && other != "gradients" && other != "optimizer" &&
        other != "activations" && other != "scratch" && other != "kernels")
      row(other.c_str(),
          other == "bf16" || other == "fp16" ? "weight copy and matmul operands"
          : other == "input"                 ? "the batch, its embedding groups"
                                             : "",
          g(other.c_str()), "");
  row("total", "", static_cast<double>(plan.total_bytes()), "");
  out += "where they differ:\n";
  auto pct = [](double x, double y) { return str(static_cast<int64_t>(100.0 * x / y + 0.5), "%"); };
  out += str("  model states: the plan is ", pct(states, rule_states), " of the rule");
  std::string why;
  for (const char* copy : {"bf16", "fp16"})
    if (g(copy) > 0)
      why +=
          str("; the ", copy, " weight copy the matmuls read (2 B per parameter) is its own group");
  if (slots != 2) why += str("; ", slots, " optimizer slots instead of Adam's 2");
  if (shard_world > 1)
    why += str("; the optimizer state sharded over ", shard_world, " ranks (",
               4.0 * slots / shard_world, " B per parameter on this rank)");
  if (d.master_shard)
    why += str("; the fp32 master weights sharded too (", human_bytes(g("parameters")),
               " on this rank: its part of the matmul weights, and the embeddings, biases and "
               "LayerNorm that every rank reads in fp32)");
  out += (why.empty() ? std::string(": the same accounting") : why) + "\n";
  out += str("  activations: the plan is ", pct(act, rule_act), " of the rule");
  why.clear();
  if (d.recompute_layers)
    why +=
        "; layers recomputed in backward: one layer's activations live at a time, plus each "
        "layer's output (the rule keeps every layer's)";
  if (d.bf16() || d.fp16())
    why += str("; the tensors backward reads from matmuls and attention kept in ",
               d.bf16() ? "bf16" : "fp16",
               ", LayerNorm inputs and residual sums in fp32 (the rule: all 16-bit)");
  else
    why += "; fp32 training keeps fp32 activations (4 B where the rule counts 2)";
  if (d.blocked_attention())
    why +=
        str("; the blocked attention keeps no [b, a, s, s] probabilities (the rule's 5 a s / h "
            "term, ",
            human_bytes(rule_attention), ", is not allocated)");
  else
    why +=
        str("; the full attention keeps the [b, a, s, s] probabilities and the dropout mask "
            "(the rule's 5 a s / h term: ",
            human_bytes(rule_attention), ")");
  why +=
      "; the rule leaves out the embeddings, the heads (the MLM logits are b x predictions x "
      "vocab) and backward's scratch";
  out += why + "\n";
  out += str("  kernels: ", human_bytes(kernels), " of workspaces the rule does not count\n");
  return out;
}

std::string format_plan(const MemoryPlan& plan, int top_regions) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "  %-14s %12s\n", "group", "bytes");
  out += line;
  for (const auto& g : plan.groups()) {
    std::snprintf(line, sizeof line, "  %-14s %12s\n", g.c_str(),
                  human_bytes(static_cast<double>(plan.group_bytes(g))).c_str());
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-14s %12s\n", "total",
                human_bytes(static_cast<double>(plan.total_bytes())).c_str());
  out += line;
  std::vector<PlanRegion> r = plan.regions();
  std::sort(r.begin(), r.end(),
            [](const auto& a, const auto& b) { return a.resident_bytes() > b.resident_bytes(); });
  out += "  largest regions:\n";
  for (int i = 0; i < top_regions && i < static_cast<int>(r.size()); ++i) {
    // A region with holes (the sharded fp32 master) costs its resident part.
    const std::string of = r[i].holes.empty()
                               ? ""
                               : str("  (of ", human_bytes(static_cast<double>(r[i].bytes)),
                                     ": the rest is other ranks' part)");
    std::snprintf(line, sizeof line, "    %-28s %-12s %12s%s\n", r[i].name.c_str(),
                  r[i].group.c_str(),
                  human_bytes(static_cast<double>(r[i].resident_bytes())).c_str(), of.c_str());
    out += line;
  }
  return out;
}

int64_t max_batch_for_budget(const model::BertConfig& cfg, model::Head head, model::ModelDims dims,
                             int optimizer_slots, double budget_bytes, int shard_world,
                             const std::function<double(int64_t)>& outside,
                             const kernels::Target& target) {
  // The plan grows monotonically with the batch: binary search on it.
  int64_t lo = 0, hi = 1;
  const int64_t per_row = dims.pack_rows > 0 ? dims.batch / dims.pack_rows : 0;
  auto fits = [&](int64_t b) {
    dims.batch = per_row > 0 ? b * per_row : b;
    if (per_row > 0) dims.pack_rows = b;
    return static_cast<double>(
               training_plan(cfg, head, dims, optimizer_slots, shard_world, target).total_bytes()) +
               (outside ? outside(b) : 0.0) <=
           budget_bytes;
  };
  while (fits(hi) && hi < (int64_t{1} << 20)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    int64_t mid = (lo + hi) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

double device_budget(const kernels::DeviceMemory& m) {
  return std::max(0.0, static_cast<double>(m.free) - kDeviceHeadroom);
}

void check_device_fits(const model::BertConfig& cfg, model::Head head, const model::ModelDims& dims,
                       int optimizer_slots, int shard_world, const kernels::Backend& backend,
                       const std::string& batch_option) {
  const std::optional<kernels::DeviceMemory> mem = backend.device_memory();
  if (backend.host_memory() || !mem) return;
  const MemoryPlan plan = training_plan(cfg, head, dims, optimizer_slots, shard_world, backend);
  const double budget = device_budget(*mem), need = static_cast<double>(plan.total_bytes());
  if (need <= budget) return;
  std::vector<std::string> groups = plan.groups();
  std::sort(groups.begin(), groups.end(), [&](const std::string& a, const std::string& b) {
    return plan.group_bytes(a) > plan.group_bytes(b);
  });
  std::string largest;
  for (size_t i = 0; i < groups.size() && i < 3; ++i)
    largest += str(i ? ", " : "", groups[i], " ",
                   human_bytes(static_cast<double>(plan.group_bytes(groups[i]))));
  const int64_t fit =
      max_batch_for_budget(cfg, head, dims, optimizer_slots, budget, shard_world, {}, backend);
  const int64_t batch = dims.pack_rows > 0 ? dims.pack_rows : dims.batch;
  const std::string advice =
      fit > 0 ? str("the largest batch that fits is ", fit, " (", batch_option, " ", fit,
                    "); layer recomputation or bf16 fit more")
              : str("not even a batch of 1 fits: a shorter sequence length, layer recomputation, "
                    "bf16 or a GPU with more memory");
  fail("batch ", batch, " x ", dims.seq_len, " tokens needs ", human_bytes(need), " on the ",
       backend.name(), " device (", largest, "), which has ",
       human_bytes(static_cast<double>(mem->free)), " of ",
       human_bytes(static_cast<double>(mem->total)), " free (", human_bytes(kDeviceHeadroom),
       " of it kept for the libraries): ", advice, "; `bertrain estimate --device ", backend.name(),
       "` prints the plan");
}

}  // namespace bertrain::plan
