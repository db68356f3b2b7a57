// The fine-tuning task files: sequence classification and regression sets from TSV files (a
// header row naming the columns, e.g. `label<TAB>text_a[<TAB>text_b]`) or JSON lines, tokenized
// as [CLS] a [SEP] b [SEP] (longest-first truncation, as HuggingFace); the columns of the GLUE
// and CLUE tasks as distributed; classification TFRecords in Google's run_classifier.py schema,
// read and written. Token classification (NER) files are in ner.h, extractive QA in qa.h. No
// model here: train/predict.h turns these sets into batches and predictions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/tfrecord.h"
#include "prep/wordpiece.h"

namespace bertrain::tasks {

struct LabeledSet {
  std::vector<std::vector<int32_t>> ids, segments;  // unpadded token ids / segment ids
  std::vector<int32_t> labels;                      // -1 when the file has no label column
  std::vector<std::string> label_names;             // index -> name
  bool regression = false;     // the label is a number (STS-B's score): one output, MSE loss
  std::vector<float> targets;  // regression: the label values (empty when the file has none)
  // Rows that cannot be used (too few columns, not JSON, a missing key, a label that is not a
  // number or not among the training labels) are skipped, counted and reported, never a crash
  // or a silent misalignment: their indices among the file's data rows (predict keeps its
  // output aligned with them) and the first few reasons with file:line.
  int64_t skipped = 0;
  std::vector<int64_t> skipped_rows;
  std::vector<std::string> skipped_reasons;
  // "N unusable rows of FILE skipped (first: ...)", or "" when none were.
  std::string skipped_summary(const std::string& file) const;
};

// Where a task file keeps its texts and label: TSV column names (the header row; no CSV quoting:
// GLUE's files have unbalanced quotes) or JSON-lines keys. Empty text_b: single sentences; empty
// label: the file has none (prediction). All empty: found by name (label; text_a, text or
// sentence; text_b).
struct TaskColumns {
  std::string text_a, text_b, label;
  bool regression = false;  // the label column holds numbers to predict (not class names)
  bool tokens = false;      // token classification (NER): tagged words, not text columns (ner.h)
  std::string qa;           // extractive QA (SQuAD JSON, qa.h): its metric, squad or cmrc2018
  bool empty() const { return text_a.empty() && text_b.empty() && label.empty(); }
};
// The columns of a task as distributed: GLUE's sst2, mrpc, qqp, qnli, rte, wnli, mnli, stsb
// (regression) (TSV) and CLUE's afqmc, tnews, iflytek, cmnli, ocnli (JSON lines); ner (token
// classification: CLUENER-style .json, CoNLL-style otherwise; ner.h), also as cluener and conll;
// squad, cmrc2018 and drcd (extractive QA from SQuAD-layout JSON, scored by the official SQuAD
// v1.1 or CMRC 2018 evaluation; qa.h). Unknown names list the known ones.
TaskColumns task_columns(const std::string& task);
// "N unusable <what>s of FILE skipped, not used:" and the reasons kept (shared by the readers).
std::string skipped_summary(int64_t skipped, const std::vector<std::string>& reasons,
                            const std::string& file, const char* what);
std::string known_tasks();

// Reads a task file: JSON lines when it ends in .json or .jsonl, TSV otherwise. `label_names`
// fixes the label order (from training data or a model); when empty it is built from the file:
// integers in numeric order, otherwise strings sorted.
LabeledSet read_task_file(const std::string& path, const TaskColumns& columns,
                          const prep::Tokenizer& tok, int64_t seq_len,
                          std::vector<std::string> label_names);
// read_task_file with the columns found by name.
LabeledSet read_tsv(const std::string& path, const prep::Tokenizer& tok, int64_t seq_len,
                    std::vector<std::string> label_names);
// Classification TFRecords (one pass). The label names (and their number) come from a
// labels.txt beside the first file when there is one (prepare --task writes it), else 0..n-1.
LabeledSet read_classification_tfrecords(const std::string& files, int64_t seq_len,
                                         int64_t num_labels, int64_t vocab_size);
// Writes a labelled set as classification TFRecords in Google's run_classifier.py schema
// (input_ids, input_mask, segment_ids [seq_len], label_ids [1], is_real_example [1]; int64),
// round-robin over `shards` files dir/part-NNNNN-of-NNNNN.tfrecord (atomically), and the label
// names to dir/labels.txt. A regression set (STS-B) writes its score as a float label_ids, as
// ALBERT's classifier_utils does for sts-b, and no labels.txt; reading detects it. Returns the
// files.
std::vector<std::string> write_classification_tfrecords(const LabeledSet& s, int64_t seq_len,
                                                        const std::string& dir, int shards,
                                                        data::Compression compression);

}  // namespace bertrain::tasks
