// Per-row element-wise steps shared by the fused ops (fused.cpp) and the int8 projections that
// run them in their quantisation pass (linear_int8.cpp).
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>

namespace kernels {

#if defined(__AVX2__) && defined(__FMA__)
// e^x in 8 lanes (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, degree-5 polynomial; ~1 ulp), for
// SiLU and softmax. Our flags leave std::exp scalar (libmvec needs -ffast-math): a scalar expf
// was ~7% of a 256-token SmolLM2 prefill step on a Zen 3 (perf).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));  // 2^n stays normal
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: r stays exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

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
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= f; i += 8) {
    const __m256 g = _mm256_loadu_ps(gu + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < f; ++i) y[i] = gu[i] / (1.f + std::exp(-gu[i])) * up[i];
}

// y = gelu_tanh(gate) * up (GeGLU, Gemma). gelu_tanh(x) = x (1 + tanh(u)) / 2 with
// u = sqrt(2 / pi) (x + 0.044715 x^3), which is x * sigmoid(2u): SwiGLU's loop with 2u for x.
inline void geglu_row(const float *gu, int64_t f, float *y) {
  const float *up = gu + f;
  constexpr float c = 1.5957691216057308f, c3 = 0.044715f * 1.5957691216057308f;  // 2 sqrt(2 / pi) (1, 0.044715)
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f), vc = _mm256_set1_ps(-c), vc3 = _mm256_set1_ps(-c3);
  for (; i + 8 <= f; i += 8) {
    const __m256 g = _mm256_loadu_ps(gu + i);
    const __m256 minus_2u = _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), vc3, vc));
    const __m256 e = exp8(minus_2u);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < f; ++i) y[i] = gu[i] / (1.f + std::exp(-gu[i] * (c + c3 * gu[i] * gu[i]))) * up[i];
}

// The gated MLP's activation, as the model's norm constants name it (1: GeGLU, else SwiGLU).
inline void gated_row(const float *gu, int64_t f, float *y, float activation) {
  if (activation == 1.f)
    geglu_row(gu, f, y);
  else
    swiglu_row(gu, f, y);
}

// x = rms(x) * gain in place (Gemma's norms on the attention's and the MLP's outputs).
inline void rms_gain_row(float *x, int64_t d, float eps, const float *gain) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float scale = 1.f / std::sqrt(ss / d + eps);
  for (int64_t i = 0; i < d; ++i) x[i] = x[i] * scale * gain[i];
}

}  // namespace kernels
