// Packing (data/packing.h, --pack): the row packer's rule, the pipeline's packed batches (every
// instance once and in stream order, each batch fits its rows and is as long as the rule lets it
// be, exact resume, a resume on another number of ranks reading every instance once), and the
// model on a packed batch against the same instances unpacked: losses, every gradient and every
// real position's output to fp32 rounding (the tolerances of test_unpadded.cpp: the same sums
// in another order), dropout included (an instance draws the masks of its place in the batch,
// packed or not); and each instance against itself run alone, which is what "several instances
// in one row, each attending to itself" must mean.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "data/example.h"
#include "data/packing.h"
#include "data/pipeline.h"
#include "data/tfrecord.h"
#include "model/bert.h"
#include "test_util.h"

namespace bertrain {
namespace {

using data::RowPacker;

TEST(RowPacker, FirstFitThenFirstFitDecreasing) {
  RowPacker p({2, 10, 3, 100});
  EXPECT_TRUE(p.take(4, 1));
  EXPECT_TRUE(p.take(4, 1));  // first fit: row 0 holds 8
  EXPECT_TRUE(p.take(6, 1));  // row 1
  // 6 fits no row as they are (8 and 6 used), but longest first it does: 6+4 and 6+4.
  EXPECT_TRUE(p.take(6, 1));
  EXPECT_EQ(p.tokens(), 20);
  EXPECT_EQ(p.instances(), 4);
  std::vector<int64_t> per_row(2, 0);
  const std::vector<int64_t> len = {4, 4, 6, 6};
  for (size_t i = 0; i < len.size(); ++i) per_row[p.rows()[i]] += len[i];
  EXPECT_EQ(per_row, (std::vector<int64_t>{10, 10}));
  EXPECT_FALSE(p.take(1, 0));  // full: nothing changes
  EXPECT_EQ(p.instances(), 4);
  p.clear();
  EXPECT_TRUE(p.take(10, 0));
  EXPECT_EQ(p.tokens(), 10);
}

TEST(RowPacker, InstancesPerRowAndPredictionsAreCapped) {
  RowPacker rows({1, 100, 2, 100});
  EXPECT_TRUE(rows.take(1, 0));
  EXPECT_TRUE(rows.take(1, 0));
  EXPECT_FALSE(rows.take(1, 0)) << "a third instance in a row of at most 2";
  RowPacker preds({4, 100, 3, 5});
  EXPECT_TRUE(preds.take(2, 3));
  EXPECT_FALSE(preds.take(2, 3)) << "6 predictions over the batch's 5";
  EXPECT_TRUE(preds.take(2, 2));
  EXPECT_THROW(preds.take(101, 0), Error);
  EXPECT_THROW(RowPacker({0, 10, 3, 1}), Error);
}

TEST(RowPacker, InstanceSizeFollowsTheModelsRealLength) {
  const int32_t mask[8] = {1, 1, 1, 1, 1, 0, 0, 0};
  const int32_t pos[3] = {2, 6, 7};
  const float w[3] = {1, 1, 0};  // position 6 is weighted past the mask: counted in
  EXPECT_EQ(data::instance_size(mask, 8, pos, w, 3), (std::pair<int64_t, int64_t>{7, 2}));
  const int32_t none[8] = {};
  EXPECT_EQ(data::instance_size(none, 8, pos, w, 0), (std::pair<int64_t, int64_t>{8, 0}));
}

// ---- the pipeline ----

using test::TempDir;
constexpr int64_t kT = 16, kP = 3;

// Instance uid: real length 2 + uid % 15 (some near full, some short), predictions 1 + uid % 3.
std::string make_record(int64_t uid) {
  const int64_t len = 2 + uid % 15, preds = 1 + uid % 3;
  data::Example ex;
  std::vector<int64_t> ids(kT, 0), mask(kT, 0);
  for (int64_t t = 0; t < len; ++t) {
    ids[t] = t == 0 ? uid : 7;
    mask[t] = 1;
  }
  std::vector<int64_t> positions(kP, 0), labels(kP, 0);
  std::vector<float> weights(kP, 0.0f);
  for (int64_t j = 0; j < preds; ++j) {
    positions[j] = 1 + j % (len - 1);
    labels[j] = 5;
    weights[j] = 1.0f;
  }
  ex["input_ids"] = {data::FeatureKind::Int64, ids, {}, {}};
  ex["input_mask"] = {data::FeatureKind::Int64, mask, {}, {}};
  ex["segment_ids"] = {data::FeatureKind::Int64, std::vector<int64_t>(kT, 0), {}, {}};
  ex["masked_lm_positions"] = {data::FeatureKind::Int64, positions, {}, {}};
  ex["masked_lm_ids"] = {data::FeatureKind::Int64, labels, {}, {}};
  ex["masked_lm_weights"] = {data::FeatureKind::Float, {}, weights, {}};
  ex["next_sentence_labels"] = {data::FeatureKind::Int64, {uid % 2}, {}, {}};
  return data::encode_example(ex);
}

void write_shards(const TempDir& dir, int files, int records) {
  for (int f = 0; f < files; ++f) {
    data::TFRecordWriter w(dir / ("shard-" + std::to_string(f) + ".tfrecord"),
                           data::Compression::None);
    for (int r = 0; r < records + 7 * f; ++r) w.write(make_record(1000 * f + r + 1));
    w.close();
  }
}

data::Schema schema() {
  return data::Schema::pretraining(kT, kP, 1 << 20);
}

data::PipelineOptions options(const TempDir& dir, int64_t rows, int64_t per_row) {
  data::PipelineOptions o;
  o.files = dir / "shard-*.tfrecord";
  o.batch_size = rows;
  o.pack_per_row = per_row;
  o.cycle_length = 3;
  o.block_length = 4;
  o.shuffle_buffer = 40;
  o.seed = 7;
  return o;
}

std::pair<int64_t, int64_t> size_of(const data::Batch& b, int64_t e) {
  return data::instance_size(b.input_mask.data() + e * b.T, b.T,
                             b.masked_lm_positions.data() + e * b.P,
                             b.masked_lm_weights.data() + e * b.P, b.P);
}

// The uids of the batches, batch by batch.
std::vector<std::vector<int32_t>> batches(data::Pipeline& p, int n = 1 << 20) {
  std::vector<std::vector<int32_t>> out;
  data::Batch b;
  for (int i = 0; i < n && p.next(b); ++i) {
    out.emplace_back();
    for (int64_t e = 0; e < b.B; ++e) out.back().push_back(b.input_ids[e * b.T]);
  }
  return out;
}

TEST(PackedPipeline, EveryInstanceOnceInStreamOrderAndEachBatchAsFullAsTheRuleAllows) {
  TempDir dir;
  write_shards(dir, 3, 40);
  data::PipelineOptions o = options(dir, 4, 3);
  o.epochs = 1;
  o.drop_remainder = false;
  // The stream itself: the same options a batch at a time, unpacked.
  data::PipelineOptions one = o;
  one.pack_per_row = 0;
  one.batch_size = 1;
  data::Pipeline ref(one, schema());
  std::vector<int32_t> stream;
  for (const auto& b : batches(ref)) stream.push_back(b[0]);
  ASSERT_EQ(stream.size(), 3u * 40 + 7 + 14);

  data::Pipeline p(o, schema());
  std::vector<data::Batch> got;
  data::Batch b;
  while (p.next(b)) got.push_back(b);
  std::vector<int32_t> flat;
  int64_t instances = 0, tokens = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const data::Batch& x = got[i];
    EXPECT_EQ(x.packed_rows, 4);
    RowPacker fit({4, kT, 3, 4 * kP});
    for (int64_t e = 0; e < x.B; ++e) {
      flat.push_back(x.input_ids[e * kT]);
      const auto [len, preds] = size_of(x, e);
      EXPECT_TRUE(fit.take(len, preds)) << "batch " << i << " does not fit its rows";
      tokens += len;
    }
    instances += x.B;
    if (i + 1 < got.size()) {  // the next batch's first instance fits nowhere in this one
      const auto [len, preds] = size_of(got[i + 1], 0);
      EXPECT_FALSE(fit.take(len, preds)) << "batch " << i << " closed early";
    }
  }
  EXPECT_EQ(flat, stream);
  // Packed: more instances per batch than rows, and the rows fuller than a row per instance
  // (these instances fill 56% of a row on average, 9 of 16 tokens).
  EXPECT_GT(instances, static_cast<int64_t>(got.size()) * 4);
  EXPECT_GT(static_cast<double>(tokens) / (got.size() * 4 * kT), 0.56 + 0.1);
  EXPECT_EQ(p.position().examples, stream.size());
}

TEST(PackedPipeline, ResumesExactly) {
  TempDir dir;
  write_shards(dir, 3, 40);
  const data::PipelineOptions o = options(dir, 3, 3);
  data::Pipeline full(o, schema());
  const auto ref = batches(full, 30);  // more than an epoch
  for (int cut : {1, 6, 13, 22}) {
    data::Pipeline a(o, schema());
    auto got = batches(a, cut);
    const data::PipelinePosition pos = a.position();
    uint64_t read = 0;
    for (const auto& x : got)
      if (pos.epoch == 0) read += x.size();
    if (pos.epoch == 0) EXPECT_EQ(pos.examples, read);
    data::Pipeline b(o, schema(), pos);
    const auto rest = batches(b, 30 - cut);
    got.insert(got.end(), rest.begin(), rest.end());
    EXPECT_EQ(got, ref) << "cut after " << cut << " batches";
  }
}

TEST(PackedPipeline, ResumeOnAnotherRankCountReadsEveryInstanceOnce) {
  TempDir dir;
  write_shards(dir, 4, 30);
  data::PipelineOptions o = options(dir, 2, 3);
  o.epochs = 1;
  o.drop_remainder = false;
  std::vector<std::string> files = data::list_files(o.files);
  std::vector<uint64_t> counts;
  for (const auto& f : files) counts.push_back(data::count_records(f));
  const data::StreamSizes sizes(files, counts, o.seed, o.shuffle);
  // 2 ranks read 5 packed batches each, then 3 ranks read the rest of the epoch.
  std::multiset<int32_t> read;
  std::vector<data::PipelinePosition> pos;
  for (int r = 0; r < 2; ++r) {
    data::PipelineOptions q = o;
    q.rank = r;
    q.world = 2;
    data::Pipeline p(q, schema());
    for (const auto& x : batches(p, 5)) read.insert(x.begin(), x.end());
    pos.push_back(p.position());
    EXPECT_GT(pos.back().examples, 10u);
  }
  const data::Remap m = data::remap_positions(pos, 2, 3, 2, sizes, /*packed=*/true);
  EXPECT_EQ(m.dropped, 0u);
  for (int r = 0; r < 3; ++r) {
    data::PipelineOptions q = o;
    q.rank = r;
    q.world = 3;
    data::Pipeline p(q, schema(), m.positions[r]);
    for (const auto& x : batches(p)) read.insert(x.begin(), x.end());
  }
  std::multiset<int32_t> all;
  for (int f = 0; f < 4; ++f)
    for (int r = 0; r < 30 + 7 * f; ++r) all.insert(1000 * f + r + 1);
  EXPECT_EQ(read, all) << "every instance of the epoch exactly once";
}

TEST(PackedPipeline, FineTuningRecordsAreNotPacked) {
  TempDir dir;
  write_shards(dir, 1, 5);
  data::PipelineOptions o = options(dir, 2, 3);
  EXPECT_THROW(data::Pipeline(o, data::Schema::classification(kT, 2, 1 << 20)), Error);
}

// ---- the model ----

using model::Batch;
using model::BertModel;
using model::Head;
using model::ModelDims;

model::BertConfig config(float dropout) {
  model::BertConfig c = test::small_bert(60, 32, 2, 4, 64, 32);
  c.hidden_dropout_prob = dropout;
  c.attention_probs_dropout_prob = dropout;
  return c;
}

// Instances of the given real lengths, T tokens each, P prediction slots (the weighted ones
// vary per instance, as create_pretraining_data's do).
Batch instances(const std::vector<int>& lengths, int64_t T, int64_t P) {
  const int64_t n = static_cast<int64_t>(lengths.size());
  Batch b;
  b.resize(n, T, P);
  for (int64_t e = 0; e < n; ++e) {
    const int64_t len = lengths[e];
    for (int64_t t = 0; t < len; ++t) {
      b.input_ids[e * T + t] = static_cast<int32_t>(1 + (e * 11 + t * 5) % 59);
      b.input_mask[e * T + t] = 1;
      b.segment_ids[e * T + t] = t > len / 2;
    }
    for (int64_t j = 0; j < std::min<int64_t>(P, 1 + len / 8); ++j) {
      b.masked_lm_positions[e * P + j] = static_cast<int32_t>(1 + (j * 3 + e) % (len - 1));
      b.masked_lm_ids[e * P + j] = static_cast<int32_t>(2 + (e * 7 + j) % 50);
      b.masked_lm_weights[e * P + j] = 1.0f;
    }
    b.next_sentence_labels[e] = static_cast<int32_t>((e / 2) % 2);
  }
  return b;
}

struct Outputs {
  model::Losses losses;
  std::vector<float> grads, rows, nsp, mlm;  // rows: real positions' output; mlm: weighted rows
};

Outputs run(const Batch& b, int64_t pack_rows, const model::StepOptions& opt, float dropout,
            bool unpadded = true) {
  ModelDims d;
  d.batch = b.B;
  d.seq_len = b.T;
  d.max_predictions = b.P;
  d.unpadded = unpadded;
  d.pack_rows = pack_rows;
  BertModel m(config(dropout), Head::Pretraining, d);
  m.init_params(3);
  m.zero_grads();
  Outputs r;
  r.losses = m.forward(b, opt);
  const int64_t C = m.config().hidden_size, V = m.config().vocab_size;
  for (int64_t e = 0; e < b.B; ++e)
    for (int64_t t = 0; t < b.T && b.input_mask[e * b.T + t]; ++t) {
      const int64_t row = m.sequence_row(e, t);
      r.rows.insert(r.rows.end(), m.sequence_output() + row * C,
                    m.sequence_output() + (row + 1) * C);
    }
  r.nsp.assign(m.nsp_logits(), m.nsp_logits() + 2 * b.B);
  int64_t k = 0;  // unpadded: the logits hold the weighted predictions only
  for (int64_t i = 0; i < b.B * b.P; ++i)
    if (b.masked_lm_weights[i] != 0.0f) {
      const float* row = m.mlm_logits() + (unpadded ? k++ : i) * V;
      r.mlm.insert(r.mlm.end(), row, row + V);
    }
  if (opt.training) {
    m.backward(b, opt, 1.0f);
    r.grads.assign(m.grads(), m.grads() + m.table().total());
  }
  return r;
}

// 9 instances of 4..26 tokens, 124 real tokens: 4 packed rows of 32, at most 3 each, hold them
// ({26, 5}, {24, 8}, {21, 11}, {18, 7, 4}).
const std::vector<int> kLengths = {24, 7, 5, 18, 11, 4, 21, 26, 8};

void expect_same(const Outputs& a, const Outputs& b, const model::ParamTable& table) {
  const double rtol = 1e-4, atol = 1e-5;
  EXPECT_NEAR(a.losses.loss, b.losses.loss, 1e-5 * std::fabs(b.losses.loss));
  EXPECT_NEAR(a.losses.mlm_loss, b.losses.mlm_loss, 1e-5 * std::fabs(b.losses.mlm_loss));
  EXPECT_NEAR(a.losses.nsp_loss, b.losses.nsp_loss, 1e-5 * std::fabs(b.losses.nsp_loss));
  EXPECT_EQ(a.losses.mlm_weight, b.losses.mlm_weight);
  EXPECT_EQ(a.losses.mlm_correct, b.losses.mlm_correct);
  EXPECT_EQ(a.losses.nsp_correct, b.losses.nsp_correct);
  EXPECT_EQ(a.losses.real_tokens, b.losses.real_tokens);
  ASSERT_EQ(a.rows.size(), b.rows.size());
  EXPECT_TRUE(test::all_close("outputs", a.rows.data(), b.rows.data(), b.rows.size(), rtol, atol));
  EXPECT_TRUE(test::all_close("nsp logits", a.nsp.data(), b.nsp.data(), b.nsp.size(), rtol, atol));
  ASSERT_EQ(a.mlm.size(), b.mlm.size());
  EXPECT_TRUE(test::all_close("mlm logits", a.mlm.data(), b.mlm.data(), b.mlm.size(), rtol, atol));
  for (const auto& p : table.params())
    EXPECT_TRUE(test::all_close("grad " + p.name, a.grads.data() + p.offset,
                                b.grads.data() + p.offset, p.numel(), rtol, atol, 1e-9));
}

TEST(PackedModel, EqualsTheInstancesUnpackedLossesGradientsAndOutputs) {
  Batch b = instances(kLengths, 32, 6);
  for (float dropout : {0.0f, 0.2f}) {
    SCOPED_TRACE(str("dropout ", dropout));
    const model::StepOptions opt{true, 11, 3, 18};  // a rank's example offset
    const Outputs padded = run(b, 0, opt, dropout, /*unpadded=*/false);
    const Outputs unpadded = run(b, 0, opt, dropout);
    b.packed_rows = 4;
    const Outputs packed = run(b, 4, opt, dropout);
    b.packed_rows = 0;
    const model::ParamTable table(config(dropout), Head::Pretraining);
    expect_same(packed, unpadded, table);
    expect_same(packed, padded, table);
    EXPECT_EQ(packed.losses.computed_tokens, 128);  // 124 rounded up to 64: the 4 rows
  }
}

TEST(PackedModel, EachInstanceComputesWhatItComputesAlone) {
  Batch b = instances(kLengths, 32, 6);
  b.packed_rows = 4;
  const model::StepOptions eval{false, 0, 0, 0};
  const Outputs packed = run(b, 4, eval, 0.0f);
  const int64_t C = config(0).hidden_size, V = config(0).vocab_size;
  int64_t row = 0, pred = 0;
  for (size_t e = 0; e < kLengths.size(); ++e) {
    SCOPED_TRACE(str("instance ", e));
    Batch one = instances({kLengths[e]}, 32, 6);
    // The same instance content as in the batch (ids depend on its index there).
    for (int64_t t = 0; t < 32; ++t) one.input_ids[t] = b.input_ids[e * 32 + t];
    for (int64_t j = 0; j < 6; ++j) {
      one.masked_lm_positions[j] = b.masked_lm_positions[e * 6 + j];
      one.masked_lm_ids[j] = b.masked_lm_ids[e * 6 + j];
      one.masked_lm_weights[j] = b.masked_lm_weights[e * 6 + j];
    }
    one.next_sentence_labels[0] = b.next_sentence_labels[e];
    const Outputs alone = run(one, 0, eval, 0.0f);
    const int64_t n = kLengths[e] * C;
    EXPECT_TRUE(
        test::all_close("outputs", packed.rows.data() + row, alone.rows.data(), n, 1e-4, 1e-5));
    EXPECT_TRUE(
        test::all_close("nsp logits", packed.nsp.data() + 2 * e, alone.nsp.data(), 2, 1e-4, 1e-5));
    EXPECT_TRUE(test::all_close("mlm logits", packed.mlm.data() + pred, alone.mlm.data(),
                                alone.mlm.size(), 1e-4, 1e-5));
    row += n;
    pred += static_cast<int64_t>(alone.mlm.size());
  }
  EXPECT_EQ(pred, static_cast<int64_t>(packed.mlm.size()));
  EXPECT_EQ(pred % V, 0);
}

TEST(PackedModel, ABatchOverItsRowsOrOnAnUnpackedModelIsAClearError) {
  Batch b = instances(kLengths, 32, 6);
  b.packed_rows = 3;
  try {
    run(b, 3, {false, 0, 0, 0}, 0.0f);  // 124 real tokens, 96 planned
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("124 real tokens, more than the 96 planned"),
              std::string::npos)
        << e.what();
  }
  b.packed_rows = 4;
  try {
    run(b, 0, {false, 0, 0, 0}, 0.0f);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs a model planned for packing"), std::string::npos)
        << e.what();
  }
  ModelDims d;
  d.batch = 2;
  d.pack_rows = 4;  // fewer instances than rows, and padded
  EXPECT_THROW(BertModel(config(0), Head::Pretraining, d), Error);
}

}  // namespace
}  // namespace bertrain
