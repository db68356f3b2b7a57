// NCCL: the collectives of data parallelism on GPU memory (Communicator::device_memory), for a
// model on the CUDA backend run by several ranks. Built with -DBERTRAIN_CUDA=ON
// (comm/gpu/nccl.cpp); libnccl.so.2 is loaded when a communicator is made, so a machine without
// NCCL still runs one GPU a job and says what is missing when asked for more.
//
// - Bootstrap over the job's communicator (MPI): rank 0's NCCL unique id is broadcast over it,
//   and every rank compares its NCCL, CUDA runtime and driver versions and the NCCL settings that
//   decide the transport (NCCL_SOCKET_IFNAME, NCCL_IB_*, NCCL_SHM_DISABLE, NCCL_P2P_DISABLE,
//   NCCL_ALGO, NCCL_PROTO) with rank 0's: a difference is an error naming both ranks and the
//   field, before any collective can hang on it.
// - One GPU per rank on a host: the bootstrap's local rank (OMPI_COMM_WORLD_LOCAL_RANK,
//   SLURM_LOCALID) modulo the GPUs it sees selects it, before anything else touches the GPU (a
//   rank the scheduler gave GPUs of its own sees only those: comm/gpu_placement.h); two ranks on
//   one GPU (by its PCI bus id) is an error naming them and the fix.
// - Collectives run on a stream of their own, after the work the kernels' stream
//   (Backend::queue) has queued (an event orders them), and return when they have completed: the
//   reducer's thread waits there while backward's kernels keep running on the kernels' stream. Host
//   buffers (a step's statistics, flags and norms) are staged through device memory of the
//   communicator's own. Parts of unequal size (the sharded optimizer's) go as grouped reduces and
//   broadcasts.
// - A NCCL or CUDA error, or a collective that has not completed within the stall timeout (a peer
//   died, hangs, or cannot be reached), ends the rank with a message naming the rank, its host and
//   GPU, the collective and its label, and NCCL's settings; the communicator is aborted first so
//   that no rank hangs in it, and the launcher ends the job on the non-zero exit.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "comm/mpi.h"  // Precision

namespace bertrain::comm {

// A NCCL communicator over bootstrap's ranks (which it keeps using for barriers).
// stall_timeout_s <= 0: no timeout. wire F16 / BF16: gradient allreduces of device memory travel
// and add in 16 bits (rounded on the GPU before, widened after; what Horovod's fp16 compression
// does); statistics, reduce-scatters and gathers stay exact.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap,
                                                     double stall_timeout_s = 60.0,
                                                     Precision wire = Precision::FP32);

}  // namespace bertrain::comm
