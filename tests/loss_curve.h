// Training curves to compare backends and precisions by: train::Step (AdamW or LAMB, dropout
// on, seed 9, lr 1e-3) from init_params(11) over test::learnable_batch, one new batch a step
// (read ahead on a backend with memory of its own, as train does), full attention; fp16 with
// the dynamic loss scaler on, as train runs it. graphs: forward and backward as CUDA graphs
// (StepSettings::graphs); defer: the step's results read later (StepSettings::defer, settled
// each step here).
#pragma once

#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "kernels/backend.h"
#include "model/bert.h"
#include "test_util.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "train/step.h"

namespace bertrain::test {

// Each step's loss; `after` (optional) sees the model after each step with its result.
inline std::vector<double> loss_curve(
    const kernels::Backend& be, const model::BertConfig& c, Precision p, int64_t steps,
    train::OptimizerKind kind = train::OptimizerKind::AdamW,
    const std::function<void(const model::BertModel&, const train::StepReport&)>& after = {},
    bool graphs = false, bool defer = false) {
  model::ModelDims d{4, 32, 5};
  d.precision = p;
  d.attention = model::ModelDims::Attention::Full;
  model::BertModel m(c, model::Head::Pretraining, d, be);
  m.init_params(11);
  train::OptimizerConfig oc;
  oc.kind = kind;
  train::Optimizer opt(train::param_slices(m.table()), m.table().total(), oc, be);
  train::LossScaler::Config sc;
  sc.enabled = d.fp16();
  train::LossScaler scaler{sc};
  comm::SingleProcess single;
  train::StepSettings ss;
  ss.seed = 9;
  ss.graphs = graphs ? model::GraphMode::On : model::GraphMode::Off;
  ss.defer = defer;
  train::Step step(m, opt, scaler, single, ss);
  std::vector<double> losses;
  for (int64_t k = 0; k < steps; ++k) {
    // (A backend with memory of its own reads the next step's batch during this one's backward.)
    train::StepReport r = step.run(
        k, 1e-3,
        [&](model::Batch& b) {
          b = learnable_batch(c, step.reading_ahead() ? k + 1 : k);
          return true;
        },
        "", k + 1 < steps);
    if (r.pending) r = step.settle().back();
    losses.push_back(r.loss);
    if (after) after(m, r);
  }
  return losses;
}

// The largest relative difference of two curves' losses.
inline double worst_relative(const std::vector<double>& a, const std::vector<double>& ref) {
  double worst = 0;
  for (size_t k = 0; k < ref.size(); ++k)
    worst = std::max(worst, std::fabs(a[k] - ref[k]) / std::fabs(ref[k]));
  return worst;
}

}  // namespace bertrain::test
