// Dynamic loss scaling for fp16: multiply the loss by `scale` before backward, unscale in the
// optimizer; a step with any inf/NaN gradient is skipped and the scale halved (not below
// min_scale); after growth_interval good steps in a row the scale doubles. More than
// max_consecutive_skips skipped steps in a row is an error: training has diverged. The rule is
// kernels::next_loss_scale, the one the device runs where it decides the steps.
// Disabled (fp32/bf16), the scale is 1 and every step is applied.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/error.h"
#include "core/setting.h"
#include "kernels/types.h"

namespace bertrain::train {

class LossScaler {
 public:
  struct Config {
    bool enabled = false;
    float init = 65536.0f, growth = 2.0f, backoff = 0.5f, min_scale = 1.0f;
    int64_t growth_interval = 2000, max_consecutive_skips = 20;
  };
  LossScaler() = default;
  explicit LossScaler(const Config& c) : cfg_(c) {
    s_.enabled = c.enabled ? 1 : 0;
    s_.scale = c.enabled ? c.init : 1.0f;
    s_.growth = c.growth;
    s_.backoff = c.backoff;
    s_.min_scale = c.min_scale;
    s_.growth_interval = static_cast<int32_t>(std::min<int64_t>(c.growth_interval, INT32_MAX));
  }

  float scale() const { return s_.scale; }
  bool enabled() const { return cfg_.enabled; }
  // The scale and its rule as kernels::LossScale, whose rule (kernels::next_loss_scale) this
  // runs: where the device decides the steps (train::Step deferred) it starts from this, and
  // update() replays the device's decisions when the host reads them.
  const kernels::LossScale& state() const { return s_; }
  // Given whether every rank's gradients were finite: true when the step may be applied.
  bool update(bool finite, int64_t step) {
    const float was = s_.scale;
    kernels::next_loss_scale(s_, finite);
    if (finite) return true;
    ++skipped_;
    if (!cfg_.enabled || s_.bad > cfg_.max_consecutive_skips)
      fail("step ", step, ": gradients are not finite",
           cfg_.enabled
               ? str(" in ", s_.bad, " consecutive steps (loss scale ", was,
                     "; an fp16 activation beyond +-65504 overflows at any scale: if the loss is "
                     "not finite either, train with ",
                     setting("precision"), " bf16)")
               : std::string(" (fp32/bf16 training has diverged)"),
           "; lower ", setting("lr"), ", raise ", setting("warmup"),
           ", or resume from the last good checkpoint");
    return false;
  }
  int64_t skipped() const { return skipped_; }
  int64_t good_steps() const { return s_.good; }
  void restore(float scale, int64_t good, int64_t skipped) {
    s_.scale = scale;
    s_.good = static_cast<int32_t>(good);
    s_.bad = 0;
    skipped_ = skipped;
  }

 private:
  Config cfg_;
  kernels::LossScale s_;
  int64_t skipped_ = 0;
};

}  // namespace bertrain::train
