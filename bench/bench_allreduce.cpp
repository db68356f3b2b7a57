// nccl-tests-style allreduce table under mpirun: size, time, algbw, busbw for MPI_Allreduce and
// bertrain's ring, shared-memory and hierarchical algorithms (and fp16 ring), beside the
// single-thread memcpy bandwidth of this machine (the shared-memory limit). "shm" and
// "hierarchical" reduce a buffer from allocate_shared in place (as the trainer's gradients);
// "shm-staged" reduces an ordinary buffer, copied through the window.
//   mpirun -np 2 build/bench/bench_allreduce [max_mb]
// busbw = algbw * 2 (n-1) / n, as nccl-tests.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/mpi.h"

using namespace bertrain::comm;
using bertrain::Precision;

int main(int argc, char** argv) {
  MpiCommunicator comm(&argc, &argv);
  const int64_t max_mb = argc > 1 ? std::atoll(argv[1]) : 512;
  const int p = comm.size();
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  // memcpy bandwidth (read + write of the buffer counts once, as a copy)
  double memcpy_gbs = 0;
  {
    std::vector<char> a(size_t{256} << 20, 1), b(size_t{256} << 20);
    std::memcpy(b.data(), a.data(), a.size());
    const auto t0 = now();
    for (int i = 0; i < 4; ++i) std::memcpy(b.data(), a.data(), a.size());
    memcpy_gbs = 4.0 * a.size() / secs(t0, now()) / 1e9;
  }
  struct Variant {
    const char* name;
    Algorithm a;
    Precision w;
    bool shared;  // buffer from allocate_shared (zero copy), as the trainer's gradients
  };
  const Variant vs[] = {{"mpi", Algorithm::Mpi, Precision::FP32, false},
                        {"ring", Algorithm::Ring, Precision::FP32, false},
                        {"ring-fp16", Algorithm::Ring, Precision::FP16, false},
                        {"shm-staged", Algorithm::Shm, Precision::FP32, false},
                        {"shm", Algorithm::Shm, Precision::FP32, true},
                        {"hierarchical", Algorithm::Hierarchical, Precision::FP32, true}};
  if (comm.rank() == 0) {
    std::printf("# %d ranks (%d per node); single-thread memcpy %.2f GB/s\n", p, comm.local_size(),
                memcpy_gbs);
    std::printf("%12s", "bytes");
    for (const auto& v : vs) std::printf(" %13s", v.name);
    std::printf("   (busbw GB/s)\n");
  }
  std::vector<float> buf;
  float* shared = comm.allocate_shared((max_mb << 20) / 4);
  for (int64_t bytes = 4096; bytes <= max_mb << 20; bytes *= bytes < (16 << 20) ? 4 : 2) {
    const int64_t n = bytes / 4;
    buf.assign(n, 1.0f);
    std::fill(shared, shared + n, 1.0f);
    if (comm.rank() == 0) std::printf("%12lld", (long long)bytes);
    for (const auto& v : vs) {
      comm.set_algorithm(v.a);
      comm.set_wire(v.w);
      float* data = v.shared ? shared : buf.data();
      comm.allreduce_sum(data, n);  // warm up
      const int iters = bytes < (1 << 20) ? 50 : bytes < (64 << 20) ? 10 : 3;
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = now();
      for (int i = 0; i < iters; ++i) comm.allreduce_sum(data, n);
      double t = secs(t0, now()) / iters;
      MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      const double busbw = bytes / t / 1e9 * 2.0 * (p - 1) / p;
      if (comm.rank() == 0) std::printf(" %13.2f", busbw);
    }
    if (comm.rank() == 0) std::printf("\n");
  }
  return 0;
}
