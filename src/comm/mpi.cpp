#include "comm/mpi.h"

#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "comm/mpi_algorithms.h"
#include "comm/mpi_transport.h"
#include "comm/watchdog.h"
#include "core/error.h"
#include "core/setting.h"

namespace bertrain::comm {

Algorithm parse_algorithm(const std::string& s) {
  // auto: zero-copy shared memory within a node, hierarchical once ranks span nodes.
  if (s == "auto") return Algorithm::Shm;
  if (s == "mpi") return Algorithm::Mpi;
  if (s == "ring") return Algorithm::Ring;
  if (s == "shm") return Algorithm::Shm;
  if (s == "hierarchical") return Algorithm::Hierarchical;
  fail(setting("allreduce"), " must be auto, shm, ring, hierarchical or mpi, got '", s, "'");
}

Precision parse_wire(const std::string& s) {
  if (s == "none" || s == "fp32") return Precision::FP32;
  if (s == "fp16") return Precision::FP16;
  if (s == "bf16") return Precision::BF16;
  fail(setting("compression"), " must be none, fp16 or bf16, got '", s, "'");
}

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::Mpi:
      return "mpi";
    case Algorithm::Ring:
      return "ring";
    case Algorithm::Shm:
      return "shm";
    case Algorithm::Hierarchical:
      return "hierarchical";
  }
  return "?";
}

const char* wire_name(Precision w) {
  return w == Precision::FP32 ? "none" : w == Precision::FP16 ? "fp16" : "bf16";
}

std::string mpi_library_version() {
  char v[MPI_MAX_LIBRARY_VERSION_STRING];
  int n = 0;
  if (MPI_Get_library_version(v, &n) != MPI_SUCCESS) return "unknown";
  std::string s(v, static_cast<size_t>(n));
  if (const size_t nl = s.find_first_of("\r\n,"); nl != std::string::npos) s.resize(nl);
  return s;
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

MpiCommunicator::MpiCommunicator(int* argc, char*** argv)
    : t_(std::make_unique<MpiTransport>(argc, argv)),
      watchdog_(std::make_unique<StallWatchdog>(*t_)),
      ring_(std::make_unique<RingAllreduce>(*t_, *watchdog_)),
      shm_(std::make_unique<ShmAllreduce>(*t_)),
      hierarchical_(std::make_unique<HierarchicalAllreduce>(*t_, *shm_, *ring_)) {}

MpiCommunicator::~MpiCommunicator() = default;

int MpiCommunicator::rank() const {
  return t_->rank();
}
int MpiCommunicator::size() const {
  return t_->size();
}
int MpiCommunicator::local_rank() const {
  return t_->local_rank();
}
int MpiCommunicator::local_size() const {
  return t_->local_size();
}
int MpiCommunicator::node() const {
  return t_->node_index();
}
void MpiCommunicator::set_label(const std::string& label) {
  watchdog_->set_label(label);
}
void MpiCommunicator::set_stall_timeout(double seconds) {
  watchdog_->set_stall_timeout(seconds);
}
bool MpiCommunicator::spans_nodes() const {
  return t_->local_size() != t_->size();
}

bool MpiCommunicator::wire_in_use() const {
  return algo_ == Algorithm::Ring ||
         ((algo_ == Algorithm::Shm || algo_ == Algorithm::Hierarchical) && spans_nodes());
}

std::string MpiCommunicator::name() const {
  const int nh = t_->host_count(), size = t_->size(), local = t_->local_size();
  const std::string hosts = nh > 1 ? str(" on ", nh, " hosts: ", t_->hosts_summary(false)) : "";
  return str("MPI, ", size, " ranks (", size / std::max(1, local), " node(s) x ", local, hosts,
             "), allreduce ",
             algo_ == Algorithm::Shm && spans_nodes() ? "hierarchical" : algorithm_name(algo_),
             wire_in_use() ? str(", wire ", wire_name(wire_)) : "");
}

float* MpiCommunicator::allocate_shared(int64_t n) {
  return t_->allocate_shared(n);
}

void MpiCommunicator::allreduce_sum(float* data, int64_t n) {
  watchdog_->enter("allreduce");
  switch (algo_) {
    case Algorithm::Mpi:
      for (int64_t off = 0; off < n; off += int64_t{1} << 30) {
        const int c = static_cast<int>(std::min<int64_t>(n - off, int64_t{1} << 30));
        mpi_check(MPI_Allreduce(MPI_IN_PLACE, data + off, c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                  "MPI_Allreduce");
      }
      break;
    case Algorithm::Ring:
      ring_->allreduce(data, n, wire_, MPI_COMM_WORLD);
      break;
    case Algorithm::Shm:
      if (!spans_nodes()) {
        shm_->allreduce(data, n);
        break;
      }
      [[fallthrough]];
    case Algorithm::Hierarchical:
      hierarchical_->allreduce(data, n, wire_);
      break;
  }
  watchdog_->leave();
}

namespace {
// The parts as chunk boundaries: cuts[r] .. cuts[r + 1] is rank r's.
std::vector<int64_t> cuts_of(std::span<const int64_t> counts) {
  std::vector<int64_t> cuts(counts.size() + 1, 0);
  for (size_t r = 0; r < counts.size(); ++r) cuts[r + 1] = cuts[r] + counts[r];
  return cuts;
}
// MPI_Allgatherv in place over MPI_COMM_WORLD, rank r's part counts[r] elements of `type`.
void allgatherv_in_place(void* data, std::span<const int64_t> counts, MPI_Datatype type) {
  std::vector<int> rc(counts.begin(), counts.end()), displ(counts.size() + 1, 0);
  for (size_t r = 0; r < counts.size(); ++r) displ[r + 1] = displ[r] + rc[r];
  mpi_check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, rc.data(), displ.data(), type,
                           MPI_COMM_WORLD),
            "MPI_Allgatherv");
}

void check_parts(std::span<const int64_t> counts, int64_t n, int size, const char* what) {
  int64_t sum = 0;
  for (int64_t c : counts) sum += c;
  if (static_cast<int>(counts.size()) != size || sum != n)
    fail(what, ": the parts (", counts.size(), " of them, ", sum,
         " floats) must be one per rank and cover the buffer (", n, " floats)");
  if (n > INT32_MAX) fail(what, ": ", n, " floats exceed MPI's int count; use smaller buckets");
}
}  // namespace

void MpiCommunicator::reduce_scatter_sum(float* data, int64_t n, std::span<const int64_t> counts) {
  check_parts(counts, n, size(), "reduce-scatter");
  if (size() == 1) return;
  watchdog_->enter("reduce-scatter");
  switch (algo_) {
    case Algorithm::Mpi: {
      const auto [b, e] = part_of(counts, rank());
      std::vector<int> rc(counts.begin(), counts.end());
      part_.resize(std::max<int64_t>(1, e - b));
      mpi_check(
          MPI_Reduce_scatter(data, part_.data(), rc.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
          "MPI_Reduce_scatter");
      std::memcpy(data + b, part_.data(), (e - b) * sizeof(float));
      break;
    }
    case Algorithm::Ring:
      ring_->run(data, cuts_of(counts), wire_, MPI_COMM_WORLD, 0, true, false);
      break;
    case Algorithm::Shm:
    case Algorithm::Hierarchical:
      // One node: each rank sums its own part straight from its peers' buffers. Across nodes,
      // the hierarchical allreduce (a superset: the leaders' ring carries every byte).
      if (!spans_nodes())
        shm_->reduce_scatter(data, n, counts);
      else
        hierarchical_->allreduce(data, n, wire_);
      break;
  }
  watchdog_->leave();
}

void MpiCommunicator::allgather(float* data, int64_t n, std::span<const int64_t> counts) {
  check_parts(counts, n, size(), "allgather");
  if (size() == 1) return;
  watchdog_->enter("allgather");
  if (algo_ == Algorithm::Ring) {
    // Always fp32: the parts are what every rank must hold bit for bit (the parameters).
    ring_->run(data, cuts_of(counts), Precision::FP32, MPI_COMM_WORLD, 0, false, true);
  } else {
    allgatherv_in_place(data, counts, MPI_FLOAT);
  }
  watchdog_->leave();
}

void MpiCommunicator::allgather(uint16_t* data, int64_t n, std::span<const int64_t> counts) {
  check_parts(counts, n, size(), "allgather (16-bit)");
  if (size() == 1) return;
  watchdog_->enter("allgather(16-bit)");
  allgatherv_in_place(data, counts, MPI_UINT16_T);
  watchdog_->leave();
}

void MpiCommunicator::allreduce_sum(double* data, int64_t n) {
  watchdog_->enter("allreduce(f64)");
  mpi_check(
      MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD),
      "MPI_Allreduce");
  watchdog_->leave();
}

void MpiCommunicator::broadcast(void* data, int64_t bytes, int root) {
  watchdog_->enter("broadcast");
  char* p = static_cast<char*>(data);
  for (int64_t off = 0; off < bytes; off += int64_t{1} << 30) {
    const int c = static_cast<int>(std::min<int64_t>(bytes - off, int64_t{1} << 30));
    mpi_check(MPI_Bcast(p + off, c, MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
  }
  watchdog_->leave();
}

void MpiCommunicator::pass(void* data, int64_t bytes, int from, int to) {
  const int me = rank();
  if (from == to || (me != from && me != to)) return;
  watchdog_->enter("pass");
  constexpr int kTag = 11;  // (the ring's messages go on communicators of their own)
  char* p = static_cast<char*>(data);
  for (int64_t off = 0; off < bytes; off += int64_t{1} << 30) {
    const int c = static_cast<int>(std::min<int64_t>(bytes - off, int64_t{1} << 30));
    if (me == from)
      mpi_check(MPI_Send(p + off, c, MPI_BYTE, to, kTag, MPI_COMM_WORLD), "MPI_Send");
    else
      mpi_check(MPI_Recv(p + off, c, MPI_BYTE, from, kTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
                "MPI_Recv");
  }
  watchdog_->leave();
}

void MpiCommunicator::barrier() {
  watchdog_->enter("barrier");
  mpi_check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  watchdog_->leave();
}

}  // namespace bertrain::comm
