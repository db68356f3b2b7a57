#include "plan/memory.h"

#include <algorithm>
#include <cstdio>

namespace bertrain::plan {

void plan_optimizer_state(MemoryPlan& plan, int64_t parameters, int slots) {
  const size_t bytes = static_cast<size_t>(parameters) * sizeof(float);
  for (int s = 0; s < slots; ++s)
    plan.add("optimizer",
             s == 0   ? "optimizer.m"
             : s == 1 ? "optimizer.v"
                      : "optimizer.slot" + std::to_string(s),
             bytes);
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

MemoryPlan training_plan(const model::BertConfig& cfg, model::Head head,
                         const model::ModelDims& dims, int optimizer_slots, int shard_world) {
  MemoryPlan plan = model::BertModel::make_plan(cfg, head, dims);
  plan_optimizer_state(
      plan, largest_shard(model::ParamTable(cfg, head).total(), std::max(1, shard_world)),
      optimizer_slots);
  return plan;
}

std::string format_plan(const MemoryPlan& plan, int top_regions) {
  std::string out;
  char line[160];
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
  std::sort(r.begin(), r.end(), [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
  out += "  largest regions:\n";
  for (int i = 0; i < top_regions && i < static_cast<int>(r.size()); ++i) {
    std::snprintf(line, sizeof line, "    %-28s %-12s %12s\n", r[i].name.c_str(),
                  r[i].group.c_str(), human_bytes(static_cast<double>(r[i].bytes)).c_str());
    out += line;
  }
  return out;
}

int64_t max_batch_for_budget(const model::BertConfig& cfg, model::Head head, model::ModelDims dims,
                             int optimizer_slots, double budget_bytes, int shard_world) {
  // The plan grows monotonically with the batch: binary search on it.
  int64_t lo = 0, hi = 1;
  auto fits = [&](int64_t b) {
    dims.batch = b;
    return static_cast<double>(
               training_plan(cfg, head, dims, optimizer_slots, shard_world).total_bytes()) <=
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

}  // namespace bertrain::plan
