// comm/nccl.h in a build without the GPU backend (CMakeLists.txt compiles this file instead of
// nccl.cpp): no model's memory is on a GPU there, and asking for NCCL says how to build it.
#include "comm/nccl.h"

#include "core/error.h"

namespace bertrain::comm {

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap,
                                                     double /*stall_timeout_s*/,
                                                     Precision /*wire*/) {
  fail("data parallelism across ", bootstrap.size(),
       " GPUs needs NCCL, which comes with the CUDA build: this bertrain is built without it "
       "(CMAKE_ARGS=\"-DBERTRAIN_CUDA=ON\" scripts/setup.sh builds it)");
}

}  // namespace bertrain::comm
