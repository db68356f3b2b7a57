// Dynamic loss scaling for fp16: multiply the loss by `scale` before backward, unscale in the
// optimizer; a step with any inf/NaN gradient is skipped and the scale halved (not below
// min_scale); after growth_interval good steps in a row the scale doubles. More than
// max_consecutive_skips skipped steps in a row is an error: training has diverged.
// Disabled (fp32/bf16), the scale is 1 and every step is applied.
#pragma once

#include <cstdint>

#include "core/error.h"
#include "core/setting.h"

namespace bertrain::train {

class LossScaler {
 public:
  struct Config {
    bool enabled = false;
    float init = 65536.0f, growth = 2.0f, backoff = 0.5f, min_scale = 1.0f;
    int64_t growth_interval = 2000, max_consecutive_skips = 20;
  };
  LossScaler() = default;
  explicit LossScaler(const Config& c) : cfg_(c), scale_(c.enabled ? c.init : 1.0f) {}

  float scale() const { return scale_; }
  bool enabled() const { return cfg_.enabled; }
  // Given whether every rank's gradients were finite: true when the step may be applied.
  bool update(bool finite, int64_t step) {
    if (finite) {
      consecutive_skips_ = 0;
      if (cfg_.enabled && ++good_ >= cfg_.growth_interval) {
        scale_ *= cfg_.growth;
        good_ = 0;
      }
      return true;
    }
    ++skipped_;
    ++consecutive_skips_;
    good_ = 0;
    if (!cfg_.enabled || consecutive_skips_ > cfg_.max_consecutive_skips)
      fail("step ", step, ": gradients are not finite",
           cfg_.enabled
               ? str(" in ", consecutive_skips_, " consecutive steps (loss scale ", scale_,
                     "; an fp16 activation beyond +-65504 overflows at any scale: if the loss is "
                     "not finite either, train with ",
                     setting("precision"), " bf16)")
               : std::string(" (fp32/bf16 training has diverged)"),
           "; lower ", setting("lr"), ", raise ", setting("warmup"),
           ", or resume from the last good checkpoint");
    scale_ = std::max(cfg_.min_scale, scale_ * cfg_.backoff);
    return false;
  }
  int64_t skipped() const { return skipped_; }
  int64_t good_steps() const { return good_; }
  void restore(float scale, int64_t good, int64_t skipped) {
    scale_ = scale;
    good_ = good;
    skipped_ = skipped;
  }

 private:
  Config cfg_;
  float scale_ = 1.0f;
  int64_t good_ = 0, skipped_ = 0, consecutive_skips_ = 0;
};

}  // namespace bertrain::train
