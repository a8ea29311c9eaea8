// Per-row element-wise steps shared by the fused ops (fused.cpp) and the int8 projections that
// run them in their quantisation pass (linear_int8.cpp).
#pragma once
#include <cmath>
#include <cstdint>

namespace kernels {

// sum = x + delta; y = sum * rsqrt(mean(sum^2) + eps) (the gain lives elsewhere).
inline void add_rms_row(const float *x, const float *delta, float eps, int64_t d, float *sum, float *y) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    sum[i] = x[i] + delta[i];
    ss += sum[i] * sum[i];
  }
  const float scale = 1.f / std::sqrt(ss / d + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = sum[i] * scale;
}

// y = silu(gate) * up for one row of the fused gate|up projection (gate = gu[0, f), up = gu[f, 2f)).
inline void swiglu_row(const float *gu, int64_t f, float *y) {
  const float *up = gu + f;
  for (int64_t i = 0; i < f; ++i) y[i] = gu[i] / (1.f + std::exp(-gu[i])) * up[i];
}

}  // namespace kernels
