// BT_HOST_DEVICE: a function compiled for the host and, under nvcc, for CUDA kernels too (the
// counter-based RNG, the bf16 rounding and the per-row math of the fused kernels are written
// once and shared, so a GPU computes what the CPU computes).
#pragma once

#ifdef __CUDACC__
#define BT_HOST_DEVICE __host__ __device__
#else
#define BT_HOST_DEVICE
#endif
