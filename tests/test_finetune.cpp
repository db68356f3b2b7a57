// Fine-tuning and prediction on the bundled ChnSentiCorp subset (real Chinese reviews).
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/isa.h"
#include "core/safetensors.h"
#include "data/example.h"
#include "data/tfrecord.h"
#include "model/checkpoint.h"
#include "test_util.h"
#include "train/finetune.h"

namespace bertrain::train {
namespace {

std::string root(const std::string& rel) {
  return test::data_path("../" + rel);
}

TEST(Finetune, TsvReadingTokenizesAndTruncatesPairs) {
  test::TempDir tmp;
  std::ofstream(tmp / "pairs.tsv")
      << "label\ttext_a\ttext_b\npos\tthe cat sat on the mat\ta dog\nneg\tx\ty z\n";
  data::Vocab v = data::Vocab::load(root("data/vocab/bert-base-uncased-vocab.txt"));
  data::Tokenizer tok(v, true);
  LabeledSet s = read_tsv(tmp / "pairs.tsv", tok, 8, {});
  ASSERT_EQ(s.ids.size(), 2u);
  EXPECT_EQ(s.label_names, (std::vector<std::string>{"neg", "pos"}));
  EXPECT_EQ(s.labels, (std::vector<int32_t>{1, 0}));
  // [CLS] the cat sat [SEP] a dog [SEP]: longest-first truncation to 8 tokens
  EXPECT_EQ(s.ids[0].size(), 8u);
  EXPECT_EQ(s.ids[0][0], v.cls());
  EXPECT_EQ(s.ids[0][4], v.sep());
  EXPECT_EQ(s.segments[0], (std::vector<int32_t>{0, 0, 0, 0, 0, 1, 1, 1}));
  std::ofstream(tmp / "bad.tsv") << "label\ttext_a\nfoo\tbar\n";
  EXPECT_THROW(read_tsv(tmp / "bad.tsv", tok, 8, {"neg", "pos"}), Error);
  std::ofstream(tmp / "nohdr.tsv") << "1\tsome text\n";
  EXPECT_THROW(read_tsv(tmp / "nohdr.tsv", tok, 8, {}), Error);
}

// A fresh tiny Chinese BERT (1 layer, H32) saved in tmp/init as the "pretrained" model, and a
// fine-tuning run of it on ChnSentiCorp's 500 training reviews (seq 32, batch 16, 6 epochs).
FinetuneConfig tiny_run(const test::TempDir& tmp) {
  model::BertModel init(test::small_bert(21128, 32, 1, 2, 64, 64), model::Head::Pretraining,
                        {1, 1, 0});
  init.init_params(3);
  model::save_pretrained(init, tmp / "init");
  FinetuneConfig f;
  f.init_checkpoint = tmp / "init";
  f.vocab = root("data/vocab/bert-base-chinese-vocab.txt");
  f.train = root("data/classification/chnsenticorp_small/train.tsv");
  f.seq_len = 32;
  f.batch_size = 16;
  f.epochs = 6;
  f.lr = 3e-3;
  f.quiet = true;
  return f;
}

// Train and dev formats are independent: a TSV training set with the same dev set as TSV and
// as classification TFRecords (run_classifier.py's schema) gives the same dev accuracy.
// GLUE and CLUE files as distributed (the first rows of the real dev sets, tests/data/tasks):
// --task reads their columns; a pair file read without it is an error, not a silent
// single-sentence read; column flags name the same columns; unlabelled test files read.
TEST(Finetune, GlueAndClueFilesReadAsDistributed) {
  const data::Vocab en = data::Vocab::load(root("data/vocab/bert-base-uncased-vocab.txt"));
  const data::Tokenizer tok(en, true);
  const std::string dir = test::data_path("data/tasks/");
  const LabeledSet sst =
      read_task_file(dir + "sst2_dev_head40.tsv", task_columns("SST-2"), tok, 64, {});
  ASSERT_EQ(sst.ids.size(), 40u);
  EXPECT_EQ(sst.label_names, (std::vector<std::string>{"0", "1"}));
  std::vector<int32_t> first;  // "it 's a charming and often affecting journey . " (label 1)
  tok.encode("it 's a charming and often affecting journey . ", first);
  first.insert(first.begin(), en.cls());
  first.push_back(en.sep());
  EXPECT_EQ(sst.ids[0], first);
  EXPECT_EQ(sst.labels[0], 1);

  const LabeledSet qnli =
      read_task_file(dir + "qnli_dev_head40.tsv", task_columns("qnli"), tok, 128, {});
  ASSERT_EQ(qnli.ids.size(), 40u);
  EXPECT_EQ(qnli.label_names, (std::vector<std::string>{"entailment", "not_entailment"}));
  EXPECT_EQ(std::count(qnli.labels.begin(), qnli.labels.end(), 0), 22);
  std::vector<int32_t> q;  // the question is text_a, the sentence text_b (segment 1)
  tok.encode("What came into force after the new constitution was herald?", q);
  EXPECT_TRUE(std::equal(q.begin(), q.end(), qnli.ids[0].begin() + 1));
  EXPECT_EQ(qnli.segments[0].back(), 1);
  const std::string pairs =
      test::error_of([&] { read_task_file(dir + "qnli_dev_head40.tsv", {}, tok, 128, {}); });
  EXPECT_NE(pairs.find("looks like sentence pairs"), std::string::npos) << pairs;
  EXPECT_NE(pairs.find("--task"), std::string::npos) << pairs;
  const LabeledSet by_flags =
      read_task_file(dir + "qnli_dev_head40.tsv", {"question", "sentence", "label"}, tok, 128, {});
  EXPECT_EQ(by_flags.ids, qnli.ids);
  EXPECT_EQ(by_flags.labels, qnli.labels);

  const data::Vocab zh = data::Vocab::load(root("data/vocab/bert-base-chinese-vocab.txt"));
  const data::Tokenizer tzh(zh, true);
  const LabeledSet afqmc =
      read_task_file(dir + "afqmc_dev_head40.json", task_columns("afqmc"), tzh, 64, {});
  ASSERT_EQ(afqmc.ids.size(), 40u);
  EXPECT_EQ(afqmc.label_names, (std::vector<std::string>{"0", "1"}));  // JSON strings "0", "1"
  EXPECT_EQ(std::count(afqmc.labels.begin(), afqmc.labels.end(), 1), 13);
  EXPECT_EQ(afqmc.segments[0].back(), 1);

  const LabeledSet test_set =
      read_task_file(dir + "sst2_test_head10.tsv", task_columns("sst2"), tok, 64, sst.label_names);
  ASSERT_EQ(test_set.ids.size(), 10u);
  EXPECT_EQ(test_set.labels, std::vector<int32_t>(10, -1));  // `index, sentence`: no labels
  EXPECT_NE(test::error_of([] { task_columns("nosuch"); }).find("afqmc"), std::string::npos);
}

TEST(Finetune, DevFormatIsItsOwnNotTheTrainingSets) {
  test::TempDir tmp;
  FinetuneConfig f = tiny_run(tmp);
  f.epochs = 1;
  f.dev = root("data/classification/chnsenticorp_small/dev.tsv");
  f.output = tmp / "ft-tsv";
  const FinetuneResult a = finetune(f);
  // The dev TSV as TFRecords.
  const data::Vocab v = data::Vocab::load(f.vocab);
  const data::Tokenizer tok(v, true);
  const LabeledSet dev = read_tsv(f.dev, tok, f.seq_len, {"0", "1"});
  {
    data::TFRecordWriter w(tmp / "dev.tf_record", data::Compression::None);
    for (size_t i = 0; i < dev.ids.size(); ++i) {
      std::vector<int64_t> ids(f.seq_len, 0), mask(f.seq_len, 0), seg(f.seq_len, 0);
      for (size_t t = 0; t < dev.ids[i].size(); ++t) {
        ids[t] = dev.ids[i][t];
        mask[t] = 1;
        seg[t] = dev.segments[i][t];
      }
      data::Example ex;
      ex["input_ids"] = {data::FeatureKind::Int64, ids, {}, {}};
      ex["input_mask"] = {data::FeatureKind::Int64, mask, {}, {}};
      ex["segment_ids"] = {data::FeatureKind::Int64, seg, {}, {}};
      ex["label_ids"] = {data::FeatureKind::Int64, {dev.labels[i]}, {}, {}};
      w.write(data::encode_example(ex));
    }
    w.close();
  }
  f.dev = tmp / "dev.tf_record";
  f.output = tmp / "ft-tf";
  const FinetuneResult b = finetune(f);
  ASSERT_EQ(a.dev_accuracy.size(), 1u);
  ASSERT_EQ(b.dev_accuracy.size(), 1u);
  EXPECT_EQ(a.dev_accuracy[0], b.dev_accuracy[0]);
  EXPECT_EQ(a.train_loss, b.train_loss);
}

TEST(Finetune, LearnsTheTrainingSetAndPredicts) {
  test::TempDir tmp;
  FinetuneConfig f = tiny_run(tmp);
  f.dev = root("data/classification/chnsenticorp_small/dev.tsv");
  f.output = tmp / "ft";
  FinetuneResult r = finetune(f);
  ASSERT_EQ(r.dev_accuracy.size(), 6u);
  EXPECT_LT(r.train_loss, 0.35);  // from ln 2 = 0.69: the classifier fits the reviews
  // The saved model is a HuggingFace BertForSequenceClassification with the label names.
  std::ifstream in(tmp / "ft/config.json");
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["architectures"][0], "BertForSequenceClassification");
  EXPECT_EQ(j["id2label"]["1"], "1");
  EXPECT_TRUE(std::filesystem::exists(tmp / "ft/vocab.txt"));
  model::BertConfig mc = model::BertConfig::load(tmp / "ft/config.json");
  model::BertModel m(mc, model::Head::SequenceClassification, {16, 32, 0});
  model::load_safetensors_into(m, tmp / "ft/model.safetensors");
  data::Vocab v = data::Vocab::load(tmp / "ft/vocab.txt");
  data::Tokenizer tok(v, true);
  LabeledSet train_set = read_tsv(f.train, tok, 32, {"0", "1"});
  std::vector<Prediction> preds;
  EXPECT_GT(classify(m, train_set, 16, &preds), 0.85);
  EXPECT_EQ(preds.size(), 500u);
}

// Fine-tuning in bf16 / fp16 (loss scaled) against the same run in fp32: the 16-bit runs really
// differ, fit the training set as well (final-epoch train loss within 0.05 of fp32's: bf16
// moves every matmul by ~1e-2 relative, fp16 the kept activations by ~5e-4), and the saved
// weights are fp32 masters.
TEST(Finetune, SixteenBitPrecisionsTrackFp32) {
  test::TempDir tmp;
  const FinetuneConfig base = tiny_run(tmp);
  auto run = [&](Precision p) {
    FinetuneConfig f = base;
    f.precision = p;
    f.output = tmp / precision_name(p);
    return finetune(f).train_loss;
  };
  const double fp32 = run(Precision::FP32);
  EXPECT_LT(fp32, 0.35);  // from ln 2: it learns (as LearnsTheTrainingSetAndPredicts)
  std::vector<Precision> others = {Precision::FP16};
  if (test::bf16_unavailable().empty()) others.push_back(Precision::BF16);
  for (Precision p : others) {
    const double l = run(p);
    EXPECT_NE(l, fp32) << precision_name(p);
    EXPECT_NEAR(l, fp32, 0.05) << precision_name(p);
    std::printf("fine-tuning train loss: %s %.4f, fp32 %.4f\n", precision_name(p), l, fp32);
    SafetensorsReader saved(tmp / (std::string(precision_name(p)) + "/model.safetensors"));
    EXPECT_EQ(saved.find("classifier.weight")->dtype, DType::F32) << precision_name(p);
  }
}

// A diverging run stops at the first non-finite gradient with the fix in the message, instead
// of training on (fp16 would skip steps and lower the loss scale first).
TEST(Finetune, DivergenceStopsWithAMessage) {
  test::TempDir tmp;
  FinetuneConfig f = tiny_run(tmp);
  f.lr = 1e30;
  try {
    finetune(f);
    FAIL() << "a run with lr 1e30 finished";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gradients are not finite"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("lower --lr"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace bertrain::train

namespace bertrain::train {
namespace {

// The claim end to end: a small BERT pretrained by bertrain on the bundled CLUE sample
// (tests/data/pretrained/zh-h64, made by tools/make_pretrained_fixture.sh: 400 steps, 2 ranks)
// fine-tuned on ChnSentiCorp's 500 reviews. 33 of the 50 dev reviews are positive, so the
// majority class scores 0.66; the binomial std at n = 50 is 0.067, and 0.80 is 2 std above it.
// The same fine-tuning from a fresh initialisation must do worse: the pretraining is what helps.
// Deterministic (seeded; one thread under ctest).
TEST(Finetune, PretrainedModelBeatsTheMajorityClassAndAFreshInit) {
  auto run = [&](const std::string& init) {
    FinetuneConfig f;
    f.init_checkpoint = init;
    f.vocab = root("data/vocab/bert-base-chinese-vocab.txt");
    f.train = root("data/classification/chnsenticorp_small/train.tsv");
    f.dev = root("data/classification/chnsenticorp_small/dev.tsv");
    f.seq_len = 128;
    f.batch_size = 16;
    f.epochs = 8;
    f.lr = 5e-4;
    f.quiet = true;
    return finetune(f).dev_accuracy;
  };
  const auto pre = run(test::data_path("data/pretrained/zh-h64"));
  test::TempDir tmp;
  model::BertModel fresh(
      model::BertConfig::load(test::data_path("data/pretrained/config-zh-h64.json")),
      model::Head::Pretraining, {1, 1, 0});
  fresh.init_params(42);
  model::save_pretrained(fresh, tmp / "fresh");
  const auto scratch = run(tmp / "fresh");
  std::string a, b;
  for (double x : pre) a += std::to_string(x).substr(0, 4) + " ";
  for (double x : scratch) b += std::to_string(x).substr(0, 4) + " ";
  const double best_pre = *std::max_element(pre.begin(), pre.end());
  const double best_fresh = *std::max_element(scratch.begin(), scratch.end());
  EXPECT_GE(best_pre, 0.80) << "pretrained: " << a;
  EXPECT_GE(pre.back(), 0.76) << "pretrained: " << a;
  EXPECT_GT(best_pre, best_fresh) << "pretrained: " << a << " fresh: " << b;
  std::printf("dev accuracy per epoch: pretrained %s| fresh init %s\n", a.c_str(), b.c_str());
}

}  // namespace
}  // namespace bertrain::train
