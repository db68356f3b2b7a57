// Optimizer kernels over one parameter tensor (a slice of the flat buffers): the gradient's
// squared norm for the global norm and the finite check, AdamW (torch.optim.AdamW) and LAMB
// (NVIDIA's BERT LAMB, as apex FusedLAMB) updates with the gradient scale (unscale x clip)
// folded in and the parameters' bf16 copy written in the same pass when asked for. Each has an
// AVX-512 and an AVX2 body (the same operations in the same order, so the same bits) and the
// plain loops below, `_reference`, taken on other CPUs and used as the tests' oracle.
// All run on the OpenMP threads.
#pragma once

#include <cstdint>

#include "kernels/types.h"

namespace bertrain::kernels {

// sum += sum over i of (g[i] * scale)^2, in double (any inf/NaN makes it non-finite).
void add_sum_squares(double& sum, const float* g, int64_t n, double scale);
void add_sum_squares_reference(double& sum, const float* g, int64_t n, double scale);

// AdamW and LAMB steps as kernels/types.h defines them (AdamwStep, LambStep).
void adamw_update(const AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m, float* v,
                  int64_t n);
void adamw_update_reference(const AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m,
                            float* v, int64_t n);

// LAMB in its two passes (what lamb_update runs), for a tensor whose parts are updated on several
// ranks (the sharded optimizer): lamb_moments updates m and v and adds the squared norms of p
// and of the update direction to pn and un; the trust ratio comes from the whole tensor's norms
// (lamb_trust: ||p|| / ||u|| with weight decay, else 1); lamb_apply moves p by step = lr x trust.
void lamb_moments(const LambStep& a, const float* p, const float* g, float* m, float* v, int64_t n,
                  double& pn, double& un);
void lamb_apply(const LambStep& a, float* p, uint16_t* p16, const float* m, const float* v,
                int64_t n, float step);
void lamb_moments_reference(const LambStep& a, const float* p, const float* g, float* m, float* v,
                            int64_t n, double& pn, double& un);
void lamb_apply_reference(const LambStep& a, float* p, uint16_t* p16, const float* m,
                          const float* v, int64_t n, float step);

void lamb_update(const LambStep& a, float* p, uint16_t* p16, const float* g, float* m, float* v,
                 int64_t n);
void lamb_update_reference(const LambStep& a, float* p, uint16_t* p16, const float* g, float* m,
                           float* v, int64_t n);

}  // namespace bertrain::kernels
