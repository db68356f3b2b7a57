#include "comm/mpi_transport.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "comm/mpi.h"
#include "core/arena.h"
#include "core/error.h"

namespace bertrain::comm {

void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    fail("MPI error in ", what, ": ", std::string(msg, len));
  }
}

MpiTransport::MpiTransport(int* argc, char*** argv) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    owns_mpi_ = true;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  if (const char* ls = std::getenv("BERTRAIN_LOCAL_SIZE")) {
    const int k = std::max(1, std::atoi(ls));
    mpi_check(MPI_Comm_split(MPI_COMM_WORLD, rank_ / k, rank_, &node_), "MPI_Comm_split");
  } else {
    mpi_check(
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_),
        "MPI_Comm_split_type");
  }
  MPI_Comm_rank(node_, &local_rank_);
  MPI_Comm_size(node_, &local_size_);
  {  // every rank's hostname, for messages that name a host
    constexpr int kName = 64;
    std::vector<char> all(static_cast<size_t>(kName) * size_, '\0');
    char mine[kName] = {};
    ::gethostname(mine, kName - 1);
    mpi_check(MPI_Allgather(mine, kName, MPI_CHAR, all.data(), kName, MPI_CHAR, MPI_COMM_WORLD),
              "MPI_Allgather(hostnames)");
    for (int r = 0; r < size_; ++r)
      hosts_.emplace_back(all.data() + static_cast<size_t>(r) * kName,
                          ::strnlen(all.data() + static_cast<size_t>(r) * kName, kName));
  }
  mpi_check(MPI_Comm_split(MPI_COMM_WORLD, local_rank_ == 0 ? 0 : MPI_UNDEFINED, rank_, &leaders_),
            "MPI_Comm_split(leaders)");
  if (leaders_ != MPI_COMM_NULL) MPI_Comm_rank(leaders_, &node_index_);
  mpi_check(MPI_Bcast(&node_index_, 1, MPI_INT, 0, node_), "MPI_Bcast(node index)");
  float* base = nullptr;
  mpi_check(MPI_Win_allocate_shared(kShmSlotBytes, sizeof(float), MPI_INFO_NULL, node_, &base,
                                    &slot_win_),
            "MPI_Win_allocate_shared");
  slots_.resize(local_size_);
  for (int r = 0; r < local_size_; ++r) {
    MPI_Aint sz;
    int disp;
    MPI_Win_shared_query(slot_win_, r, &sz, &disp, &slots_[r]);
  }
}

MpiTransport::~MpiTransport() {
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto& b : shared_) MPI_Win_free(&b.win);
  if (slot_win_ != MPI_WIN_NULL) MPI_Win_free(&slot_win_);
  if (leaders_ != MPI_COMM_NULL) MPI_Comm_free(&leaders_);
  if (node_ != MPI_COMM_NULL) MPI_Comm_free(&node_);
  if (owns_mpi_) MPI_Finalize();
}

int MpiTransport::host_count() const {
  std::vector<std::string> h = hosts_;
  std::sort(h.begin(), h.end());
  return static_cast<int>(std::unique(h.begin(), h.end()) - h.begin());
}

std::string MpiTransport::host_and_ranks(int rank) const {
  const std::string& h = host_of(rank);
  std::string ranks;
  for (int r = 0; r < size_;) {
    if (hosts_[r] != h) {
      ++r;
      continue;
    }
    int e = r;
    while (e + 1 < size_ && hosts_[e + 1] == h) ++e;
    ranks += str(ranks.empty() ? "" : ", ", r, e > r ? str("-", e) : "");
    r = e + 1;
  }
  return str(h, " (rank", ranks.find_first_of("-,") == std::string::npos ? " " : "s ", ranks, ")");
}

std::string MpiTransport::hosts_summary(bool others) const {
  std::string out;
  int shown = 0, more = 0;
  for (int r = 0; r < size_; ++r) {
    if ((others && host_of(r) == host_of(rank_)) || (r > 0 && host_of(r) == host_of(r - 1)))
      continue;
    if (shown < 4)
      out += str(shown++ == 0 ? "" : ", ", host_and_ranks(r));
    else
      ++more;
  }
  return more > 0 ? str(out, " and ", more, " more host(s)") : out;
}

float* MpiTransport::allocate_shared(int64_t n) {
  int64_t range[2] = {-n, n};
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT64_T, MPI_MAX, node_),
            "MPI_Allreduce(allocate_shared)");
  if (-range[0] != range[1])
    fail("allocate_shared: ranks of one node asked for different sizes (", -range[0], " to ",
         range[1], " floats); every rank must allocate the same gradient buffer");
  // The window lives in a shared-memory file (Open MPI: the session directory or /dev/shm). A
  // container's small /dev/shm (Docker's default is 64 MB) would turn the first touch into a
  // SIGBUS: without room for every rank's buffer, keep the gradients in private memory (the
  // shm algorithm then stages them through the window slots). BERTRAIN_SHM_GRADIENTS=0 opts out.
  auto room = [](const char* dir) {
    struct statvfs st {};
    return dir && ::statvfs(dir, &st) == 0 ? static_cast<double>(st.f_bavail) * st.f_frsize : 0.0;
  };
  const double need = 1.1 * local_size_ * (n * 4.0 + 64);
  const char* tmp = std::getenv("TMPDIR");
  int ok = room("/dev/shm") >= need || room(tmp ? tmp : "/tmp") >= need;
  if (const char* e = std::getenv("BERTRAIN_SHM_GRADIENTS"); e && std::string(e) == "0") ok = 0;
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, node_),
            "MPI_Allreduce(allocate_shared)");
  if (!ok) {
    if (rank_ == 0 && !std::getenv("BERTRAIN_SHM_GRADIENTS"))
      std::fprintf(stderr,
                   "bertrain: not enough shared memory for zero-copy gradients (%s for %d ranks "
                   "on a node; /dev/shm and the temp dir are too small): gradients stay in "
                   "private memory and the shm allreduce copies them. Enlarge /dev/shm (e.g. "
                   "docker --shm-size, an emptyDir with medium: Memory) to avoid the copies.\n",
                   human_bytes(need).c_str(), local_size_);
    return nullptr;
  }
  SharedBuffer b;
  b.n = n;
  float* mine = nullptr;
  // 64 bytes spare per rank: every rank's buffer starts at a 64-byte boundary of its part
  // (segments are page-mapped, so the alignment offset is the same in every process).
  const int64_t bytes = std::max<int64_t>(n, 1) * 4 + 64;
  mpi_check(MPI_Win_allocate_shared(bytes, sizeof(float), MPI_INFO_NULL, node_, &mine, &b.win),
            "MPI_Win_allocate_shared (gradient buffer)");
  b.base.resize(local_size_);
  for (int r = 0; r < local_size_; ++r) {
    MPI_Aint sz;
    int disp;
    float* raw = nullptr;
    MPI_Win_shared_query(b.win, r, &sz, &disp, &raw);
    b.base[r] = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(raw) + 63) / 64 * 64);
  }
  mine = b.base[local_rank_];
  std::memset(mine, 0, n * sizeof(float));
  shared_.push_back(std::move(b));
  MPI_Barrier(node_);
  return mine;
}

const MpiTransport::SharedBuffer* MpiTransport::shared_buffer_of(const float* data, int64_t n,
                                                                 int lr) const {
  for (const auto& b : shared_)
    if (data >= b.base[lr] && data + n <= b.base[lr] + b.n) return &b;
  return nullptr;
}

void MpiTransport::node_fence(MPI_Win win) const {
  MPI_Win_sync(win);
  mpi_check(MPI_Barrier(node_), "MPI_Barrier(node)");
  MPI_Win_sync(win);
}

}  // namespace bertrain::comm
