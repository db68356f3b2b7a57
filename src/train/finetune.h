// Fine-tuning: a pretrained checkpoint (bertrain or HuggingFace) trained on a task's files (read
// by src/tasks/: classification and regression sets, NER, extractive QA) with the shared training
// step; the dev set scored per epoch (accuracy; Pearson/Spearman; seqeval's entity F1; SQuAD or
// CMRC EM/F1); a HuggingFace BertFor<Task> directory saved with the vocabulary and label names.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "data/tfrecord.h"
#include "kernels/backend.h"
#include "model/bert.h"
#include "model/graphs.h"
#include "tasks/qa.h"
#include "tasks/task_files.h"
#include "train/precision.h"

namespace bertrain::train {

struct FinetuneConfig {
  std::string init_checkpoint, train, dev, output, vocab, model_config;
  // An object-store prefix (s3://bucket/models/x, oss://...) the model is published to: `output`
  // is then the local stage. Held by a lease (RunLease) while the job runs; the metrics and
  // events uploaded after every epoch, the model committed at the end (RunMirror::publish_model).
  std::string publish_to;
  double lease_seconds = 120;
  tasks::TaskColumns columns;  // of the train and dev text files (TFRecords carry their own)
  tasks::QaOptions qa;  // extractive QA: windows and answers (seq_len and metric set from here)
  int lower_case = -1;
  int64_t seq_len = 128, batch_size = 32, epochs = 3;
  double lr = 5e-5, warmup = 0.1, weight_decay = 0.01;
  uint64_t seed = 42;
  Precision precision = Precision::FP32;  // fp16: with the dynamic loss scaler, as train
  int64_t max_skipped_steps = 20;  // fp16: consecutive skipped steps before giving up, as train
  bool unpadded = true;            // model::ModelDims::unpadded (question answering always pads)
  bool quiet = false;
  // Data parallel (mpirun): batch_size examples per rank per step, gradients summed by the
  // shared training step; rank 0 prints, logs and saves. Null: one process.
  comm::Communicator* comm = nullptr;
  bool shard_optimizer = false;  // several ranks: each holds 1/ranks of the AdamW state (ZeRO-1)
  // Where the model and the optimizer state live and run (null: the CPU's backend).
  const kernels::Backend* backend = nullptr;
  // The attention kernel (model::ModelDims::attention; auto: on a GPU in bf16/fp16 the full one,
  // whose batches are padded; blocked there runs fused, every sequence on its real tokens).
  model::ModelDims::Attention attention = model::ModelDims::Attention::Auto;
  // On a backend that captures them (a GPU's): forward, backward and the update as CUDA graphs
  // (train::StepSettings::graphs; forward and backward where BertModel::graph_shapes).
  model::GraphMode graphs = model::GraphMode::Auto;
};

struct FinetuneResult {
  std::vector<double> dev_accuracy;  // per epoch (classification)
  std::vector<double> dev_f1;        // per epoch (token classification: seqeval's entity F1)
  std::vector<double> dev_pearson, dev_spearman, dev_mse;  // per epoch (regression)
  std::vector<double> dev_exact_match, dev_qa_f1;          // per epoch (QA; percent)
  double train_loss = 0;
};

FinetuneResult finetune(const FinetuneConfig& cfg);

}  // namespace bertrain::train
