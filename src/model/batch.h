// The model's view of a batch (data/batch.h): validation against a config.
#pragma once

#include "data/batch.h"
#include "model/config.h"

namespace bertrain::model {

using data::Batch;

enum class Head;  // model/params.h

// Checks every id against the config and every length against B/T/P; the error names the
// field, the example and the position, e.g. "input_ids[3,17] = 40000 is outside the vocabulary".
void validate_batch(const Batch& b, const BertConfig& cfg, Head head);

}  // namespace bertrain::model
