#include "launch/elastic.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/clock.h"
#include "core/error.h"
#include "core/host.h"
#include "data/object_store.h"
#include "data/storage.h"

namespace bertrain::launch {

namespace {

std::atomic<int> g_signal{0}, g_signals{0};  // the last signal, how many
void on_signal(int sig) {
  g_signal.store(sig);
  g_signals.fetch_add(1);
}

void say(const std::string& line) {
  const std::time_t t = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%H:%M:%S", std::localtime(&t));
  std::fprintf(stderr, "elastic %s: %s\n", when, line.c_str());
  std::fflush(stderr);
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

std::vector<std::string> minus(const std::vector<std::string>& a,
                               const std::vector<std::string>& b) {
  std::vector<std::string> out;
  for (const auto& x : a)
    if (std::find(b.begin(), b.end(), x) == b.end()) out.push_back(x);
  return out;
}

bool is_this_host(const std::string& h) {
  return h == "localhost" || h.rfind("127.", 0) == 0 || h == host_name();
}

// /bin/sh -c cmd in a process group of its own (a terminal's Ctrl-C reaches the supervisor
// alone, which stops the job its own way), with the default signal dispositions.
pid_t spawn(const std::string& cmd, bool own_group) {
  const pid_t pid = fork();
  if (pid < 0) fail("cannot start a process (fork): ", std::strerror(errno));
  if (pid == 0) {
    if (own_group) setpgid(0, 0);
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

std::string flag_value(const JobSpec& j, const std::string& name, bool* present = nullptr) {
  for (const auto& [k, v] : j.flags)
    if (k == name) {
      if (present) *present = true;
      return v;
    }
  if (present) *present = false;
  return "";
}

// The run's latest complete checkpoint ("checkpoint-000016"), "" where none is (yet); a
// directory on a shared file system or a bucket prefix alike.
std::string latest_checkpoint(const std::string& output) {
  if (output.empty()) return "";
  std::string out = output;
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  try {
    if (!data::is_remote(out) && !std::filesystem::exists(out + "/latest")) return "";
    std::string name = data::read_all(out + "/latest");
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
    return name;
  } catch (const std::exception&) {
    return "";
  }
}

int64_t step_of(const std::string& checkpoint) {
  const size_t dash = checkpoint.rfind('-');
  if (dash == std::string::npos) return -1;
  try {
    return std::stoll(checkpoint.substr(dash + 1));
  } catch (const std::exception&) {
    return -1;
  }
}

// The nodes of this Slurm allocation, in its order (SLURM_JOB_NODELIST expanded by scontrol).
std::vector<std::string> slurm_nodes() {
  const char* list = std::getenv("SLURM_JOB_NODELIST");
  if (!list || !*list)
    fail("elastic under Slurm: SLURM_JOB_NODELIST is not set (run it in sbatch)");
  std::FILE* p = ::popen(str("scontrol show hostnames ", shell_quote(list)).c_str(), "r");
  if (!p) fail("cannot run scontrol show hostnames");
  std::vector<std::string> nodes;
  char line[512];
  while (std::fgets(line, sizeof line, p)) {
    std::string n = line;
    while (!n.empty() && (n.back() == '\n' || n.back() == ' ')) n.pop_back();
    if (!n.empty()) nodes.push_back(n);
  }
  if (::pclose(p) != 0 || nodes.empty())
    fail("scontrol show hostnames ", list, " failed: the allocation's nodes are unknown");
  return nodes;
}

std::string status_text(int status) {
  if (WIFEXITED(status)) return str("status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return str("signal ", WTERMSIG(status));
  return str("wait status ", status);
}

}  // namespace

std::vector<std::string> read_hostfile(const std::string& path, int64_t slots_per_worker) {
  std::ifstream in(path);
  if (!in) fail("cannot read the hostfile ", path);
  std::vector<std::string> hosts;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string host, word;
    if (!(words >> host)) continue;
    while (words >> word) {
      if (word.rfind("slots=", 0) != 0) continue;
      if (word != str("slots=", slots_per_worker))
        fail(path, ":", n, ": '", word, "' but the job runs ", slots_per_worker,
             " ranks per worker (slots_per_worker)");
    }
    if (std::find(hosts.begin(), hosts.end(), host) == hosts.end()) hosts.push_back(host);
  }
  return hosts;
}

std::vector<std::string> answering(const std::vector<std::string>& hosts, const ElasticOptions& o) {
  std::string agent = o.agent;
  if (agent.empty()) {
    const char* a = std::getenv("OMPI_MCA_plm_rsh_agent");
    agent = a && *a ? a : "ssh -o BatchMode=yes -o ConnectTimeout=5";
  }
  std::vector<pid_t> pids(hosts.size(), 0);
  const int timeout = std::max(1, static_cast<int>(o.probe_timeout_s + 0.5));
  for (size_t i = 0; i < hosts.size(); ++i) {
    const std::string ask =
        o.slurm ? str("srun --overlap --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=",
                      shell_quote(hosts[i]), " --quiet true")
                : str(agent, " ", shell_quote(hosts[i]), " true");
    if (o.slurm || !is_this_host(hosts[i]))
      pids[i] = spawn(str("exec timeout -k 2 ", timeout, " ", ask, " < /dev/null > /dev/null 2>&1"),
                      false);
  }
  std::vector<std::string> up;
  for (size_t i = 0; i < hosts.size(); ++i) {
    int status = 0;
    if (pids[i]) {
      pid_t r;  // (a signal to the supervisor interrupts the wait, not the probe)
      while ((r = waitpid(pids[i], &status, 0)) < 0 && errno == EINTR) {
      }
      if (r != pids[i] || !WIFEXITED(status) || WEXITSTATUS(status) != 0) continue;
    }
    up.push_back(hosts[i]);
  }
  return up;
}

void run_elastic(const JobSpec& job, const ElasticOptions& o) {
  const Elastic& e = job.elastic;
  const int64_t most = e.max_workers ? e.max_workers : job.workers;
  auto listed = [&] {
    if (o.slurm) return slurm_nodes();
    if (!o.hostfile.empty()) return read_hostfile(o.hostfile, job.slots_per_worker);
    return job.hosts.empty() ? std::vector<std::string>{"localhost"} : job.hosts;
  };
  const std::string output = flag_value(job, "output");
  if (output.empty())
    fail(job.source, ": an elastic job restarts from its checkpoints: flags.output is required");
  // The supervisor reads the run's `latest` as the ranks do: with the spec's environment
  // (credentials: the supervisor's own win) and its --s3-* flags.
  for (const auto& [k, v] : job.env) setenv(k.c_str(), v.c_str(), 0);
  data::ObjectStoreOverrides store;
  store.endpoint = flag_value(job, "s3-endpoint");
  store.region = flag_value(job, "s3-region");
  store.addressing = flag_value(job, "s3-addressing");
  try {
    if (!flag_value(job, "s3-retries").empty())
      store.max_attempts = std::stoi(flag_value(job, "s3-retries"));
    if (!flag_value(job, "s3-timeout").empty())
      store.timeout_s = std::stod(flag_value(job, "s3-timeout"));
  } catch (const std::exception&) {
    fail(job.source, ": flags.s3-retries / s3-timeout must be numbers");
  }
  data::set_object_store_overrides(store);
  bool has_steps = false;
  const std::string steps_flag = flag_value(job, "steps", &has_steps);
  const int64_t steps = has_steps ? std::stoll(steps_flag) : -1;

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  const std::string hostfile = (std::filesystem::temp_directory_path() /
                                ("bertrain-elastic-hosts-" + std::to_string(getpid())))
                                   .string();
  // One name for every attempt: a run's lease in a bucket passes from one attempt to the next
  // (train/run_mirror.h) instead of blocking the restart until it expires.
  const std::string job_id =
      str(job.name, "@", host_name(), ":", getpid(), ":", static_cast<int64_t>(unix_seconds()));
  int restarts = 0, grows = 0;
  std::string kind, reason;
  double event_at = 0;
  say(str("job ", job.name, ": ", e.min_workers, "..", most, " workers of ", job.slots_per_worker,
          " ranks, at most ", e.max_restarts, " restarts; probing hosts every ", o.probe_s, " s",
          o.slurm ? str("; Slurm allocation ", std::getenv("SLURM_JOB_ID"),
                        ": srun steps on its nodes that answer")
                  : std::string("; mpirun")));
  for (int attempt = 0;; ++attempt) {
    const std::vector<std::string> all = listed();
    std::vector<std::string> hosts = answering(all, o);
    if (static_cast<int64_t>(hosts.size()) > most) hosts.resize(static_cast<size_t>(most));
    const std::string ck = latest_checkpoint(output);
    if (static_cast<int64_t>(hosts.size()) < e.min_workers) {
      const std::vector<std::string> down = minus(all, hosts);
      fail("elastic: ", hosts.size(), " of ", all.size(),
           " hosts answer (not answering: ", joined(down), "); the job needs at least ",
           e.min_workers, " (elastic.min_workers): stopping. The last complete checkpoint (",
           ck.empty() ? std::string("none") : ck, " in ", output,
           ") stands; start the job again once hosts answer and it resumes from it");
    }
    JobSpec a = job.on_hosts(hosts);
    a.env.emplace_back("BERTRAIN_ELASTIC_JOB", job_id);
    bool resume = false;
    flag_value(a, "resume", &resume);
    if (attempt > 0 && !resume) a.flags.emplace_back("resume", "");
    if (attempt > 0) {
      a.env.emplace_back("BERTRAIN_ELASTIC_KIND", kind);
      a.env.emplace_back("BERTRAIN_ELASTIC_COUNT",
                         kind == "grow" ? str(grows) : str(restarts, " of ", e.max_restarts));
      a.env.emplace_back("BERTRAIN_ELASTIC_REASON", reason);
      a.env.emplace_back("BERTRAIN_ELASTIC_AT", str(static_cast<int64_t>(event_at * 1e3)));
    }
    {
      std::ofstream hf(hostfile);
      hf << emit_hostfile(a);
      if (!hf) fail("cannot write ", hostfile);
    }
    std::string cmd = o.slurm ? emit_srun_step(a, o.binary) : emit_mpirun(a, hostfile, o.binary);
    cmd.pop_back();
    say(str("attempt ", attempt + 1, " on ", hosts.size(), " of ", all.size(), " workers (",
            joined(hosts), ")", ck.empty() ? std::string() : ", from " + ck, ": ", cmd));
    const pid_t pid = spawn("exec " + cmd, true);
    bool growing = false, ending = false, termed = false, stopping = false;
    auto next_probe = Clock::now() + std::chrono::duration<double>(o.probe_s);
    Clock::time_point ended_at{};
    int status = 0;
    for (;;) {
      const pid_t r = waitpid(pid, &status, WNOHANG);
      if (r == pid) break;
      if (g_signal.load() && !stopping) {
        say(str("signal ", g_signal.load(),
                ": asking the job to finish its step, checkpoint and stop (SIGUSR1; a second "
                "signal ends it at once)"));
        kill(pid, SIGUSR1);
        stopping = true;
      }
      if (g_signals.load() > 1 && !termed) {
        kill(pid, SIGTERM);
        termed = true;
      }
      // A lost host: mpirun usually notices its daemon gone and ends the job by itself (a
      // SIGTERM in the middle of that abort crashes Open MPI 4.1's mpirun); after 5 s it is
      // told to, after 25 s it and what it started here are killed (it can wait minutes for a
      // dead host's daemon).
      if (ending && !termed && seconds_since(ended_at) > 5) {
        kill(pid, SIGTERM);
        termed = true;
      }
      if (ending && seconds_since(ended_at) > 25) kill(-pid, SIGKILL);
      if (!ending && !stopping && Clock::now() >= next_probe) {
        const std::vector<std::string> now_all = listed();
        const std::vector<std::string> up = answering(now_all, o);
        const std::vector<std::string> lost = minus(hosts, up);
        const std::vector<std::string> joining = minus(up, hosts);
        if (!lost.empty()) {
          event_at = unix_seconds();
          reason = str(lost.size() == 1 ? "host " : "hosts ", joined(lost), " stopped answering");
          say(reason + ": ending the attempt (its ranks wait in collectives for the lost ones)");
          ending = true;
          ended_at = Clock::now();
        } else if (!growing && !joining.empty() && static_cast<int64_t>(hosts.size()) < most) {
          event_at = unix_seconds();
          const size_t to =
              std::min<size_t>(static_cast<size_t>(most), hosts.size() + joining.size());
          reason = str(joining.size() == 1 ? "host " : "hosts ", joined(joining), " answer",
                       joining.size() == 1 ? "s" : "", ": growing from ", hosts.size(), " to ", to,
                       " workers");
          say(reason + ": the job checkpoints at the end of this step and restarts (SIGUSR1)");
          kill(pid, SIGUSR1);
          growing = true;
        }
        next_probe = Clock::now() + std::chrono::duration<double>(o.probe_s);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    const std::string now_ck = latest_checkpoint(output);
    if (g_signal.load()) {
      std::filesystem::remove(hostfile);
      if (!ok)
        fail("elastic: the job stopped by signal ", g_signal.load(), " ended with ",
             status_text(status), "; the last complete checkpoint is ", now_ck);
      say(str("stopped by signal ", g_signal.load(), "; checkpoint ", now_ck, " (start the job ",
              "again to continue)"));
      return;
    }
    const bool complete = ok && (steps < 0 || step_of(now_ck) >= steps);
    if (ok && (complete || !growing)) {
      std::filesystem::remove(hostfile);
      say(str("the job ended well after ", attempt + 1, attempt ? " attempts" : " attempt", " (",
              restarts, " restarts, ", grows, " grown); last checkpoint ", now_ck));
      return;
    }
    if (ok && growing) {
      ++grows;
      kind = "grow";
      continue;
    }
    // A failed attempt: lost hosts (seen by the probe, or now), or the job's own failure.
    if (!ending) {
      event_at = unix_seconds();
      const std::vector<std::string> lost = minus(hosts, answering(hosts, o));
      if (lost.empty() && now_ck == ck) {
        std::filesystem::remove(hostfile);
        fail("elastic: the job ended with ", status_text(status),
             " with every host answering and no checkpoint written since the attempt began (",
             ck.empty() ? std::string("none yet") : ck,
             "): it fails by itself, not by a lost host, and is not restarted; see its messages "
             "above and ",
             output, "/incidents.log");
      }
      reason = lost.empty()
                   ? str("the job ended with ", status_text(status), " with every host answering")
                   : str(lost.size() == 1 ? "host " : "hosts ", joined(lost), " stopped answering");
    }
    if (restarts >= e.max_restarts) {
      std::filesystem::remove(hostfile);
      fail("elastic: ", reason, "; the job was restarted ", restarts,
           " times already (elastic.max_restarts ", e.max_restarts,
           "): stopping. The last complete checkpoint (", now_ck.empty() ? "none" : now_ck, " in ",
           output, ") stands");
    }
    ++restarts;
    kind = "restart";
    say(str("restart ", restarts, " of ", e.max_restarts, ": ", reason, "; resuming from ",
            now_ck.empty() ? "the start" : now_ck, " on the hosts that answer"));
  }
}

}  // namespace bertrain::launch
