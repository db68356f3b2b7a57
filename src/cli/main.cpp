// bertrain: pre-train and fine-tune BERT fast, in C++. This file only dispatches: each
// subcommand lives in its own cmd_*.cpp, the options they share in options.cpp.
#include <csignal>
#include <cstdio>

#include <mpi.h>
#include "cli/commands.h"
#include "core/error.h"
#include "core/setting.h"

#include <algorithm>
#include <set>

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f, a quota) must end a write with EFBIG, which the checkpoint
  // writer reports with the file's name and keeps the previous checkpoint, not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"bertrain: pre-train and fine-tune BERT fast on CPUs, on one machine or many."};
  app.require_subcommand(1);
  app.set_version_flag(
      "--version", std::function<std::string()>(bertrain::cli::version_text),
      "Print the version, the commit, the build and the libraries found, and exit");
  bertrain::cli::add_estimate(app);
  bertrain::cli::add_plan(app);
  bertrain::cli::add_init(app);
  bertrain::cli::add_inspect(app);
  bertrain::cli::add_convert(app);
  bertrain::cli::add_bench(app);
  bertrain::cli::add_bench_input(app);
  bertrain::cli::add_prepare(app);
  bertrain::cli::add_tokenize(app);
  bertrain::cli::add_train(app, bertrain::cli::communicator);
  bertrain::cli::add_eval(app, bertrain::cli::communicator);
  bertrain::cli::add_finetune(app, bertrain::cli::communicator);
  bertrain::cli::add_predict(app);
  bertrain::cli::add_launch(app);
  bertrain::cli::add_report(app);
  bertrain::cli::add_doctor(app, bertrain::cli::communicator);
  // Library messages name settings by field ("seq_len"); here they read as this CLI's flags
  // ("--seq-len") where a command has that flag (tests/cli/settings_are_flags.sh checks them all).
  std::set<std::string> flags;
  for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    for (const CLI::Option* o : sub->get_options())
      for (const std::string& n : o->get_lnames()) flags.insert(n);
  bertrain::set_setting_names([flags](std::string_view field) {
    std::string flag(field);
    std::replace(flag.begin(), flag.end(), '_', '-');
    return flags.count(flag) ? "--" + flag : std::string(field);
  });
  // CLI11 reads an unknown first word as a stray argument ("A subcommand is required", and
  // `bertrain nosuch --help` prints the main help and succeeds): name it instead.
  if (argc > 1 && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      known |= sub->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(
          stderr,
          "bertrain: error: unknown command '%s'; the commands are: %s (see bertrain --help)\n",
          argv[1], names.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const bertrain::Error& e) {
    const bertrain::comm::Communicator* comm = bertrain::cli::existing_communicator();
    if (comm && comm->size() > 1) {
      // One rank failing must not leave the others waiting in a collective: end the job.
      std::fprintf(stderr, "bertrain: rank %d: error: %s\n", comm->rank(), e.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    std::fprintf(stderr, "bertrain: error: %s\n", e.what());
    return 1;
  }
  bertrain::cli::release_communicator();
  return 0;
}
