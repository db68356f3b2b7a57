// The emulated device's cuBLAS (cuda_emu/README.md): the batched GEMM bertrain's attention calls,
// through the emulator's reference GEMM, queued on the handle's stream.
#pragma once

#include "cublas_api.h"

struct cublasContext;
using cublasHandle_t = cublasContext*;

enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };

cublasStatus_t cublasCreate(cublasHandle_t* h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
// The handle's workspace (device memory: checked; the reference GEMM needs none). Without one a
// GPU's cuBLAS may allocate its own, which a stream capture forbids.
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void* workspace, size_t bytes);
// C[i] = alpha op(A[i]) op(B[i]) + beta C[i] for i < batch, column-major; the pointer arrays are
// device memory, read when the stream runs the call.
cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                   int m, int n, int k, const void* alpha, const void* const A[],
                                   cudaDataType_t a_type, int lda, const void* const B[],
                                   cudaDataType_t b_type, int ldb, const void* beta,
                                   void* const C[], cudaDataType_t c_type, int ldc, int batch,
                                   cublasComputeType_t compute, cublasGemmAlgo_t algo);
