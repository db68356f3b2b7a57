// bertrain --version: what this binary is (version, commit, build type, the kernels' instruction
// sets, the CUDA build) and the libraries it runs with here (oneDNN, MPI, NCCL where found).
#include <mpi.h>
#include <oneapi/dnnl/dnnl.h>

#include <string>

#include "bertrain_version.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/isa.h"
#include "obs/doctor.h"

namespace bertrain::cli {

std::string version_text() {
  std::string out = str("bertrain ", BERTRAIN_VERSION, " (commit ", BERTRAIN_COMMIT, ", ",
                        BERTRAIN_BUILD_TYPE, " build)\n");
  out += str("  kernels  avx512, avx2 and portable bodies, chosen at run time: this CPU ",
             isa_name(cpu_isa()), cpu_has_avx512_bf16() ? " with AVX-512 BF16" : "", "\n");
  out += str("  CUDA     ", BERTRAIN_BUILD_CUDA, "\n");
  const dnnl_version_t* d = dnnl_version();
  const std::string hash = d->hash ? d->hash : "";
  out += str("  oneDNN   ", d->major, ".", d->minor, ".", d->patch,
             hash.empty() || hash == "N/A" ? std::string() : str(" (", hash, ")"), "\n");
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(mpi, &len);  // (callable before MPI_Init)
  std::string m(mpi, static_cast<size_t>(len));
  if (const size_t cut = m.find_first_of(",\n"); cut != std::string::npos) m.resize(cut);
  out += str("  MPI      ", m, "\n");
  const obs::GpuStack g = obs::gpu_stack();
  out += str("  NCCL     ",
             g.nccl > 0 ? str(obs::nccl_version_name(g.nccl), " (", g.nccl_lib, ")")
                        : std::string("not found (a GPU job across ranks needs libnccl.so.2)"));
  return out;
}

}  // namespace bertrain::cli
