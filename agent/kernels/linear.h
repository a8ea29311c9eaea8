// The float projections' cores, shared by their plain ops (linear.cpp, linear_half.cpp) and the
// fused ones that run the norm or SwiGLU feeding them first (fused_linear.cpp).
#pragma once
#include <cstdint>

namespace kernels {

// y [m, n] = x [m, k] @ w [k, n], fp32 (oneDNN sgemm, columns split over the pinned cores).
int linear_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y);

// y [m, blocks * 64] = x [m, k] @ w, w in 16-bit column blocks [blocks, k, 64] (bf16 bits or f16).
int linear_half(const float *x, int64_t m, int64_t k, int64_t blocks, const uint16_t *w, float *y, bool bf16);

}  // namespace kernels
