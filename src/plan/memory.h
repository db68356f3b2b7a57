// The memory estimator: the exact plan a training run allocates (model parameters, gradients,
// activations, backward scratch from BertModel::make_plan) plus optimizer state, printed by
// `bertrain estimate`. Because the trainer allocates from this same plan, estimate = allocation.
#pragma once

#include <functional>
#include <string>
#include <utility>

#include "model/bert.h"

namespace bertrain::plan {

// The optimizer's state: `slots` fp32 values per parameter (AdamW and LAMB: 2, the moments
// m and v), group "optimizer", regions optimizer.m, optimizer.v (then optimizer.slotN), and the
// step's gate (optimizer.gate: kernels::GradientGate, which the update reads where it runs).
// train::Optimizer allocates from exactly this.
void plan_optimizer_state(MemoryPlan& plan, int64_t parameters, int slots);

// Rank r's part [begin, end) of `total` flat values sharded over `world` ranks (the sharded
// optimizer, train::shard_of): consecutive, near-equal, cut at multiples of 16 values.
std::pair<int64_t, int64_t> shard_range(int64_t total, int rank, int world);
int64_t largest_shard(int64_t total, int world);

// bf16 with the optimizer sharded over `world` > 1 ranks (train/finetune --shard-optimizer):
// dims with rank `rank`'s part of the fp32 master (ModelDims::master_shard); rank -1: the rank
// whose parameters hold the most (what a plan per rank must hold). Else dims unchanged, and on a
// target whose kernels read memory of their own (a GPU's): its arenas are one device block each,
// with no unbacked holes, so there the optimizer state alone is sharded and the master whole.
model::ModelDims with_master_shard(const model::BertConfig& cfg, model::Head head,
                                   model::ModelDims dims, int rank, int world,
                                   const kernels::Target& target);

// optimizer_slots: fp32 copies per parameter held by the optimizer (AdamW/LAMB: 2).
// shard_world > 1: the optimizer state is sharded over that many ranks (the largest part).
// target: where the kernels run (kernels/backend.h; a device's plan adds the staged batch
// arrays and takes its kernels' scratch).
MemoryPlan training_plan(const model::BertConfig& cfg, model::Head head,
                         const model::ModelDims& dims, int optimizer_slots, int shard_world = 1,
                         const kernels::Target& target = kernels::cpu_backend());

// `estimate --explain`: the rule of thumb that out-of-memory advice quotes (16 bytes per
// parameter for fp32 Adam training; Korthikanti et al. 2022's s b h (34 + 5 a s / h) bytes of
// activations per layer) next to the exact plan, group by group, and why they differ for this
// run (precision, attention kernel, recomputation, sharding, what the rule leaves out).
std::string explain_plan(const model::BertConfig& cfg, model::Head head,
                         const model::ModelDims& dims, int optimizer_slots, int shard_world,
                         const MemoryPlan& plan);

// A human-readable table: bytes per group, the largest regions, the total.
std::string format_plan(const MemoryPlan& plan, int top_regions = 8);

// Largest batch size whose plan fits in `budget_bytes` (0 if even batch 1 does not fit).
// Packed dims (pack_rows > 0, batch = pack_rows x instances per row): the batch is in rows.
// outside(batch): what a run holds besides its arenas at that batch (the input pipeline's
// bound, the MPI window slot), counted against the budget too.
int64_t max_batch_for_budget(const model::BertConfig& cfg, model::Head head, model::ModelDims dims,
                             int optimizer_slots, double budget_bytes, int shard_world = 1,
                             const std::function<double(int64_t)>& outside = {},
                             const kernels::Target& target = kernels::cpu_backend());

// What a device keeps back from a run's plan: the libraries' own allocations (cuBLAS's and
// cuBLASLt's handles and workspaces, lazily loaded kernels, the allocator's rounding).
constexpr double kDeviceHeadroom = 256.0 * (1 << 20);
// The bytes a plan may take on a device with memory m: its free memory less the headroom.
double device_budget(const kernels::DeviceMemory& m);

// Before a run allocates on a backend with memory of its own (a GPU): its plan (training_plan
// with `optimizer_slots`, 0 for eval and predict) against the device's budget. When it does not
// fit, fails naming the device, the bytes, the largest groups and the largest batch that fits
// (`batch_option`: the flag that sets it). Host memory (the CPU's): nothing to check.
void check_device_fits(const model::BertConfig& cfg, model::Head head, const model::ModelDims& dims,
                       int optimizer_slots, int shard_world, const kernels::Backend& backend,
                       const std::string& batch_option = "--batch-size");

}  // namespace bertrain::plan
