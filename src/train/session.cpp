#include "train/session.h"

#include "core/error.h"
#include "plan/memory.h"

namespace bertrain::train {

namespace {

const kernels::Backend& backend_of(const SessionSettings& s) {
  return s.backend ? *s.backend : kernels::cpu_backend();
}

// The dims the model is built with: the sharded master where it applies, checked against a
// device's memory (the plan with the optimizer's two moments) before anything allocates.
model::ModelDims session_dims(const model::BertConfig& mc, const SessionSettings& s,
                              const comm::Communicator& comm) {
  model::ModelDims d = s.dims;
  const int world = comm.size();
  if (s.shard_optimizer)
    d = plan::with_master_shard(mc, s.head, d, comm.rank(), world, backend_of(s));
  plan::check_device_fits(mc, s.head, d, 2, s.shard_optimizer ? world : 1, backend_of(s));
  return d;
}

LossScaler::Config scaler_config(const SessionSettings& s) {
  LossScaler::Config c;
  c.enabled = s.dims.precision == Precision::FP16;
  c.max_consecutive_skips = s.max_skipped_steps;
  return c;
}

}  // namespace

Session::Session(const model::BertConfig& mc, const SessionSettings& s, comm::Communicator& comm,
                 std::optional<uint64_t> init_seed)
    : m(mc, s.head, session_dims(mc, s, comm), backend_of(s)),
      opt(param_slices(m.table()), m.table().total(), s.optimizer, backend_of(s),
          s.shard_optimizer ? shard_of(m.table().total(), comm.rank(), comm.size()) : Shard{}),
      scaler(scaler_config(s)),
      comm_(comm) {
  if (init_seed) m.init_params(*init_seed);
}

Session::~Session() = default;

Step& Session::start(const StepSettings& st, obs::Timeline* timeline) {
  BT_CHECK(!step_, "a session's step is started once");
  step_ = std::make_unique<Step>(m, opt, scaler, comm_, st, timeline);
  return *step_;
}

Step& Session::step() const {
  BT_CHECK(step_, "the session's step is not started");
  return *step_;
}

}  // namespace bertrain::train
