// W8A8 projection: y = (x * g) @ w^T with int8 weights and int8 activations, both with one float
// scale per group of G consecutive inputs (G a multiple of 32; G = Kp is one scale per row). Weights
// come quantised (qw [N, Kp], scales sw [N, Kp/G]); activations are quantised per token and group on
// the fly (scale = max|x * g| / 127 over the group). Products are summed exactly in int32 within a
// group and scaled once per group. A decode step streams a quarter of the fp32 bytes; larger steps do
// 32 multiply-adds per integer instruction pair instead of 8 per FMA.
//
// Inner product of 32 int8 pairs, exact: AVX2 has no signed x signed byte multiply, so
// vpmaddubsw(|x|, sign(w, x)) makes it unsigned x signed (|x|, |w| <= 127: a pair sums to at most
// 32258, no int16 saturation), vpmaddwd(., 1) widens to int32. With VNNI (AVX512-VNNI or AVX-VNNI)
// vpdpbusd does the multiply, widen and add in one. Chosen at build time (-march=native); without
// AVX2 a scalar loop gives the same integers.
//
// g [K] is the factor in front of the projection (RMSNorm gain over the smoothing factor, ones where
// none): fp32 weights fold the gain into their columns, but quantised weights keep their own values,
// so it is applied where x is quantised.
//
// Inputs: x [M, K] float32, qw [N, Kp] int8 (Kp = K rounded up to G, zero-padded), sw [N, Kp/G]
// float32, g [K] float32. Output: y [M, N] float32.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"

namespace {

constexpr int64_t KB = 32;   // bytes per vector step; G is a multiple of it
constexpr int64_t NBLK = 32; // output channels per cache block: 32 x Kp bytes of weights stay in L1/L2 across tokens

// Quantises row x[0..k) * g to q[0..kp) (zero-padded), one scale per group of gs into s.
void quantize_row(const float *x, const float *g, int64_t k, int64_t kp, int64_t gs, int8_t *q, float *s) {
  for (int64_t b = 0; b < kp; b += gs) {
    const int64_t e = std::min(k, b + gs);
    float amax = 0.f;
    for (int64_t i = b; i < e; ++i) amax = std::max(amax, std::fabs(x[i] * g[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = b; i < e; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * g[i] * inv));
    for (int64_t i = std::max(b, e); i < b + gs; ++i) q[i] = 0;
    s[b / gs] = amax / 127.f;
  }
}

struct Shape {
  int64_t kp, gs, ng;  // padded width, group size, groups per row
};

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i dot_add(__m256i acc, __m256i ax, __m256i x, __m256i w) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, ax, _mm256_sign_epi8(w, x));
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, ax, _mm256_sign_epi8(w, x));
#else
  const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

// MB tokens x NB channels: every weight vector loaded once for MB tokens, every activation vector
// once for NB channels; exact int32 sums per group, scaled into float accumulators at its end.
template <int MB, int NB>
void tile(const int8_t *x, const float *sx, const int8_t *w, const float *sw, Shape s, float *out) {
  __m256 accf[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) accf[i][j] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < s.ng; ++gi) {
    __m256i acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
    for (int64_t k = gi * s.gs, end = k + s.gs; k < end; k += KB) {
      __m256i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + j * s.kp + k));
      // Two tiles ahead, one line per 64 bytes: the hardware prefetcher alone kept a decode
      // step's weight stream at ~9 GB/s from DRAM (oneDNN's sgemm reached 16-25).
      if (k % 64 == 0)
        for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char *>(w + (j + 2 * NB) * s.kp + k), _MM_HINT_T0);
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + i * s.kp + k));
        const __m256i ax = _mm256_sign_epi8(xv, xv);
        for (int j = 0; j < NB; ++j) acc[i][j] = dot_add(acc[i][j], ax, xv, wv[j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j)
        accf[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j]),
                                     _mm256_set1_ps(sx[i * s.ng + gi] * sw[j * s.ng + gi]), accf[i][j]);
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * NB + j] = hsum(accf[i][j]);
}
#else
template <int MB, int NB>
void tile(const int8_t *x, const float *sx, const int8_t *w, const float *sw, Shape s, float *out) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float acc = 0.f;
      for (int64_t gi = 0; gi < s.ng; ++gi) {
        int32_t d = 0;
        for (int64_t k = gi * s.gs; k < (gi + 1) * s.gs; ++k) d += int32_t(x[i * s.kp + k]) * int32_t(w[j * s.kp + k]);
        acc += float(d) * sx[i * s.ng + gi] * sw[j * s.ng + gi];
      }
      out[i * NB + j] = acc;
    }
}
#endif

template <int MB, int NB>
void run_tile(const int8_t *qx, const float *sx, const int8_t *qw, const float *sw, Shape s, int64_t n, float *y,
              int64_t ldy) {
  float out[MB * NB];
  tile<MB, NB>(qx, sx, qw + n * s.kp, sw + n * s.ng, s, out);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + n + j] = out[i * NB + j];
}

// Tokens [m0, m0+MB) against channels [b, e). 2x2 tiles (int and float accumulators fill the 16
// registers); one token takes 4 channels at a time to keep more weight loads in flight.
template <int MB>
void token_block(const int8_t *qx, const float *sx, const int8_t *qw, const float *sw, Shape s, int64_t b,
                 int64_t e, float *y, int64_t ldy) {
  int64_t n = b;
  if constexpr (MB == 1)
    for (; n + 4 <= e; n += 4) run_tile<1, 4>(qx, sx, qw, sw, s, n, y, ldy);
  for (; n + 2 <= e; n += 2) run_tile<MB, 2>(qx, sx, qw, sw, s, n, y, ldy);
  for (; n < e; ++n) run_tile<MB, 1>(qx, sx, qw, sw, s, n, y, ldy);
}

}  // namespace

extern "C" int LinearInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  if (nparam != 5 || std::strcmp(dtypes[0], "float32") || std::strcmp(dtypes[1], "int8") ||
      std::strcmp(dtypes[2], "float32") || std::strcmp(dtypes[3], "float32"))
    return 1;
  const float *x = static_cast<const float *>(params[0]);
  const int8_t *qw = static_cast<const int8_t *>(params[1]);
  const float *sw = static_cast<const float *>(params[2]);
  const float *g = static_cast<const float *>(params[3]);
  float *y = static_cast<float *>(params[4]);
  const int64_t m = shapes[0][0], k = shapes[0][1], n = shapes[1][0];
  Shape s{shapes[1][1], 0, shapes[2][1]};
  if (s.ng <= 0 || s.kp % s.ng || shapes[2][0] != n || shapes[3][0] != k) return 1;
  s.gs = s.kp / s.ng;
  if (s.gs % KB || s.kp < k || s.kp - k >= s.gs) return 1;
  // Per call, not per thread: MindSpore may run two projections at once (each then owns its buffers).
  std::vector<int8_t> qx(m * s.kp);
  std::vector<float> sx(m * s.ng);
  kernels::parallel_ranges(m, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) quantize_row(x + i * k, g, k, s.kp, s.gs, &qx[i * s.kp], &sx[i * s.ng]);
  });
  kernels::parallel_ranges(n, 16, [&](int64_t b, int64_t e) {
    for (int64_t n0 = b; n0 < e; n0 += NBLK) {
      const int64_t n1 = std::min(e, n0 + NBLK);
      int64_t i = 0;
      for (; i + 2 <= m; i += 2) token_block<2>(&qx[i * s.kp], &sx[i * s.ng], qw, sw, s, n0, n1, y + i * n, n);
      if (i < m) token_block<1>(&qx[i * s.kp], &sx[i * s.ng], qw, sw, s, n0, n1, y + i * n, n);
    }
  });
  return 0;
}
