// bertrain: pre-train and fine-tune BERT fast, in C++. This file only dispatches; each
// subcommand lives in its own cmd_*.cpp.
#include <omp.h>

#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"

namespace bertrain::cli {

model::Head parse_head(const std::string& s) {
  if (s == "pretraining") return model::Head::Pretraining;
  if (s == "classification") return model::Head::SequenceClassification;
  fail("--head must be pretraining or classification, got '", s, "'");
}

void set_threads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

std::string describe(const model::BertConfig& c) {
  return str("L", c.num_hidden_layers, " H", c.hidden_size, " A", c.num_attention_heads, " I",
             c.intermediate_size, " V", c.vocab_size);
}

// The process's communicator, created on first use (MPI only when a subcommand needs it).
dist::Communicator& communicator() {
  static dist::SingleProcess single;
  return single;
}

}  // namespace bertrain::cli

int main(int argc, char** argv) {
  CLI::App app{
      "bertrain: pre-train and fine-tune BERT fast on CPUs and GPUs, on one machine or many."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "bertrain 0.1.0");
  bertrain::cli::add_estimate(app);
  bertrain::cli::add_init(app);
  bertrain::cli::add_inspect(app);
  bertrain::cli::add_bench(app);
  bertrain::cli::add_bench_input(app);
  bertrain::cli::add_prepare(app);
  bertrain::cli::add_tokenize(app);
  bertrain::cli::add_train(app, bertrain::cli::communicator);
  bertrain::cli::add_eval(app, bertrain::cli::communicator);
  bertrain::cli::add_finetune(app);
  bertrain::cli::add_predict(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const bertrain::Error& e) {
    std::fprintf(stderr, "bertrain: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
