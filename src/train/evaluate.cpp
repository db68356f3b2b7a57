#include "train/evaluate.h"

#include "data/pipeline.h"

namespace bertrain::train {

EvalResult evaluate(model::BertModel& m, const std::string& data, int64_t batch_size,
                    int64_t max_batches, comm::Communicator& comm) {
  data::PipelineOptions o;
  o.files = data;
  o.batch_size = batch_size;
  o.shuffle = false;
  o.epochs = 1;
  o.drop_remainder = false;
  o.rank = comm.rank();
  o.world = comm.size();
  const auto& d = m.dims();
  data::Pipeline pipe(o,
                      data::Schema::pretraining(d.seq_len, d.max_predictions, m.config().vocab_size,
                                                m.config().type_vocab_size));
  model::Batch b;
  // sums: weighted mlm ce, mlm weight, mlm weighted correct, nsp ce * B, nsp correct, examples
  double s[6] = {0, 0, 0, 0, 0, 0};
  for (int64_t n = 0; (max_batches == 0 || n < max_batches) && pipe.next(b); ++n) {
    const model::Losses l = m.forward(b, {});
    s[0] += l.mlm_loss * (l.mlm_weight + 1e-5);
    s[1] += l.mlm_weight;
    s[2] += l.mlm_correct;
    s[3] += l.nsp_loss * b.B;
    s[4] += static_cast<double>(l.nsp_correct);
    s[5] += static_cast<double>(b.B);
  }
  comm.allreduce_sum(s, 6);
  EvalResult r;
  r.mlm_loss = s[0] / std::max(s[1], 1e-9);
  r.mlm_accuracy = s[2] / std::max(s[1], 1e-9);
  r.nsp_loss = s[3] / std::max(s[5], 1.0);
  r.nsp_accuracy = s[4] / std::max(s[5], 1.0);
  r.examples = static_cast<int64_t>(s[5]);
  r.predictions = static_cast<int64_t>(s[1]);
  return r;
}

}  // namespace bertrain::train
