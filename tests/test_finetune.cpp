// Fine-tuning and prediction on the bundled ChnSentiCorp subset (real Chinese reviews).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/isa.h"
#include "core/safetensors.h"
#include "data/example.h"
#include "data/tfrecord.h"
#include "model/checkpoint.h"
#include "own_memory_backend.h"
#include "prep/pretraining.h"
#include "prep/unicode.h"
#include "tasks/ner.h"
#include "tasks/qa.h"
#include "test_util.h"
#include "train/finetune.h"
#include "train/metrics.h"
#include "train/predict.h"
#include "train/run_state.h"

namespace bertrain::train {
namespace {
using namespace tasks;  // the task files under test

std::string root(const std::string& rel) {
  return test::data_path("../" + rel);
}

TEST(Finetune, TsvReadingTokenizesAndTruncatesPairs) {
  test::TempDir tmp;
  std::ofstream(tmp / "pairs.tsv")
      << "label\ttext_a\ttext_b\npos\tthe cat sat on the mat\ta dog\nneg\tx\ty z\n";
  prep::Vocab v = prep::Vocab::load(root("data/vocab/bert-base-uncased-vocab.txt"));
  prep::Tokenizer tok(v, true);
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
  const prep::Vocab en = prep::Vocab::load(root("data/vocab/bert-base-uncased-vocab.txt"));
  const prep::Tokenizer tok(en, true);
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
      read_task_file(dir + "qnli_dev_head40.tsv",
                     TaskColumns{"question", "sentence", "label", false, false, ""}, tok, 128, {});
  EXPECT_EQ(by_flags.ids, qnli.ids);
  EXPECT_EQ(by_flags.labels, qnli.labels);

  const prep::Vocab zh = prep::Vocab::load(root("data/vocab/bert-base-chinese-vocab.txt"));
  const prep::Tokenizer tzh(zh, true);
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
  const prep::Vocab v = prep::Vocab::load(f.vocab);
  const prep::Tokenizer tok(v, true);
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
  prep::Vocab v = prep::Vocab::load(tmp / "ft/vocab.txt");
  prep::Tokenizer tok(v, true);
  LabeledSet train_set = read_tsv(f.train, tok, 32, {"0", "1"});
  std::vector<Prediction> preds;
  EXPECT_GT(classify(m, train_set, 16, &preds), 0.85);
  EXPECT_EQ(preds.size(), 500u);
}

// Two fine-tuning jobs on one --output: the second stops naming the first (as train does).
TEST(Finetune, ASecondJobOnAnOutputDirectoryStopsNamingTheFirst) {
  test::TempDir tmp;
  FinetuneConfig f = tiny_run(tmp);
  f.output = tmp / "ft";
  RunDirLock first(f.output);
  const std::string e = test::error_of([&] { finetune(f); });
  EXPECT_NE(e.find(f.output + " is in use by another job (host "), std::string::npos) << e;
  EXPECT_NE(e.find(", pid " + std::to_string(getpid()) + ", started "), std::string::npos) << e;
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
using namespace tasks;  // the task files under test

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

// Pearson and Spearman against scipy.stats (tools/make_metrics_golden.py): real STS-B gold
// scores against a noisy copy, ties on both sides, a negative correlation, and a constant
// prediction (NaN, as scipy). Both are a few hundred double operations: 1e-12.
TEST(Metrics, PearsonAndSpearmanEqualScipy) {
  std::ifstream in(test::data_path("golden/metrics/regression.json"));
  const nlohmann::json g = nlohmann::json::parse(in);
  ASSERT_EQ(g["cases"].size(), 4u);
  for (const auto& c : g["cases"]) {
    const auto x = c["x"].get<std::vector<double>>(), y = c["y"].get<std::vector<double>>();
    const std::string name = c["name"];
    if (c["pearson"].is_null()) {
      EXPECT_TRUE(std::isnan(pearson(x, y))) << name;
      EXPECT_TRUE(std::isnan(spearman(x, y))) << name;
      continue;
    }
    EXPECT_NEAR(pearson(x, y), c["pearson"].get<double>(), 1e-12) << name;
    EXPECT_NEAR(spearman(x, y), c["spearman"].get<double>(), 1e-12) << name;
  }
  EXPECT_EQ(average_ranks({3, 1, 3, 2}), (std::vector<double>{3.5, 1, 3.5, 2}));
}

// STS-B as GLUE distributes it (--task stsb: sentence1, sentence2, score; an unbalanced quote
// in the dev rows read as text): scores become regression targets; a label that is not a
// number is an error naming the line.
TEST(Finetune, StsbReadsScoresAsRegressionTargets) {
  prep::Vocab v = prep::Vocab::load(root("data/vocab/bert-base-uncased-vocab.txt"));
  prep::Tokenizer tok(v, true);
  const LabeledSet s = read_task_file(test::data_path("data/tasks/stsb_dev_head300.tsv"),
                                      task_columns("stsb"), tok, 64, {});
  ASSERT_EQ(s.ids.size(), 300u);
  EXPECT_TRUE(s.regression);
  ASSERT_EQ(s.targets.size(), 300u);
  EXPECT_FLOAT_EQ(s.targets[0], 5.0f);
  EXPECT_FLOAT_EQ(s.targets[1], 4.75f);
  EXPECT_TRUE(s.label_names.empty());
  EXPECT_EQ(s.segments[0].back(), 1);  // sentence pairs
  test::TempDir tmp;
  std::ofstream(tmp / "bad.tsv") << "sentence1\tsentence2\tscore\na\tb\t3.2\nc\td\thigh\n";
  const LabeledSet bad = read_task_file(tmp / "bad.tsv", task_columns("stsb"), tok, 16, {});
  EXPECT_EQ(bad.targets, std::vector<float>{3.2f});
  EXPECT_EQ(bad.skipped, 1);
  EXPECT_NE(bad.skipped_summary("bad.tsv").find("bad.tsv:3: label 'high' is not a number"),
            std::string::npos)
      << bad.skipped_summary("bad.tsv");
}

// Rows that cannot be used are counted and reported with file:line, and the rest still line up
// (labels with their texts); a file with no usable row at all is an error naming the first.
TEST(Finetune, UnusableRowsAreCountedNotFatalOrMisaligned) {
  prep::Vocab v = prep::Vocab::load(root("data/vocab/bert-base-uncased-vocab.txt"));
  prep::Tokenizer tok(v, true);
  test::TempDir tmp;
  std::ofstream(tmp / "rows.tsv") << "label\ttext_a\ttext_b\n"
                                  << "pos\tgood one\tyes\n"
                                  << "neg\tonly two columns\n"
                                  << "neg\tbad one\tno\n";
  LabeledSet s = read_task_file(tmp / "rows.tsv", {}, tok, 16, {});
  ASSERT_EQ(s.ids.size(), 2u);
  EXPECT_EQ(s.labels, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(s.skipped_rows, std::vector<int64_t>{1});
  EXPECT_NE(s.skipped_summary("rows.tsv").find("rows.tsv:3: 2 columns, the header has 3"),
            std::string::npos)
      << s.skipped_summary("rows.tsv");
  // Dev labels the training set never had.
  s = read_task_file(tmp / "rows.tsv", {}, tok, 16, {"pos"});
  EXPECT_EQ(s.ids.size(), 1u);
  EXPECT_EQ(s.skipped, 2);
  std::ofstream(tmp / "rows.jsonl") << "{\"text\": \"fine\", \"label\": \"a\"}\n"
                                    << "{\"text\": \"broken\"\n"
                                    << "{\"label\": \"b\"}\n"
                                    << "{\"text\": \"also fine\", \"label\": \"b\"}\n";
  s = read_task_file(tmp / "rows.jsonl", {}, tok, 16, {});
  EXPECT_EQ(s.ids.size(), 2u);
  EXPECT_EQ(s.labels, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(s.skipped_rows, (std::vector<int64_t>{1, 2}));
  EXPECT_NE(s.skipped_summary("j").find("rows.jsonl:3: no 'text' key"), std::string::npos)
      << s.skipped_summary("j");
  std::ofstream(tmp / "none.tsv") << "label\ttext_a\ttext_b\nx\ty\n";
  try {
    read_task_file(tmp / "none.tsv", {}, tok, 16, {});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no usable examples (1 rows skipped; first: "),
              std::string::npos)
        << e.what();
  }
}

// prepare --task: a task file as classification TFRecords (run_classifier.py's schema) and
// labels.txt; reading them back gives the text path's examples and label names exactly.
TEST(Finetune, TaskFileAsClassificationTfRecordsReadsBackTheSame) {
  prep::Vocab v = prep::Vocab::load(root("data/vocab/bert-base-uncased-vocab.txt"));
  prep::Tokenizer tok(v, true);
  const LabeledSet text = read_task_file(test::data_path("data/tasks/qnli_dev_head40.tsv"),
                                         task_columns("qnli"), tok, 64, {});
  test::TempDir tmp;
  const auto files =
      write_classification_tfrecords(text, 64, tmp / "one", 1, data::Compression::None);
  ASSERT_EQ(files.size(), 1u);
  const LabeledSet back = read_classification_tfrecords(tmp / "one/*.tfrecord", 64, 2, v.size());
  EXPECT_EQ(back.label_names, text.label_names);  // from labels.txt: entailment, not_entailment
  EXPECT_EQ(back.ids, text.ids);
  EXPECT_EQ(back.segments, text.segments);
  EXPECT_EQ(back.labels, text.labels);
  // Sharded and gzipped: every example once.
  const auto shards =
      write_classification_tfrecords(text, 64, tmp / "three", 3, data::Compression::Gzip);
  ASSERT_EQ(shards.size(), 3u);
  const LabeledSet sharded =
      read_classification_tfrecords(tmp / "three/*.tfrecord.gz", 64, 2, v.size());
  EXPECT_EQ(sharded.ids.size(), text.ids.size());
  // A regression task's scores are written as a float label_ids (ALBERT's sts-b records), not
  // truncated to integers, and read back as the same regression set.
  const LabeledSet sts = read_task_file(test::data_path("data/tasks/stsb_dev_head300.tsv"),
                                        task_columns("stsb"), tok, 64, {});
  ASSERT_TRUE(sts.regression);
  write_classification_tfrecords(sts, 64, tmp / "sts", 2, data::Compression::None);
  EXPECT_FALSE(std::filesystem::exists(tmp / "sts/labels.txt"));
  const LabeledSet sts_back =
      read_classification_tfrecords(tmp / "sts/*.tfrecord", 64, 0, v.size());
  EXPECT_TRUE(sts_back.regression);
  ASSERT_EQ(sts_back.targets.size(), sts.targets.size());
  // Two shards, round-robin: file 0 holds the even examples, then file 1 the odd ones.
  for (size_t i = 0; i < sts.targets.size(); ++i) {
    const size_t j = i % 2 == 0 ? i / 2 : (sts.targets.size() + 1) / 2 + i / 2;
    EXPECT_EQ(sts_back.targets[j], sts.targets[i]) << i;
    EXPECT_EQ(sts_back.ids[j], sts.ids[i]) << i;
  }
  const data::Example first = data::decode_example(std::string([&] {
    data::TFRecordReader r(tmp / "sts/part-00000-of-00002.tfrecord", data::Compression::None);
    std::string rec;
    r.next(rec);
    return rec;
  }()));
  EXPECT_EQ(first.at("label_ids").kind, data::FeatureKind::Float);
}

// Entity tagging: CLUENER (its first 2000 training sentences) from the small pretrained fixture,
// a token classifier on every character. Tagging everything "O" (the majority tag) finds no
// entity: F1 0. Measured here: dev entity F1 0.20 (precision 0.16, recall 0.28) after 8 epochs.
// The saved directory predicts the same tags.
// A tagger fine-tuned from a fixture for 8 epochs (seq 64, batch 16, lr 4e-3); prints its dev
// entity F1 per epoch.
FinetuneResult finetune_tagger(FinetuneConfig& f, const std::string& fixture,
                               const std::string& vocab, const std::string& task,
                               const std::string& train, const std::string& dev,
                               const std::string& out) {
  f.init_checkpoint = test::data_path("data/pretrained/" + fixture);
  f.vocab = root("data/vocab/" + vocab);
  f.train = test::data_path("data/tasks/" + train);
  f.dev = test::data_path("data/tasks/" + dev);
  f.columns = task_columns(task);
  f.seq_len = 64;
  f.batch_size = 16;
  f.epochs = 8;
  f.lr = 4e-3;
  f.output = out;
  f.quiet = true;
  const FinetuneResult r = finetune(f);
  std::printf("dev entity F1 per epoch:");
  for (double x : r.dev_f1) std::printf(" %.3f", x);
  std::printf("\n");
  return r;
}

TEST(Finetune, CluenerTaggingFindsEntities) {
  test::TempDir tmp;
  FinetuneConfig f;
  const FinetuneResult r =
      finetune_tagger(f, "zh-h64", "bert-base-chinese-vocab.txt", "cluener",
                      "cluener_train_head2000.json", "cluener_dev_head200.json", tmp / "out");
  ASSERT_EQ(r.dev_f1.size(), 8u);
  EXPECT_GE(r.dev_f1.back(), 0.12);
  std::ifstream in(tmp / "out/config.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["architectures"][0], "BertForTokenClassification");
  EXPECT_EQ(j["id2label"]["0"], "O");
  std::vector<std::string> names;
  for (size_t i = 0; i < j["id2label"].size(); ++i)
    names.push_back(j["id2label"][std::to_string(i)]);
  model::BertModel m(model::BertConfig::load(tmp / "out/config.json"),
                     model::Head::TokenClassification, {16, 64, 0});
  model::load_safetensors_into(m, tmp / "out/model.safetensors");
  prep::Vocab v = prep::Vocab::load(f.vocab);
  prep::Tokenizer tok(v, true);
  const TaggedSet dev = read_tagged_file(f.dev);
  const TokenSet t = encode_tagged(dev, tok, 64, names);
  std::vector<std::vector<std::string>> gold;
  for (const auto& s : dev.sentences) gold.push_back(s.tags);
  EXPECT_NEAR(entity_scores(gold, predict_tags(m, dev, t, 16)).f1, r.dev_f1.back(), 1e-12);
}

// English entity tagging: CoNLL-2003 (284 sentences of its test file to train on, the first 128
// of its dev file to score) from the small English fixture (en-h64, uncased: the tagger cannot
// lean on capitals). Tagging everything "O" finds no entity: F1 0. Measured here: dev entity F1
// 0.24 (precision 0.23, recall 0.26) after 8 epochs.
TEST(Finetune, ConllEnglishTaggingFindsEntities) {
  test::TempDir tmp;
  FinetuneConfig f;
  const FinetuneResult r =
      finetune_tagger(f, "en-h64", "bert-base-uncased-vocab.txt", "conll",
                      "conll2003_test_head.txt", "conll2003_valid_head2000.txt", tmp / "out");
  ASSERT_EQ(r.dev_f1.size(), 8u);
  EXPECT_GE(r.dev_f1.back(), 0.15);
  std::ifstream in(tmp / "out/config.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["architectures"][0], "BertForTokenClassification");
  std::set<std::string> tags;
  for (const auto& [id, name] : j["id2label"].items()) tags.insert(name.get<std::string>());
  for (const char* t : {"O", "B-PER", "I-PER", "B-LOC", "B-ORG", "B-MISC"})
    EXPECT_TRUE(tags.count(t)) << t;
}

// Extractive QA: CMRC 2018 questions from the small pretrained fixture, in windows of 128 tokens.
// The fixture (2 layers of 64, 400 pretraining steps) does not generalise to unseen CMRC
// questions (dev F1 5-8 against 6.4-7.1 for a random 19-character span), nor does a 4 x 128 one
// pretrained 2500 steps here, and transformers fine-tuned from that same checkpoint on the same
// windows does no better (tools/qa_peer_finetune.py: F1 7.6 / 6.7 / 6.8 against bertrain's
// 7.9 / 7.6 / 7.8): the checkpoint is the limit, not the trainer. So this proves what it can:
// the head learns the training questions' answers (here the dev set is the training set:
// measured EM 26, F1 44 after 10 epochs, against F1 7.8 for random spans of the median answer
// length), the saved directory is HuggingFace's BertForQuestionAnswering with the window
// settings, and it predicts the same answers.
TEST(Finetune, CmrcQuestionAnsweringLearnsItsAnswers) {
  test::TempDir tmp;
  // The first 150 questions of the CMRC 2018 dev excerpt, in its own layout.
  nlohmann::json d;
  std::ifstream(test::data_path("data/tasks/cmrc2018_dev_head.json")) >> d;
  nlohmann::json few = d;
  few["data"] = nlohmann::json::array();
  size_t questions = 0;
  for (const auto& a : d["data"]) {
    if (questions >= 150) break;
    few["data"].push_back(a);
    for (const auto& p : a["paragraphs"]) questions += p["qas"].size();
  }
  std::ofstream(tmp / "train.json") << few.dump();
  FinetuneConfig f;
  f.init_checkpoint = test::data_path("data/pretrained/zh-h64");
  f.vocab = root("data/vocab/bert-base-chinese-vocab.txt");
  f.train = f.dev = tmp / "train.json";
  f.columns = task_columns("cmrc2018");
  f.seq_len = 128;
  f.qa.max_query_length = 32;
  f.batch_size = 32;
  f.epochs = 10;
  f.lr = 3e-3;
  f.output = tmp / "out";
  f.quiet = true;
  const FinetuneResult r = finetune(f);
  ASSERT_EQ(r.dev_qa_f1.size(), 10u);
  std::printf("training questions' EM / F1 per epoch:");
  for (size_t i = 0; i < r.dev_qa_f1.size(); ++i)
    std::printf(" %.1f/%.1f", r.dev_exact_match[i], r.dev_qa_f1[i]);
  std::printf("\n");
  // A random span of the median answer length, scored the same way.
  const QaSet s = read_squad(f.dev, false);
  std::vector<std::string> random_spans;
  prep::Rng rng(7);
  for (const auto& e : s.examples) {
    std::u32string ctx;
    prep::unicode::decode(e.context, ctx);
    const size_t len = 19;
    const auto at = static_cast<size_t>(
        rng.randint(0, std::max<int64_t>(0, static_cast<int64_t>(ctx.size()) - 20)));
    std::string out;
    prep::unicode::encode(std::u32string_view(ctx).substr(at, len), out);
    random_spans.push_back(out);
  }
  const double random_f1 = cmrc_scores(s, random_spans).f1;
  std::printf("random 19-character spans: F1 %.1f\n", random_f1);
  EXPECT_GE(r.dev_qa_f1.back(), random_f1 + 20);
  EXPECT_GE(r.dev_exact_match.back(), 15.0);
  std::ifstream in(tmp / "out/config.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["architectures"][0], "BertForQuestionAnswering");
  EXPECT_EQ(j["bertrain"]["qa"]["metric"], "cmrc2018");
  EXPECT_EQ(j["bertrain"]["qa"]["doc_stride"], 46);  // auto: half of 128 - 32 - 3
  model::BertModel m(model::BertConfig::load(tmp / "out/config.json"),
                     model::Head::QuestionAnswering, {32, 128, 0});
  model::load_safetensors_into(m, tmp / "out/model.safetensors");
  prep::Vocab v = prep::Vocab::load(f.vocab);
  prep::Tokenizer tok(v, j["bertrain"]["lower_case"].get<bool>());
  QaOptions o;
  o.seq_len = 128;
  o.max_query_length = 32;
  o.metric = "cmrc2018";
  o = resolve_qa_options(o);
  std::vector<std::string> texts;
  for (const auto& a : predict_answers(m, s, make_qa_features(s, tok, o), o, 32))
    texts.push_back(a.text);
  EXPECT_NEAR(cmrc_scores(s, texts).f1, r.dev_qa_f1.back(), 1e-9);
}

// Fine-tuning STS-B (its first 1000 training pairs) from the small pretrained fixture beats the
// trivial predictor: a constant (the training mean) has no correlation and the dev set's
// variance as its error. Measured here: Pearson 0.36, Spearman 0.30, MSE 2.42 vs the
// constant's 2.75.
TEST(Finetune, StsbRegressionBeatsTheConstantPredictor) {
  test::TempDir tmp;
  FinetuneConfig f;
  f.init_checkpoint = test::data_path("data/pretrained/zh-h64");
  f.vocab = root("data/vocab/bert-base-chinese-vocab.txt");
  f.train = test::data_path("data/tasks/stsb_train_head1000.tsv");
  f.dev = test::data_path("data/tasks/stsb_dev_head300.tsv");
  f.columns = task_columns("stsb");
  f.seq_len = 64;
  f.batch_size = 16;
  f.epochs = 6;
  f.lr = 5e-4;
  f.output = tmp / "out";
  f.quiet = true;
  const FinetuneResult r = finetune(f);
  ASSERT_EQ(r.dev_pearson.size(), 6u);
  prep::Vocab v = prep::Vocab::load(f.vocab);
  prep::Tokenizer tok(v, true);
  const LabeledSet train = read_task_file(f.train, f.columns, tok, 64, {});
  const LabeledSet dev = read_task_file(f.dev, f.columns, tok, 64, {});
  double mean = 0, constant_mse = 0;
  for (float t : train.targets) mean += t / train.targets.size();
  for (float t : dev.targets) constant_mse += (t - mean) * (t - mean) / dev.targets.size();
  std::printf("dev pearson %.4f spearman %.4f mse %.4f; constant predictor mse %.4f\n",
              r.dev_pearson.back(), r.dev_spearman.back(), r.dev_mse.back(), constant_mse);
  EXPECT_GE(r.dev_pearson.back(), 0.25);
  EXPECT_GE(r.dev_spearman.back(), 0.2);
  EXPECT_LT(r.dev_mse.back(), 0.95 * constant_mse);
  // The saved directory is HF's regression head, and predict reads it back.
  std::ifstream in(tmp / "out/config.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["id2label"].size(), 1u);  // HF's num_labels
  EXPECT_EQ(j["problem_type"], "regression");
  model::ModelDims dims{16, 64, 0};
  dims.unpadded = true;  // as finetune's dev evaluation and predict run it
  model::BertModel m(model::BertConfig::load(tmp / "out/config.json"),
                     model::Head::SequenceClassification, dims);
  model::load_safetensors_into(m, tmp / "out/model.safetensors");
  const RegressionMetrics again = regress(m, dev, 16, nullptr);
  EXPECT_NEAR(again.pearson, r.dev_pearson.back(), 1e-9);
  // predict --precision bf16: the same model with bf16 matmuls tracks fp32 (measured: Pearson
  // 0.2986 vs 0.2984 on another run): within 0.02.
  BT_SKIP_WITHOUT_BF16();
  model::BertModel m16(model::BertConfig::load(tmp / "out/config.json"),
                       model::Head::SequenceClassification,
                       with_precision({16, 64, 0}, Precision::BF16));
  model::load_safetensors_into(m16, tmp / "out/model.safetensors");
  EXPECT_NEAR(regress(m16, dev, 16, nullptr).pearson, r.dev_pearson.back(), 0.02);
}

}  // namespace
}  // namespace bertrain::train

namespace bertrain::train {
namespace {
using namespace tasks;  // the task files under test

// Fine-tuning on a backend with memory of its own (what --device cuda gives it): each task head
// through BertModel's device path (every kernel handed only that memory; the dev metrics read
// the outputs copied out, host_output) and the same run as on the CPU: equal dev metrics per
// epoch and the same saved model, byte for byte. Small slices of the tasks' files, 2 epochs.
TEST(Finetune, OnABackendWithItsOwnMemoryEqualsTheCpu) {
  test::TempDir tmp;
  const test::OwnMemoryBackend own;
  auto head_lines = [&](const std::string& from, const std::string& to, size_t n) {
    std::ifstream in(from);
    std::ofstream out(tmp / to);
    std::string line;
    for (size_t i = 0; i < n && std::getline(in, line); ++i) out << line << "\n";
    return tmp / to;
  };
  nlohmann::json qa;
  std::ifstream(test::data_path("data/tasks/cmrc2018_dev_head.json")) >> qa;
  qa["data"] = nlohmann::json::array({qa["data"][0], qa["data"][1]});
  std::ofstream(tmp / "qa.json") << qa.dump();
  struct Task {
    std::string name, train, dev, columns;
  };
  const std::vector<Task> tasks = {
      {"classification", root("data/classification/chnsenticorp_small/train.tsv"),
       root("data/classification/chnsenticorp_small/dev.tsv"), ""},
      {"ner",
       head_lines(test::data_path("data/tasks/cluener_train_head2000.json"), "ner.json", 200),
       test::data_path("data/tasks/cluener_dev_head200.json"), "cluener"},
      {"regression",
       head_lines(test::data_path("data/tasks/stsb_train_head1000.tsv"), "sts.tsv", 200),
       test::data_path("data/tasks/stsb_dev_head300.tsv"), "stsb"},
      {"qa", tmp / "qa.json", tmp / "qa.json", "cmrc2018"}};
  for (const Task& t : tasks) {
    SCOPED_TRACE(t.name);
    auto run = [&](const kernels::Backend* be, const std::string& out) {
      FinetuneConfig f;
      f.init_checkpoint = test::data_path("data/pretrained/zh-h64");
      f.vocab = root("data/vocab/bert-base-chinese-vocab.txt");
      f.train = t.train;
      f.dev = t.dev;
      if (!t.columns.empty()) f.columns = task_columns(t.columns);
      f.seq_len = 64;
      f.qa.max_query_length = 16;
      f.batch_size = 16;
      f.epochs = 2;
      f.lr = 1e-3;
      f.output = tmp / out;
      f.quiet = true;
      f.backend = be;
      return finetune(f);
    };
    const FinetuneResult a = run(nullptr, t.name + "-cpu"), b = run(&own, t.name + "-own");
    EXPECT_EQ(a.dev_accuracy, b.dev_accuracy);
    EXPECT_EQ(a.dev_f1, b.dev_f1);
    EXPECT_EQ(a.dev_pearson, b.dev_pearson);
    EXPECT_EQ(a.dev_qa_f1, b.dev_qa_f1);
    EXPECT_EQ(a.dev_exact_match, b.dev_exact_match);
    EXPECT_EQ(test::read_file(tmp / (t.name + "-cpu/model.safetensors")),
              test::read_file(tmp / (t.name + "-own/model.safetensors")));
  }
}

}  // namespace
}  // namespace bertrain::train
