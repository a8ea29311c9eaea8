// Element-wise chains of the decoder layer fused into single MindSpore CPU custom ops: each builtin
// kernel costs tens of microseconds of dispatch whatever its size, and a decode step at small
// batch is mostly such small kernels (RMSNorm alone is 5 of them, rotary embedding 5, SwiGLU 4).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_rows.h"
#include "parallel.h"
#include "prologue.h"
#include "rows.h"

namespace {

bool f32(const char *dtype) { return std::strcmp(dtype, "float32") == 0; }

}  // namespace

// y = x * rsqrt(mean(x^2) + eps) per row (the gain is folded into the next weight).
// Inputs: x [n, d], eps [1]. Output: y [n, d].
extern "C" int RmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                       void *extra) {
  if (nparam != 3 || !f32(dtypes[0]) || !f32(dtypes[1])) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float eps = *static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  const int64_t n = shapes[0][0], d = shapes[0][1];
  for (int64_t r = 0; r < n; ++r) {
    const float *xr = x + r * d;
    float *yr = y + r * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float scale = 1.f / std::sqrt(ss / d + eps);
    for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * scale;
  }
  return 0;
}

// act(gate) * up from the fused gate|up projection. Inputs: gu [n, 2f], the norm constants [eps,
// activation (0 SiLU, 1 GELU-tanh)]. Output: [n, f].
extern "C" int SwiGlu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  if (nparam != 3 || !f32(dtypes[0]) || !f32(dtypes[1]) || shapes[1][0] < 2) return 1;
  const float *gu = static_cast<const float *>(params[0]);
  const float act = static_cast<const float *>(params[1])[1];
  float *y = static_cast<float *>(params[2]);
  const int64_t n = shapes[0][0], f = shapes[0][1] / 2;
  for (int64_t r = 0; r < n; ++r) kernels::gated_row(gu + r * 2 * f, f, y + r * f, act);
  return 0;
}

// x * rsqrt(mean(x^2) + eps) * gain per row (Gemma's norms on the attention's and MLP's outputs,
// where no stack op applies them). Inputs: x [n, d], the norm constants [eps, ...], gain [d].
// Output: [n, d].
extern "C" int RmsGain(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                       void *extra) {
  if (nparam != 4 || !f32(dtypes[0]) || !f32(dtypes[1]) || !f32(dtypes[2]) || shapes[2][0] != shapes[0][1]) return 1;
  const int64_t n = shapes[0][0], d = shapes[0][1];
  const float eps = static_cast<const float *>(params[1])[0];
  float *y = static_cast<float *>(params[3]);
  std::memcpy(y, params[0], n * d * sizeof(float));
  for (int64_t r = 0; r < n; ++r) kernels::rms_gain_row(y + r * d, d, eps, static_cast<const float *>(params[2]));
  return 0;
}

namespace {

// k and v are written in the KV cache's dtype: float32, bfloat16 bits (uint16), float16, or int8
// (a head's hd values, then their float32 scale: max|x| / 127, rounded to nearest even).
inline void put(float x, float *d) { *d = x; }
// float16 saturates at its largest finite value: one outlier key must not become inf (NaN scores).
inline void put(float x, _Float16 *d) { *d = static_cast<_Float16>(std::clamp(x, -65504.f, 65504.f)); }
inline void put(float x, uint16_t *d) {  // bfloat16, rounded to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  *d = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// One head's hd values x into its cache row d.
template <typename T>
inline void put_head(const float *x, int64_t hd, T *d) {
  for (int64_t i = 0; i < hd; ++i) put(x[i], d + i);
}
inline void put_head(const float *x, int64_t hd, int8_t *d) {
  float amax = 0.f;
  for (int64_t i = 0; i < hd; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < hd; ++i) d[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
  std::memcpy(d + hd, &scale, 4);
}

// RMSNorm of one head in place, times its gain (Qwen3's q/k norm; the attention scale is in q's gain).
inline void norm_head(float *x, int64_t hd, const float *gain, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < hd; ++i) ss += x[i] * x[i];
  const float scale = 1.f / std::sqrt(ss / hd + eps);
  for (int64_t i = 0; i < hd; ++i) x[i] = x[i] * scale * gain[i];
}

template <typename T>
int rope(void **params, int64_t **shapes) {
  const float *qkv = static_cast<const float *>(params[0]);
  const float *cos = static_cast<const float *>(params[1]), *sin = static_cast<const float *>(params[2]);
  const int32_t *pos = static_cast<const int32_t *>(params[3]), *slots = static_cast<const int32_t *>(params[4]);
  T *kc = static_cast<T *>(params[5]), *vc = static_cast<T *>(params[6]);
  const float *pre = static_cast<const float *>(params[7]);
  float *q = static_cast<float *>(params[8]);
  namespace pl = kernels::prologue;
  const int64_t n = shapes[0][0], width = shapes[0][1], table_rows = shapes[1][0], cache_slots = shapes[5][0];
  const int64_t kv = shapes[5][1], row = shapes[5][2], hd = row - kernels::SCALE_BYTES<T>, half = hd / 2;
  const int64_t qw = shapes[8][1], kw = kv * hd;
  if (hd <= 0 || qw + 2 * kw != width || shapes[7][0] < pl::length(width, hd)) return 1;
  const float *q_gain = pre + width, *k_gain = q_gain + hd, *scalar = pre + pl::scalars(width, hd);
  const float qk_eps = scalar[pl::QK_EPS];
  const int64_t rope_offset = static_cast<int64_t>(scalar[pl::ROPE_OFFSET]);
  const int64_t max_pos = static_cast<int64_t>(scalar[pl::ROPE_ROWS]);
  if (rope_offset < 0 || max_pos < 1 || rope_offset + max_pos > table_rows) return 1;
  std::vector<float> roped(hd), biased(width);
  for (int64_t r = 0; r < n; ++r) {
    if (slots[r] < 0 || slots[r] >= cache_slots) return 1;
    const int64_t p = rope_offset + std::min<int64_t>(std::max<int32_t>(pos[r], 0), max_pos - 1);
    const float *c = cos + p * hd, *s = sin + p * hd, *src = biased.data();
    for (int64_t i = 0; i < width; ++i) biased[i] = qkv[r * width + i] + pre[i];  // the Q|K|V bias (or zeros)
    if (qk_eps > 0.f) {
      for (int64_t h = 0; h < qw / hd; ++h) norm_head(biased.data() + h * hd, hd, q_gain, qk_eps);
      for (int64_t h = 0; h < kv; ++h) norm_head(biased.data() + qw + h * hd, hd, k_gain, qk_eps);
    }
    for (int64_t h = 0; h < qw / hd; ++h, src += hd) {
      float *o = q + r * qw + h * hd;
      for (int64_t i = 0; i < half; ++i) {
        o[i] = src[i] * c[i] - src[i + half] * s[i];
        o[i + half] = src[i + half] * c[i + half] + src[i] * s[i + half];
      }
    }
    T *k = kc + slots[r] * kv * row, *v = vc + slots[r] * kv * row;
    for (int64_t h = 0; h < kv; ++h, src += hd) {
      for (int64_t i = 0; i < half; ++i) {
        roped[i] = src[i] * c[i] - src[i + half] * s[i];
        roped[i + half] = src[i + half] * c[i + half] + src[i] * s[i + half];
      }
      put_head(roped.data(), hd, k + h * row);
    }
    for (int64_t h = 0; h < kv; ++h, src += hd) put_head(src, hd, v + h * row);
  }
  return 0;
}

}  // namespace

// Rotary embedding (rotate-half layout) on the query and key heads of the fused Q|K|V projection,
// and the step's new keys and values written straight into the KV cache at their slots: one op
// instead of rope, split and two scatters (the op is marked as writing memory, so MindSpore orders
// the cache's later reads after it). Inputs: qkv [n, (h + 2 kv) * hd], cos/sin tables [rope tables x
// max_position, hd] (one table per rope base: Gemma 3's sliding layers have their own), positions
// [n], slots [n] int32, k_cache/v_cache [S, kv, hd] (float32, uint16 bfloat16 bits or float16) or
// [S, kv, hd + 4] (int8 and a scale per head; written in place), the layer's prologue (prologue.h):
// the Q|K|V bias, the q and k heads' RMSNorm gains and that norm's eps (0: no q/k norm), applied
// before rope; the layer's sliding window (0: none; RopeAttention's, read by PagedAttention); which
// rows of the tables are the layer's.
// Output: q [n, h * hd] float32.
extern "C" int RopeCache(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  if (nparam != 9 || !f32(dtypes[7]) || !f32(dtypes[0]) || std::strcmp(dtypes[3], "int32") || std::strcmp(dtypes[4], "int32") ||
      std::strcmp(dtypes[5], dtypes[6]))
    return 1;
  if (f32(dtypes[5])) return rope<float>(params, shapes);
  if (!std::strcmp(dtypes[5], "uint16")) return rope<uint16_t>(params, shapes);
  if (!std::strcmp(dtypes[5], "float16")) return rope<_Float16>(params, shapes);
  if (!std::strcmp(dtypes[5], "int8")) return rope<int8_t>(params, shapes);
  return 1;
}

// The residual add and the RMSNorm that follows it. Inputs: x [n, d], delta [n, d], eps [1].
// Outputs: sum = x + delta [n, d], y = rms(sum) [n, d].
extern "C" int AddRmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  if (nparam != 5 || !f32(dtypes[0]) || !f32(dtypes[1]) || !f32(dtypes[2])) return 1;
  const float *x = static_cast<const float *>(params[0]), *delta = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *sum = static_cast<float *>(params[3]), *y = static_cast<float *>(params[4]);
  const int64_t n = shapes[0][0], d = shapes[0][1];
  for (int64_t r = 0; r < n; ++r) kernels::add_rms_row(x + r * d, delta + r * d, eps, d, sum + r * d, y + r * d);
  return 0;
}

extern "C" int PagedAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra);

// RopeCache then PagedAttention as one op: the decoder layer's attention from its Q|K|V projection
// (one dispatch instead of two, ~20 us each in MindSpore per layer). Marked as writing memory, as
// RopeCache is. Inputs: qkv, cos, sin, positions, slots, k_cache, v_cache (as RopeCache), context
// slots [R, C] and token rows [n] int32 (as PagedAttention), the prologue (as RopeCache; its last
// value the layer's sliding window). Output: attention [n, h * hd] float32.
extern "C" int RopeAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  if (nparam != 11) return 1;
  const int64_t n = shapes[0][0], qw = shapes[10][1];
  thread_local std::vector<float> q;
  q.resize(static_cast<size_t>(n * qw));
  int64_t qshape[2] = {n, qw};
  void *rp[9] = {params[0], params[1], params[2], params[3], params[4], params[5], params[6], params[9], q.data()};
  int rd[9] = {ndims[0], ndims[1], ndims[2], ndims[3], ndims[4], ndims[5], ndims[6], ndims[9], 2};
  int64_t *rs[9] = {shapes[0], shapes[1], shapes[2], shapes[3], shapes[4], shapes[5], shapes[6], shapes[9], qshape};
  const char *rt[9] = {dtypes[0], dtypes[1], dtypes[2], dtypes[3], dtypes[4], dtypes[5], dtypes[6], dtypes[9],
                       "float32"};
  if (int rc = RopeCache(9, rp, rd, rs, rt, stream, extra)) return rc;
  const float *pro = static_cast<const float *>(params[9]);
  const int64_t hd = kernels::cache_head_dim(shapes[5][2], dtypes[5]);
  int32_t window = static_cast<int32_t>(pro[kernels::prologue::scalars(shapes[0][1], hd) + kernels::prologue::WINDOW]);
  int64_t one = 1;
  void *ap[8] = {q.data(), params[5], params[6], params[7], params[8], params[3], &window, params[10]};
  int ad[8] = {2, ndims[5], ndims[6], ndims[7], ndims[8], ndims[3], 1, ndims[10]};
  int64_t *as[8] = {qshape, shapes[5], shapes[6], shapes[7], shapes[8], shapes[3], &one, shapes[10]};
  const char *at[8] = {"float32", dtypes[5], dtypes[6], dtypes[7], dtypes[8], dtypes[3], "int32", dtypes[10]};
  return PagedAttention(8, ap, ad, as, at, stream, extra);
}

namespace {

// log(sum(exp(x))) of one row, shifted by its maximum (two passes over a row that stays in cache).
float logsumexp_row(const float *x, int64_t v) {
  float peak = x[0];  // not -inf: the kernels build with -ffinite-math-only
  for (int64_t i = 1; i < v; ++i) peak = std::max(peak, x[i]);
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 p = _mm256_set1_ps(peak);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= v; i += 8) acc = _mm256_add_ps(acc, kernels::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), p)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; i < v; ++i) sum += std::exp(x[i] - peak);
  return peak + std::log(sum);
}

}  // namespace

// The log-sum-exp of every row of the logits (log-probabilities without a second pass over the
// vocabulary): one op instead of MindSpore's max, sub, exp, sum, log and add, each a full pass
// over [rows, vocab]. Input: logits [n, v]. Output: [n].
extern "C" int LogSumExp(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  if (nparam != 2 || ndims[0] != 2 || !f32(dtypes[0])) return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  const int64_t n = shapes[0][0], v = shapes[0][1];
  kernels::parallel_ranges(n, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) y[r] = logsumexp_row(x + r * v, v);
  });
  return 0;
}
