// bertrain launch: one job description (job.yaml) as the launcher a cluster has wants it, or
// started here with mpirun.
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "cli/commands.h"
#include "core/error.h"
#include "launch/elastic.h"
#include "launch/job.h"

namespace bertrain::cli {

namespace {

std::string self_path() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "bertrain";
  return std::string(buf, static_cast<size_t>(n));
}

void write_out(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) fail("cannot write ", path);
}

}  // namespace

void add_launch(CLI::App& app) {
  struct Opts {
    std::string job, emit = "mpirun", output, hostfile;
    bool run = false, elastic = false;
    double probe_s = 5, probe_timeout_s = 10;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "launch",
      "Run a job description (job.yaml: workers, slots, resources, env, the bertrain command and "
      "its flags) with mpirun, Slurm, a Kubernetes MPIJob or PAI-DLC");
  c->add_option("job", o->job,
                "The job spec (YAML; see configs/jobs/, installed in /usr/share/bertrain/jobs). "
                "Containers run its image:, by default " +
                    launch::default_image() + " (scripts/package.sh --image builds it)")
      ->required();
  c->add_option("--emit", o->emit,
                "mpirun (command line + hostfile), slurm (sbatch script), mpijob (Kubernetes "
                "MPIJob v2beta1 manifest) or dlc (PAI-DLC CreateJob JSON)")
      ->capture_default_str();
  c->add_option("--output", o->output, "Write the files into this directory (default: print)");
  c->add_flag("--run", o->run,
              "Start the job here with mpirun (its hosts, or this host for a one-worker job)");
  c->add_flag("--elastic", o->elastic,
              "With --run: supervise the job (restart it from its last checkpoint on the hosts "
              "that answer when one is lost, grow it when hosts come back); the spec's "
              "elastic: {min_workers, max_workers, max_restarts} sets the bounds (default 1, "
              "workers, 3), and implies this flag");
  c->add_option("--hostfile", o->hostfile,
                "With --run --elastic: the hosts (Open MPI's hostfile: 'name slots=N' lines), "
                "re-read at every probe: a host added joins the job (default: the spec's hosts:)");
  c->add_option("--probe-seconds", o->probe_s, "With --elastic: how often every host is asked")
      ->capture_default_str();
  c->add_option("--probe-timeout", o->probe_timeout_s,
                "With --elastic: seconds a host has to answer before it counts as lost")
      ->capture_default_str();
  CLI::App* root = &app;
  c->callback([o, root] {
    launch::JobSpec j = launch::read_job(o->job);
    const std::string version = version_text();
    j.made_by = version.substr(0, version.find('\n'));  // "bertrain 0.1.0 (commit ..., ...)"
    // The flags must be the command's own: checked against this binary's CLI.
    CLI::App* sub = nullptr;
    for (CLI::App* a : root->get_subcommands([](CLI::App*) { return true; }))
      if (a->get_name() == j.command) sub = a;
    if (!sub) fail(j.source, ": command: '", j.command, "' is not a command of this bertrain");
    for (const auto& [flag, value] : j.flags) {
      const CLI::Option* opt = sub->get_option_no_throw("--" + flag);
      if (!opt)
        fail(j.source, ": flags.", flag, ": not a flag of `bertrain ", j.command,
             "` (see bertrain ", j.command, " --help)");
      if (value.empty() && opt->get_expected_min() > 0)
        fail(j.source, ": flags.", flag, ": needs a value");
    }
    if (o->elastic) j.elastic.on = true;
    if (o->elastic && !o->run)
      fail(
          "--elastic supervises a job started here: give --run too (--emit mpijob|dlc of a "
          "spec with elastic: makes the launcher run the supervisor)");
    if (!o->hostfile.empty() && !(j.elastic.on && o->run))
      fail(
          "--hostfile is re-read by the elastic supervisor: give --elastic (or an elastic: "
          "section), or list the hosts in the spec");
    if (j.elastic.on && o->run) {
      // Inside a Slurm allocation without a hostfile: its nodes, srun steps.
      const char* slurm_job = std::getenv("SLURM_JOB_ID");
      const bool slurm = o->hostfile.empty() && slurm_job && *slurm_job;
      if (!slurm && j.hosts.empty() && o->hostfile.empty() && j.workers > 1)
        fail(j.source, ": an elastic job of ", j.workers,
             " workers needs its hosts: listed, or --hostfile, or a Slurm allocation to run in");
      if (slurm && !j.hosts.empty())
        std::fprintf(stderr,
                     "launch: in Slurm allocation %s: its nodes, not the spec's hosts: (those "
                     "are mpirun's)\n",
                     slurm_job);
      launch::ElasticOptions eo;
      eo.slurm = slurm;
      eo.binary = self_path();
      eo.hostfile = o->hostfile;
      eo.probe_s = o->probe_s;
      eo.probe_timeout_s = o->probe_timeout_s;
      launch::run_elastic(j, eo);
      return;
    }
    if (o->run) {
      if (j.hosts.empty() && j.workers > 1)
        fail(j.source, ": --run starts the job from here: a job of ", j.workers,
             " workers needs its hosts: listed");
      if (j.hosts.empty()) j.hosts = {"localhost"};
      const std::string hostfile = (std::filesystem::temp_directory_path() /
                                    ("bertrain-hostfile-" + std::to_string(getpid())))
                                       .string();
      write_out(hostfile, launch::emit_hostfile(j));
      std::string cmd = launch::emit_mpirun(j, hostfile, self_path());
      cmd.pop_back();  // the newline
      std::fprintf(stderr, "launch: %s\n", cmd.c_str());
      std::fflush(stderr);
      const int rc = std::system(cmd.c_str());
      std::filesystem::remove(hostfile);
      if (rc != 0) fail("the job exited with status ", WIFEXITED(rc) ? WEXITSTATUS(rc) : rc);
      return;
    }
    std::vector<std::pair<std::string, std::string>> files;  // name, text
    if (o->emit == "mpirun" && j.elastic.on) {
      // The supervisor runs mpirun itself: the script runs it on the spec beside it.
      files = {
          {"hostfile", launch::emit_hostfile(j)},
          {"job.yaml", j.text},
          {"run.sh", "#!/bin/bash\n# made by " + j.made_by +
                         "\n# the elastic supervisor: mpirun on the hosts of hostfile that "
                         "answer, restarted and grown as they come and go\ncd \"$(dirname "
                         "\"$0\")\"\nexec bertrain launch job.yaml --run --hostfile hostfile\n"}};
    } else if (o->emit == "mpirun") {
      files = {{"hostfile", launch::emit_hostfile(j)},
               {"run.sh",
                "#!/bin/bash\n# made by " + j.made_by + "\n" + launch::emit_mpirun(j, "hostfile")}};
    } else if (o->emit == "slurm") {
      files = {{j.name + ".sbatch", launch::emit_slurm(j)}};
    } else if (o->emit == "mpijob") {
      files = {{j.name + "-mpijob.yaml", launch::emit_mpijob(j)}};
    } else if (o->emit == "dlc") {
      files = {{j.name + "-dlc.json", launch::emit_dlc(j)}};
    } else {
      fail("--emit must be mpirun, slurm, mpijob or dlc, got '", o->emit, "'");
    }
    for (const auto& [name, text] : files) {
      if (o->output.empty()) {
        if (files.size() > 1) std::printf("# --- %s\n", name.c_str());
        std::fputs(text.c_str(), stdout);
        continue;
      }
      std::filesystem::create_directories(o->output);
      const std::string path = (std::filesystem::path(o->output) / name).string();
      write_out(path, text);
      if (name.ends_with(".sh") || name.ends_with(".sbatch"))
        std::filesystem::permissions(path, std::filesystem::perms::owner_exec,
                                     std::filesystem::perm_options::add);
      std::printf("launch: wrote %s\n", path.c_str());
    }
  });
}

}  // namespace bertrain::cli
