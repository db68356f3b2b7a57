// The memory estimator: the exact plan a training run allocates (model parameters, gradients,
// activations, backward scratch from BertModel::make_plan) plus optimizer state, printed by
// `bertrain estimate`. Because the trainer allocates from this same plan, estimate = allocation.
#pragma once

#include <string>

#include "model/bert.h"

namespace bertrain::plan {

// The optimizer's state: `slots` fp32 values per parameter (AdamW and LAMB: 2, the moments
// m and v), group "optimizer", regions optimizer.m, optimizer.v (then optimizer.slotN).
// train::Optimizer allocates from exactly this.
void plan_optimizer_state(MemoryPlan& plan, int64_t parameters, int slots);

// optimizer_slots: fp32 copies per parameter held by the optimizer (AdamW/LAMB: 2).
MemoryPlan training_plan(const model::BertConfig& cfg, model::Head head,
                         const model::ModelDims& dims, int optimizer_slots);

// A human-readable table: bytes per group, the largest regions, the total.
std::string format_plan(const MemoryPlan& plan, int top_regions = 8);

// Largest batch size whose plan fits in `budget_bytes` (0 if even batch 1 does not fit).
int64_t max_batch_for_budget(const model::BertConfig& cfg, model::Head head, model::ModelDims dims,
                             int optimizer_slots, double budget_bytes);

}  // namespace bertrain::plan
