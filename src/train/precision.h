// A training precision (core/precision.h) as the model runs it: what each keeps and computes is
// ModelDims' (model/bert.h).
#pragma once

#include <string>

#include "model/bert.h"

namespace bertrain::train {

// The model dimensions in precision p (brace-initialised dims read on).
inline model::ModelDims with_precision(model::ModelDims d, Precision p) {
  d.precision = p;
  return d;
}

}  // namespace bertrain::train
