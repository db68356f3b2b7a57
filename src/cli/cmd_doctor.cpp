// bertrain doctor: checks this machine (CPU and the precisions it runs, cores, MPI on every rank,
// /dev/shm for zero-copy gradients, disk for checkpoints, GPU) and, given a run directory,
// diagnoses the run from its metrics.jsonl (obs/doctor.h). Every line says what to change.
#include <sched.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <omp.h>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "cli/commands.h"
#include "comm/mpi.h"
#include "core/error.h"
#include "core/isa.h"
#include "kernels/backend.h"
#include "model/checkpoint.h"
#include "model/params.h"
#include "obs/doctor.h"
#include "obs/report.h"
#include "train/run_state.h"

namespace bertrain::cli {

namespace fs = std::filesystem;

namespace {

void line(const char* status, const std::string& topic, const std::string& text) {
  std::printf("  %-5s %-10s %s\n", status, topic.c_str(), text.c_str());
}

double free_bytes(const std::string& path) {
  struct statvfs v {};
  if (statvfs(path.c_str(), &v) != 0) return -1;
  return static_cast<double>(v.f_bavail) * static_cast<double>(v.f_frsize);
}

double memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (in >> key >> kib)
    if (key == "MemTotal:") return kib * 1024;
  return 0;
}

bool on_path(const std::string& exe) {
  const char* path = std::getenv("PATH");
  if (!path) return false;
  std::string p = path;
  size_t b = 0;
  while (b <= p.size()) {
    const size_t e = std::min(p.find(':', b), p.size());
    if (e > b && access((p.substr(b, e - b) + "/" + exe).c_str(), X_OK) == 0) return true;
    b = e + 1;
  }
  return false;
}

// Bytes of one checkpoint (its files) in a run directory, 0 when none.
double checkpoint_bytes(const std::string& run) {
  const std::string ck = train::resolve_checkpoint(run);
  if (ck.empty() || !fs::is_directory(ck)) return 0;
  double sum = 0;
  for (const auto& f : fs::directory_iterator(ck))
    if (f.is_regular_file()) sum += static_cast<double>(f.file_size());
  return sum;
}

void environment(comm::Communicator& comm, const std::string& run) {
  std::printf("doctor: this machine\n");
  const kernels::Backend& cpu = kernels::cpu_backend();
  line("ok", "cpu", cpu.description());
  line("ok", "fp32", "runs everywhere");
  if (!cpu.runs(Precision::BF16))
    line("warn", "bf16",
         "not available: oneDNN has no bf16 matmul on this CPU (it needs AVX-512); "
         "train with --precision fp32 or fp16");
  else if (!cpu.precision_note(Precision::BF16).empty())
    line("warn", "bf16",
         "emulated (no AVX-512 BF16): 0.25-0.4x fp32's speed measured; "
         "--precision fp16 saves the same memory at fp32's speed here");
  else
    line("ok", "bf16", "native (AVX-512 BF16)");
  line(cpu_isa() >= Isa::Avx2 ? "ok" : "warn", "fp16",
       cpu_isa() >= Isa::Avx2 ? "F16C conversions" : "portable conversions (slow)");
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  const int threads = omp_get_max_threads(), local = comm.local_size();
  line(threads * local > cores ? "warn" : "ok", "cores",
       str(cores, " usable; ", local, " rank(s) on this host x ", threads,
           " threads = ", threads * local,
           threads * local > cores
               ? " (oversubscribed: pass --threads " + std::to_string(std::max(1, cores / local)) +
                     " or OMP_NUM_THREADS)"
               : ""));
  // The same MPI on every rank: a mixed installation fails in odd ways mid-run.
  const std::string mpi = comm::mpi_library_version();
  if (comm.size() > 1) {
    const double h = static_cast<double>(std::hash<std::string>{}(mpi) % (uint64_t{1} << 52));
    std::vector<double> all(comm.size(), 0.0);
    all[comm.rank()] = h;
    comm.allreduce_sum(all.data(), comm.size());
    std::string differ;
    for (int r = 1; r < comm.size(); ++r)
      if (all[r] != all[0]) differ += str(differ.empty() ? "" : ", ", r);
    line(differ.empty() ? "ok" : "FAIL", "mpi",
         mpi + (differ.empty() ? str(", the same on all ", comm.size(), " ranks")
                               : ", but rank(s) " + differ +
                                     " run another MPI: install one version on every host"));
  } else {
    line("ok", "mpi", mpi + " (run doctor under mpirun to compare every rank's)");
  }
  // Zero-copy gradients: an MPI-3 shared window per rank in /dev/shm.
  double grad_bytes = 0;
  if (!run.empty()) {
    const std::string ck = train::resolve_checkpoint(run);
    if (!ck.empty()) {
      const model::BertConfig cfg = model::BertConfig::load(model::checkpoint_config_path(ck));
      grad_bytes =
          4.0 * static_cast<double>(model::ParamTable(cfg, model::Head::Pretraining).total());
    }
  }
  const double shm = free_bytes("/dev/shm");
  if (shm < 0)
    line("warn", "/dev/shm", "absent: the shared-memory allreduce falls back to copies");
  else if (grad_bytes > 0 && shm < grad_bytes * local)
    line("warn", "/dev/shm",
         str(human_bytes(shm), " free, the gradients of ", local, " rank(s) need ",
             human_bytes(grad_bytes * local),
             ": enlarge it (docker --shm-size, a larger tmpfs) or gradients are copied"));
  else
    line("ok", "/dev/shm",
         human_bytes(shm) + " free" +
             (grad_bytes > 0
                  ? ", enough for " + std::to_string(local) + " rank(s) of this run's gradients (" +
                        human_bytes(grad_bytes * local) + ")"
                  : ""));
  if (!run.empty()) {
    const double disk = free_bytes(run), ck = checkpoint_bytes(run);
    if (ck > 0)
      line(disk < 2 * ck ? "warn" : "ok", "disk",
           str(human_bytes(disk), " free in ", run, ", a checkpoint is ", human_bytes(ck),
               disk < 2 * ck ? ": room for less than two more; free space or lower --keep-last"
                             : ""));
  }
  if (kernels::gpu_built()) {
    const kernels::Backend* gpu = kernels::gpu_backend();
    line(gpu ? "ok" : "info", "gpu",
         gpu ? str(kernels::gpu_count(), " CUDA device(s), the first a ", gpu->device_name())
             : "no CUDA device visible: training runs on CPUs");
    if (gpu) {
      // The ceiling GPU utilisation is measured against, on the first device (as the CPU's).
      const int64_t n = 8192;
      const double bf16 = gpu->gemm_peak_gflops(Precision::BF16, n, n, n, 0.5) / 1e3,
                   f32 = gpu->gemm_peak_gflops(Precision::FP32, n, n, n, 0.5) / 1e3;
      char rates[96];
      std::snprintf(rates, sizeof rates, "%.1f TFLOP/s bf16, %.1f fp32", bf16, f32);
      line("info", "gpu gemm",
           str(rates, " (cuBLASLt, ", n, "^3, pseudo-random operands, measured now)"));
    }
  } else {
    line("info", "gpu",
         on_path("nvidia-smi")
             ? "nvidia-smi is here, but this build has no CUDA backend (-DBERTRAIN_CUDA=ON)"
             : "no GPU driver (nvidia-smi) found: training runs on CPUs");
  }
  // The CUDA runtime and driver, NCCL: what a GPU run would load (found through the loader in
  // every build). A driver older than the runtime is the classic "driver version is
  // insufficient" failure.
  const obs::GpuStack g = obs::gpu_stack();
  if (g.cuda_runtime > 0 || g.cuda_driver > 0) {
    const bool old_driver = g.cuda_driver > 0 && g.cuda_driver < g.cuda_runtime;
    line(old_driver ? "warn" : "info", "cuda",
         str(g.cuda_runtime > 0
                 ? str("runtime ", obs::cuda_version_name(g.cuda_runtime), " (", g.runtime_lib, ")")
                 : std::string("no CUDA runtime library"),
             "; driver ",
             g.cuda_driver > 0 ? str("supports CUDA ", obs::cuda_version_name(g.cuda_driver))
                               : std::string("none (no libcuda.so.1: no NVIDIA driver)"),
             old_driver ? ": the driver is older than the runtime; update the NVIDIA driver" : ""));
  }
  std::string nccl =
      g.nccl > 0 ? str("NCCL ", obs::nccl_version_name(g.nccl), " (", g.nccl_lib, ")") : "";
  for (char** e = environ; *e; ++e)
    if (std::string(*e).rfind("NCCL_", 0) == 0) nccl += std::string(nccl.empty() ? "" : " ") + *e;
  if (!nccl.empty()) line("info", "nccl", nccl);
}

}  // namespace

void add_doctor(CLI::App& app, comm::Communicator& (*comm)()) {
  auto run = std::make_shared<std::string>();
  auto* c = app.add_subcommand(
      "doctor",
      "Check this machine (precisions, cores, MPI on every rank, /dev/shm, disk, CUDA devices) "
      "and "
      "diagnose a run from its metrics and timeline: input- or communication-bound, stragglers, "
      "load imbalance, loss spikes, fp16 skips, memory, a late allreduce; each finding with the "
      "fix");
  c->add_option("run", *run, "A run directory (train --output) to diagnose");
  c->callback([run, comm] {
    comm::Communicator& cm = comm();
    environment(cm, *run);
    if (run->empty() || cm.rank() != 0) return;
    const obs::RunMetrics m = obs::load_run(*run);
    std::printf("doctor: run %s (%zu logged steps, to step %lld)\n", run->c_str(), m.rows.size(),
                (long long)m.rows.back()["step"].get<int64_t>());
    auto findings = obs::diagnose(m.rows, memory_bytes());
    if (!m.trace.empty()) {  // train --timeline RUN/timeline.json
      const obs::TraceOverlap o = obs::trace_overlap(m);
      std::printf(
          "  info  timeline   %s: %.1f ms, allreduce %.1f ms (%.1f hidden behind backward), "
          "waited %.1f ms for the sum\n",
          m.trace_step.c_str(), m.trace_step_ms, o.comm, o.hidden, o.exposed);
      for (auto& f : obs::diagnose_timeline(m)) findings.push_back(std::move(f));
    }
    for (auto& f : obs::diagnose_incidents(*run)) findings.push_back(std::move(f));
    for (auto& f : obs::diagnose_elastic(m)) findings.push_back(std::move(f));
    if (findings.empty())
      std::printf("  ok    no problems found in the run's metrics%s\n",
                  m.trace.empty() ? "" : " and timeline");
    for (const auto& f : findings) {
      std::printf("  find  %-10s %s\n", f.rule.c_str(), f.what.c_str());
      std::printf("        %-10s fix: %s\n", "", f.fix.c_str());
    }
  });
}

}  // namespace bertrain::cli
