// Evaluation of a pretraining model over one pass of TFRecord data: Google BERT's metrics
// (run_pretraining.py): masked LM loss (weighted mean over predictions) and accuracy, next
// sentence loss and accuracy. Dropout off; the last partial batch counts.
#pragma once

#include <string>

#include "comm/communicator.h"
#include "model/bert.h"

namespace bertrain::train {

struct EvalResult {
  double mlm_loss = 0, mlm_accuracy = 0, nsp_loss = 0, nsp_accuracy = 0;
  int64_t examples = 0, predictions = 0;
};

// data: glob(s). max_batches 0: everything.
EvalResult evaluate(model::BertModel& m, const std::string& data, int64_t batch_size,
                    int64_t max_batches, comm::Communicator& comm);

}  // namespace bertrain::train
