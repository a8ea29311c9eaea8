// Paged attention for MindSpore CPU as an AOT custom op over a token-packed step: every query token
// attends over its own sequence's context, read by slot from the flat KV cache, with no mask tensor.
// Any mix of decode rows and prefill chunks runs in one call. Tokens of short runs (decodes) read
// K/V in place with vector dot products. Runs of GEMM_MIN_QUERIES or more tokens of one sequence (a
// prefill chunk) gather each KV head's context once per block of queries and run scores and the
// weighted sum of V as two GEMMs per query head (dot products per key were 1.4x slower there).
//
// The KV cache is float32, bfloat16 (uint16 bits), float16 or int8 (kv_cache_dtype): keys and values
// are widened to fp32 as they are loaded (int8 times its row's scale), all arithmetic is fp32. An
// int8 cache row of a head is hd values, then their float32 scale (kv_rows.h). Decode attention
// streams the cache from memory at a rate set by its bytes (float32 took 1.86x float16's time, 64
// rows x 192 keys, Zen 4): int8 takes 0.53x float16's bytes, and that step 0.73-0.78x its time.
//
// Inputs: q [N, H*hd] (attention scale already folded in), k_cache/v_cache [S, kv, hd] (T; int8:
// [S, kv, hd + 4]),
// ctx_slots [R, C] (cache slot of each context position of each sequence), token_rows [N] (the
// sequence of each token; a sequence's tokens are contiguous), positions [N] (token n sees context
// positions 0..positions[n]), optionally window [1] int32 (a sliding window: token n sees only the
// last `window` of those, positions[n] - window + 1..positions[n]; 0: all). Output [N, H*hd].
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "deterministic.h"
#include "dnnl.h"
#include "kv_rows.h"
#include "parallel.h"
#include "rows.h"

namespace {

struct Bf16 {
  uint16_t bits;
};

// The scale of a cache row of one head whose hd values start at p.
template <typename T>
inline float row_scale(const T *, int64_t) { return 1.f; }
inline float row_scale(const int8_t *p, int64_t hd) {
  float s;
  std::memcpy(&s, p + hd, 4);
  return s;
}

template <typename T>
struct Args {
  const float *q;
  const T *kc, *vc;
  const int32_t *slots, *rows, *pos;
  float *out;
  int64_t n, kv, hd, grp, ctx, window;
  const int32_t *row_slots(int64_t token) const { return slots + rows[token] * ctx; }
  int64_t head_row() const { return hd + kernels::SCALE_BYTES<T>; }  // T elements per head in a cache row
  int64_t stride() const { return kv * head_row(); }         // T elements per slot
};

// 8 floats: one AVX register, two NEON registers; GCC/Clang vector extensions keep this portable.
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef _Float16 f16x8 __attribute__((vector_size(16), aligned(2)));
typedef int8_t i8x8 __attribute__((vector_size(8), aligned(1)));
constexpr int64_t KEYS = 4;  // keys scored together: independent FMA chains hide their latency

// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): the order of score_keys' pair sums, so that a
// key scores the same in a group of four and alone.
inline float hsum(v8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
inline v8 load(const float *p) { return *reinterpret_cast<const v8 *>(p); }
// bf16 -> fp32: the bits in the upper half. With AVX2 vpmovzxwd + vpslld: GCC 12 makes 5
// instructions of the generic form (bf16 KV took 2.4x fp32's time from cache).
inline v8 load(const Bf16 *p) {
#if defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  return reinterpret_cast<v8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  return reinterpret_cast<v8>(__builtin_convertvector(*reinterpret_cast<const u16x8 *>(p), u32x8) << 16);
#endif
}
inline v8 load(const _Float16 *p) {
#if defined(__F16C__)  // one vcvtph2ps; GCC 12 converts the generic vector element by element
  return reinterpret_cast<v8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
#else
  return __builtin_convertvector(*reinterpret_cast<const f16x8 *>(p), v8);
#endif
}
inline v8 load(const int8_t *p) {
#if defined(__AVX2__)
  return reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)))));
#else
  return __builtin_convertvector(*reinterpret_cast<const i8x8 *>(p), v8);
#endif
}
inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(_Float16 x) { return static_cast<float>(x); }
inline float widen(Bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Scores of one query head against context keys [0, len) of KV head g.
template <int64_t HD, typename T>
void score(const float *q, const T *kc, const int32_t *slots, int64_t len, int64_t stride, float *s) {
  v8 qv[HD / 8];
  for (int64_t i = 0; i < HD / 8; ++i) qv[i] = load(q + 8 * i);
  int64_t j = 0;
  for (; j + KEYS <= len; j += KEYS) {
    v8 acc[KEYS] = {};
    for (int64_t i = 0; i < HD / 8; ++i)
      for (int64_t t = 0; t < KEYS; ++t) acc[t] += qv[i] * load(kc + slots[j + t] * stride + 8 * i);
    for (int64_t t = 0; t < KEYS; ++t) s[j + t] = hsum(acc[t]);
  }
  for (; j < len; ++j) {
    v8 acc = {};
    for (int64_t i = 0; i < HD / 8; ++i) acc += qv[i] * load(kc + slots[j] * stride + 8 * i);
    s[j] = hsum(acc);
  }
}

// o += sum_j p[j] * V[j] for one head, with the output row held in registers.
template <int64_t HD, typename T>
void weigh(const float *p, const T *vc, const int32_t *slots, int64_t len, int64_t stride, float *o) {
  v8 acc[HD / 8];
  for (int64_t i = 0; i < HD / 8; ++i) acc[i] = load(o + 8 * i);
  for (int64_t j = 0; j < len; ++j) {
    const T *v = vc + slots[j] * stride;
    for (int64_t i = 0; i < HD / 8; ++i) acc[i] += p[j] * load(v + 8 * i);
  }
  for (int64_t i = 0; i < HD / 8; ++i) *reinterpret_cast<v8 *>(o + 8 * i) = acc[i];
}

// Whole cache rows (every KV head) of up to n slots: the cache is scattered over blocks, so the
// hardware prefetcher alone falls behind. attend_row asks for the next key block's rows a few at a
// time, a share before each head's pass over the current block: all at once (~100 lines for
// SmolLM2) they queued behind the core's few outstanding-miss slots and stalled the loads of the
// block being scored. 64 decode rows at 192 keys of a float16 cache from DRAM, 30 layers, 2
// threads, Zen 4: 30.5-32.2 -> 21.4-22.4 ms (median of 21, alternating; same outputs). Two blocks
// ahead, or the first value block during the last key block, gained nothing more. (GCC 12 drops
// these prefetches, unseen, when the share is computed in a helper taking the part and the parts.)
// LOCALITY 2 (prefetcht1): into L2 only. The key pass sends the value rows of the block it scores
// there, so the value pass finds them in L2. From memory, one process alternating, Zen 4: SmolLM2,
// 64 rows x 192 / 512 keys, int8 cache 0.94-0.98x / 0.83-1.01x (8 runs), float16 0.88x / 0.91x, bfloat16
// 0.93x / 0.89x; 8 rows x 512 keys of 8 KV heads of 128, int8 0.95-0.99x, float16 0.95x.
template <int LOCALITY = 3, typename T>
inline void prefetch_rows(const T *cache, const int32_t *slots, int64_t n, int64_t stride) {
  for (int64_t j = 0; j < n; ++j) {
    const char *row = reinterpret_cast<const char *>(cache + slots[j] * stride);
    for (int64_t b = 0; b < stride * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(row + b, 0, LOCALITY);
  }
}

// s <- e^(s - peak) over [0, len); returns their sum.
float exp_sum(float *s, int64_t len, float peak) {
  float sum = 0.f;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= len; j += 8) {
    const __m256 e = kernels::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(peak)));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(reinterpret_cast<v8 &>(acc));
#endif
  for (; j < len; ++j) sum += (s[j] = std::exp(s[j] - peak));
  return sum;
}

void softmax(float *s, int64_t len) {
  const float inv = 1.f / exp_sum(s, len, *std::max_element(s, s + len));
  for (int64_t j = 0; j < len; ++j) s[j] *= inv;
}

// A decode row: every query head goes over the context KEY_BLOCK keys at a time, so a block's cache
// rows come from memory once and from L1 for the other heads; each head's sums keep their order
// (fp32: the same outputs). Head by head over the whole context (the order before) re-read a KV
// head's context per query head sharing it, from L2 while it fit. One layer, 512 keys, Zen 3, 2
// threads, old -> new (minimum of 9): SmolLM2 (9 heads on 3 KV heads of 64), 64 rows, fp32 KV
// 4.8 -> 4.1 ms, bf16 KV 5.2 -> 3.7 ms (with the bf16 load above); llama2-7B's 32 heads of 128,
// 8 rows: fp32 9.5-10.1 -> 7.3-8.1 ms, bf16 6.1-7.2 -> 4.6-5.2 ms.
constexpr int64_t KEY_BLOCK = 16;

// int8 cache, decode rows: the query heads sharing a KV head go over its keys together, each key
// row widened once in registers and used by all of them, and each row's scale applied once to a
// score (or a softmax weight) instead of to its hd values. Widening into a float buffer that the
// heads then read (the way before) cost 5 instructions per 8 values, more than the heads' multiply-
// adds. 30 layers, 2 threads, Zen 4, one process alternating (tools/bench_attention.py's cache),
// new / old time: SmolLM2 (9 heads on 3 KV heads of 64), 64 rows x 192 / 512 keys, 0.72x / 0.84x in
// cache, 0.94x / 0.89x from memory; 8 rows x 512 keys of 32 heads on 8 KV heads of 128, 0.64x in
// cache, 0.71x from memory. The same outputs within float rounding (2e-7).
#if defined(__AVX512VL__)
constexpr int KEYS_Q8 = 4;  // keys x heads accumulators: 16 of 32 registers
#else
constexpr int KEYS_Q8 = 2;  // 16 registers (AVX2): 8 accumulators
#endif

// Scores of HC query heads (q: the first, HD apart) against KN keys at rows k[0..KN): s[h * ld + t].
template <int64_t HD, int HC, int KN>
inline void score_keys(const float *q, const int8_t *const *k, float *s, int64_t ld) {
  v8 acc[HC][KN] = {};
  for (int64_t i = 0; i < HD / 8; ++i) {
    v8 kv[KN];
    for (int t = 0; t < KN; ++t) kv[t] = load(k[t] + 8 * i);
    for (int h = 0; h < HC; ++h) {
      const v8 qv = load(q + h * HD + 8 * i);
      for (int t = 0; t < KN; ++t) acc[h][t] += qv * kv[t];
    }
  }
  float scale[KN];
  for (int t = 0; t < KN; ++t) scale[t] = row_scale(k[t], HD);
#if defined(__AVX2__)
  if constexpr (KN == 4) {
    // Four keys' sums at once: two rounds of pair sums and one add of the halves (8 instructions for
    // 4 scores against 6 each, the same additions for every key).
    const __m128 sc = _mm_loadu_ps(scale);
    for (int h = 0; h < HC; ++h) {
      const __m256 *a = reinterpret_cast<const __m256 *>(acc[h]);
      const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      _mm_storeu_ps(s + h * ld, _mm_mul_ps(sc, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1))));
    }
    return;
  }
#endif
  for (int t = 0; t < KN; ++t)
    for (int h = 0; h < HC; ++h) s[h * ld + t] = hsum(acc[h][t]) * scale[t];
}

// Rows ahead[0..n_ahead) of `ahead` (the next key block's share of these heads) are prefetched a
// few at a time between the keys: a KV head's whole share at once (2 of 16 rows of 8 KV heads x 128)
// queued behind the core's outstanding misses, 1.1x slower from memory (see prefetch_rows).
template <int64_t HD, int HC>
void score_heads(const float *q, const int8_t *kc, const int32_t *slots, int64_t n, int64_t stride, float *s,
                 int64_t ld, const int8_t *ahead, const int32_t *ahead_slots, int64_t n_ahead) {
  const int8_t *k[KEY_BLOCK];
  for (int64_t j = 0; j < n; ++j) k[j] = kc + slots[j] * stride;
  const int64_t steps = (n + KEYS_Q8 - 1) / KEYS_Q8;
  for (int64_t i = 0, j = 0; j < n; ++i, j += KEYS_Q8) {
    const int64_t p0 = n_ahead * i / steps, p1 = n_ahead * (i + 1) / steps;
    prefetch_rows(ahead, ahead_slots + p0, p1 - p0, stride);
    if (j + KEYS_Q8 <= n) {
      score_keys<HD, HC, KEYS_Q8>(q, k + j, s + j, ld);
      continue;
    }
    for (int64_t t = j; t < n; ++t) score_keys<HD, HC, 1>(q, k + t, s + t, ld);
  }
}

// Output chunks of 8 values that weigh_heads keeps in registers at once: HC x CH independent
// multiply-add chains per key (24 of AVX-512VL's 32 registers, 8 of AVX2's 16). One chunk at a time,
// the HC chains waited on their own latency key after key: 31 cycles a key of SmolLM2's 3 heads, in
// cache, Zen 4 (the multiply-adds alone need 12).
template <int64_t HD, int HC>
constexpr int64_t value_chunks() {
#if defined(__AVX512VL__)
  constexpr int64_t regs = 30;
#else
  constexpr int64_t regs = 14;
#endif
  int64_t ch = HD / 8;
  while (ch > 1 && (HC * ch + ch > regs || (HD / 8) % ch)) --ch;
  return ch;
}

// o[h] += sum_j p[h * ld + j] x scale_j x V_j for HC heads (o: the first head's output, HD apart),
// each output value summed over the keys in order (the same bits in any chunking).
template <int64_t HD, int HC>
void weigh_heads(const float *p, int64_t ld, const int8_t *vc, const int32_t *slots, int64_t n, int64_t stride,
                 float *o, const int8_t *ahead, const int32_t *ahead_slots, int64_t n_ahead) {
  constexpr int64_t CH = value_chunks<HD, HC>(), STEPS = HD / 8 / CH;
  const int8_t *v[KEY_BLOCK];
  float w[HC][KEY_BLOCK];
  for (int64_t j = 0; j < n; ++j) {
    v[j] = vc + slots[j] * stride;
    const float scale = row_scale(v[j], HD);
    for (int h = 0; h < HC; ++h) w[h][j] = p[h * ld + j] * scale;
  }
  for (int64_t i = 0; i < STEPS; ++i) {
    const int64_t p0 = n_ahead * i / STEPS, p1 = n_ahead * (i + 1) / STEPS;
    prefetch_rows(ahead, ahead_slots + p0, p1 - p0, stride);
    float *oi = o + 8 * CH * i;
    v8 acc[HC][CH];
    for (int h = 0; h < HC; ++h)
      for (int64_t c = 0; c < CH; ++c) acc[h][c] = load(oi + h * HD + 8 * c);
    for (int64_t j = 0; j < n; ++j) {
      v8 x[CH];
      for (int64_t c = 0; c < CH; ++c) x[c] = load(v[j] + 8 * (CH * i + c));
      for (int h = 0; h < HC; ++h)
        for (int64_t c = 0; c < CH; ++c) acc[h][c] += w[h][j] * x[c];
    }
    for (int h = 0; h < HC; ++h)
      for (int64_t c = 0; c < CH; ++c) *reinterpret_cast<v8 *>(oi + h * HD + 8 * c) = acc[h][c];
  }
}

// The grp query heads of one KV head, four at a time, each chunk prefetching its part of the whole
// cache rows (from `ahead`, the cache) at ahead_slots.
template <int64_t HD, bool SCORE>
void heads_q8(const float *in, int64_t ld, int64_t grp, const int8_t *cache, const int32_t *slots, int64_t n,
              int64_t stride, float *out, const int8_t *ahead, const int32_t *ahead_slots, int64_t n_ahead) {
  const int64_t chunks = (grp + 3) / 4;
  for (int64_t c = 0, h = 0; h < grp; ++c) {
    const int64_t hc = std::min<int64_t>(4, grp - h), p0 = n_ahead * c / chunks, p1 = n_ahead * (c + 1) / chunks;
    auto run = [&](auto size) {
      constexpr int C = decltype(size)::value;
      if constexpr (SCORE)
        score_heads<HD, C>(in + h * HD, cache, slots, n, stride, out + h * ld, ld, ahead, ahead_slots + p0, p1 - p0);
      else
        weigh_heads<HD, C>(in + h * ld, ld, cache, slots, n, stride, out + h * HD, ahead, ahead_slots + p0, p1 - p0);
    };
    switch (hc) {
      case 4: run(std::integral_constant<int, 4>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      default: run(std::integral_constant<int, 1>{}); break;
    }
    h += hc;
  }
}

// Token `row`'s query heads on KV heads [g0, g1), over its context keys [j0, j1), into o (the
// row's output). `stats` null: the keys are the whole context, o the attention. Otherwise o gets
// sum_j e^(s_j - peak) V_j and stats [2h, 2h + 1] the head's peak and sum: one part of a context
// split over the cores (`merge`).
template <int64_t HD, typename T>
void attend_row(const Args<T> &a, int64_t row, int64_t g0, int64_t g1, int64_t j0, int64_t j1, float *o,
                float *stats) {
  const int64_t h0 = g0 * a.grp, h1 = g1 * a.grp, heads = h1 - h0, width = a.kv * a.grp * HD, stride = a.stride();
  constexpr bool Q8 = std::is_same_v<T, int8_t>;
  thread_local std::vector<float> s;
  s.resize(h1 * a.ctx);
  const int32_t *slots = a.row_slots(row);
  const float *q = a.q + row * width;
  for (int64_t j = j0; j < j1; j += KEY_BLOCK) {
    const int64_t n = std::min(KEY_BLOCK, j1 - j), next = std::min(KEY_BLOCK, j1 - j - n);
    if constexpr (Q8) {
      for (int64_t g = g0; g < g1; ++g) {
        // This KV head's share of the next block's rows (keys), and of this block's (values, to L2).
        const int64_t p0 = next * (g - g0) / (g1 - g0), p1 = next * (g - g0 + 1) / (g1 - g0);
        const int64_t v0 = n * (g - g0) / (g1 - g0), v1 = n * (g - g0 + 1) / (g1 - g0);
        heads_q8<HD, true>(q + g * a.grp * HD, a.ctx, a.grp, a.kc + g * a.head_row(), slots + j, n, stride,
                           &s[g * a.grp * a.ctx + j], a.kc, slots + j + n + p0, p1 - p0);
        prefetch_rows<2>(a.vc, slots + j + v0, v1 - v0, stride);
      }
    } else {
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t p0 = next * (h - h0) / heads, p1 = next * (h - h0 + 1) / heads;  // this head's share
        const int64_t v0 = n * (h - h0) / heads, v1 = n * (h - h0 + 1) / heads;
        prefetch_rows(a.kc, slots + j + n + p0, p1 - p0, stride);
        score<HD>(q + h * HD, a.kc + h / a.grp * a.head_row(), slots + j, n, stride, &s[h * a.ctx + j]);
        prefetch_rows<2>(a.vc, slots + j + v0, v1 - v0, stride);
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    float *sh = &s[h * a.ctx + j0];
    if (!stats) {
      softmax(sh, j1 - j0);
      continue;
    }
    stats[2 * h] = *std::max_element(sh, sh + (j1 - j0));
    stats[2 * h + 1] = exp_sum(sh, j1 - j0, stats[2 * h]);
  }
  std::fill(o + h0 * HD, o + h1 * HD, 0.f);
  for (int64_t j = j0; j < j1; j += KEY_BLOCK) {
    const int64_t n = std::min(KEY_BLOCK, j1 - j), next = std::min(KEY_BLOCK, j1 - j - n);
    if constexpr (Q8) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p0 = next * (g - g0) / (g1 - g0), p1 = next * (g - g0 + 1) / (g1 - g0);
        heads_q8<HD, false>(&s[g * a.grp * a.ctx + j], a.ctx, a.grp, a.vc + g * a.head_row(), slots + j, n, stride,
                            o + g * a.grp * HD, a.vc, slots + j + n + p0, p1 - p0);
      }
    } else {
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t p0 = next * (h - h0) / heads, p1 = next * (h - h0 + 1) / heads;
        prefetch_rows(a.vc, slots + j + n + p0, p1 - p0, stride);
        weigh<HD>(&s[h * a.ctx + j], a.vc + h / a.grp * a.head_row(), slots + j, n, stride, o + h * HD);
      }
    }
  }
}

// out [heads * hd] from the parts of a context split over the cores: each part's sums rescaled
// to the largest peak, divided by the rescaled sum.
void merge(int64_t parts, int64_t heads, int64_t hd, const float *o, const float *stats, float *out) {
  for (int64_t h = 0; h < heads; ++h) {
    float peak = stats[2 * h], sum = 0.f;
    for (int64_t p = 1; p < parts; ++p) peak = std::max(peak, stats[p * 2 * heads + 2 * h]);
    float *y = out + h * hd;
    std::fill(y, y + hd, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float *st = stats + p * 2 * heads + 2 * h, f = std::exp(st[0] - peak), *x = o + (p * heads + h) * hd;
      sum += f * st[1];
      for (int64_t d = 0; d < hd; ++d) y[d] += f * x[d];
    }
    for (int64_t d = 0; d < hd; ++d) y[d] /= sum;
  }
}

// Any other head size: plain loops.
template <typename T>
void attend_any(const Args<T> &a, int64_t row, int64_t g0, int64_t g1) {
  const int64_t hd = a.hd, width = a.kv * a.grp * hd, stride = a.stride();
  std::vector<float> s(a.ctx);
  const int64_t len = visible(a, row) - first(a, row);
  const int32_t *slots = a.row_slots(row) + first(a, row);
  for (int64_t h = g0 * a.grp; h < g1 * a.grp; ++h) {
    const float *q = a.q + row * width + h * hd;
    const T *kc = a.kc + (h / a.grp) * a.head_row(), *vc = a.vc + (h / a.grp) * a.head_row();
    for (int64_t j = 0; j < len; ++j) {
      float acc = 0.f;
      for (int64_t d = 0; d < hd; ++d) acc += q[d] * widen(kc[slots[j] * stride + d]);
      s[j] = acc * row_scale(kc + slots[j] * stride, hd);
    }
    softmax(s.data(), len);
    float *o = a.out + row * width + h * hd;
    std::fill(o, o + hd, 0.f);
    for (int64_t j = 0; j < len; ++j) {
      const float w = s[j] * row_scale(vc + slots[j] * stride, hd);
      for (int64_t d = 0; d < hd; ++d) o[d] += w * widen(vc[slots[j] * stride + d]);
    }
  }
}

template <typename T>
inline int64_t visible(const Args<T> &a, int64_t row) {
  return std::min<int64_t>(std::max<int32_t>(a.pos[row], 0) + 1, a.ctx);
}

// The first context position token `row` sees: 0, or the start of its sliding window.
template <typename T>
inline int64_t first(const Args<T> &a, int64_t row) {
  return a.window > 0 ? std::max<int64_t>(0, visible(a, row) - a.window) : 0;
}

constexpr int64_t SPLIT_KEYS = 64;  // fewest keys per core worth splitting one token's context for
constexpr int64_t QUERY_BLOCK = 32;  // queries per GEMM task: causal blocks stop at their last key
constexpr int64_t GEMM_MIN_QUERIES = 8;

// Queries [t0, t1) of one sequence against KV head g, for the grp query heads that share it.
template <typename T>
void attend_gemm(const Args<T> &a, int64_t t0, int64_t t1, int64_t g) {
  const int64_t hd = a.hd, width = a.kv * a.grp * hd, stride = a.stride(), m = t1 - t0;
  int64_t len = 0, lo = first(a, t0);  // keys [lo, len): a chunk's positions rise, so t0's window starts first
  for (int64_t t = t0; t < t1; ++t) len = std::max(len, visible(a, t)), lo = std::min(lo, first(a, t));
  const int64_t span = len - lo;
  thread_local std::vector<float> keys, vals, s;
  keys.resize(span * hd);
  vals.resize(span * hd);
  s.resize(m * span);
  const int32_t *slots = a.row_slots(t0) + lo;
  for (int64_t j = 0; j < span; ++j) {
    const T *k = a.kc + slots[j] * stride + g * a.head_row(), *v = a.vc + slots[j] * stride + g * a.head_row();
    const float sk = row_scale(k, hd), sv = row_scale(v, hd);
    for (int64_t d = 0; d < hd; ++d) {
      keys[j * hd + d] = widen(k[d]) * sk;
      vals[j * hd + d] = widen(v[d]) * sv;
    }
  }
  for (int64_t h = g * a.grp; h < (g + 1) * a.grp; ++h) {
    dnnl_sgemm('N', 'T', m, span, hd, 1.f, a.q + t0 * width + h * hd, width, keys.data(), hd, 0.f, s.data(), span);
    for (int64_t r = 0; r < m; ++r) {
      float *row = &s[r * span];
      const int64_t f = first(a, t0 + r) - lo, n = visible(a, t0 + r) - lo;
      softmax(row + f, n - f);
      std::fill(row, row + f, 0.f);
      std::fill(row + n, row + span, 0.f);
    }
    dnnl_sgemm('N', 'N', m, hd, span, 1.f, s.data(), span, vals.data(), hd, 0.f, a.out + t0 * width + h * hd, width);
  }
}

template <typename T>
void attend(const Args<T> &a, int64_t row, int64_t g0, int64_t g1) {
  const int64_t j0 = first(a, row), len = visible(a, row);
  float *o = a.out + row * a.kv * a.grp * a.hd;
  switch (a.hd) {
    case 64: return attend_row<64, T>(a, row, g0, g1, j0, len, o, nullptr);
    case 128: return attend_row<128, T>(a, row, g0, g1, j0, len, o, nullptr);
    default: return attend_any(a, row, g0, g1);
  }
}

// Part p of `parts` of token `row`'s context: all its heads over their share of the keys (whole key
// blocks), into part p's o and stats.
template <typename T>
void attend_part(const Args<T> &a, int64_t row, int64_t p, int64_t parts, float *o, float *stats) {
  const int64_t f = first(a, row), blocks = (visible(a, row) - f + KEY_BLOCK - 1) / KEY_BLOCK, heads = a.kv * a.grp;
  const int64_t j0 = f + blocks * p / parts * KEY_BLOCK, j1 = std::min(visible(a, row), f + blocks * (p + 1) / parts * KEY_BLOCK);
  o += p * heads * a.hd, stats += p * 2 * heads;
  if (a.hd == 64) attend_row<64, T>(a, row, 0, a.kv, j0, j1, o, stats);
  else attend_row<128, T>(a, row, 0, a.kv, j0, j1, o, stats);
}

template <typename T>
int run(void **params, int64_t **shapes, float *out, int64_t window) {
  Args<T> a{static_cast<const float *>(params[0]), static_cast<const T *>(params[1]),
            static_cast<const T *>(params[2]), static_cast<const int32_t *>(params[3]),
            static_cast<const int32_t *>(params[4]), static_cast<const int32_t *>(params[5]),
            out, shapes[0][0], shapes[1][1], shapes[1][2] - kernels::SCALE_BYTES<T>, 0, shapes[3][1], window};
  if (a.hd <= 0 || a.kv <= 0 || shapes[0][1] % (a.kv * a.hd)) return 1;
  a.grp = shapes[0][1] / (a.kv * a.hd);
  const int64_t n_rows = shapes[3][0];
  for (int64_t t = 0; t < a.n; ++t)
    if (a.rows[t] < 0 || a.rows[t] >= n_rows) return 1;
  // Tasks: one per token of a short run (KV heads [g0, g1)); one per (query block, KV head g) of a
  // long run.
  struct Task { int64_t t0, t1, g, g0, g1; };
  std::vector<Task> tasks;
  const bool fixed = kernels::deterministic();  // each token its own pass over its keys, in order
  for (int64_t t0 = 0, t1; t0 < a.n; t0 = t1) {
    for (t1 = t0 + 1; t1 < a.n && a.rows[t1] == a.rows[t0]; ++t1) {}
    if (t1 - t0 < GEMM_MIN_QUERIES || fixed) {
      for (int64_t t = t0; t < t1; ++t) tasks.push_back({t, t + 1, -1, 0, a.kv});
      continue;
    }
    for (int64_t b = t0; b < t1; b += QUERY_BLOCK)
      for (int64_t g = 0; g < a.kv; ++g) tasks.push_back({b, std::min(b + QUERY_BLOCK, t1), g, g, g + 1});
  }
  // Fewer tasks than cores (one sequence decoding): its keys split over the cores, each part
  // reading every KV head's share once, where the KV heads do not divide evenly among the cores
  // (SmolLM2's 3 on 2 cores left one core half idle); else each token's KV heads split over them;
  // or one core alone reads a short context. One token, 2048 keys, one layer, Zen 3, before ->
  // after the head split (with the key blocks above): llama2-7B's 32 KV heads of 128, bf16 KV
  // 5.6-6.4 -> 2.5-2.9 ms, fp32 7.9-8.9 -> 4.0-5.2 ms; SmolLM2 fp32 0.34 -> 0.19 ms.
  const int64_t cores = kernels::pinned_cores();
  if (!fixed && static_cast<int64_t>(tasks.size()) < cores && a.n == 1 && tasks[0].g < 0 && a.kv % cores &&
      (a.hd == 64 || a.hd == 128) && visible(a, 0) - first(a, 0) >= cores * SPLIT_KEYS) {
    const int64_t heads = a.kv * a.grp;
    thread_local std::vector<float> parts;  // each part's o, then each part's stats
    parts.resize(cores * heads * (a.hd + 2));
    float *o = parts.data(), *stats = o + cores * heads * a.hd;  // (a worker's `parts` is its own)
    kernels::Pool::get().run(cores, [&](int64_t p) { attend_part(a, 0, p, cores, o, stats); });
    merge(cores, heads, a.hd, o, stats, a.out);
    return 0;
  }
  if (static_cast<int64_t>(tasks.size()) < cores) {
    std::vector<Task> split;
    for (const Task &t : tasks) {
      const int64_t parts = t.g < 0 ? std::min(cores, a.kv) : 1;
      for (int64_t p = 0; p < parts; ++p)
        split.push_back({t.t0, t.t1, t.g, t.g0 + (t.g1 - t.g0) * p / parts, t.g0 + (t.g1 - t.g0) * (p + 1) / parts});
    }
    tasks.swap(split);
  }
  // Long tasks first, so the pool's one-at-a-time hand-out ends with the short ones.
  std::stable_partition(tasks.begin(), tasks.end(), [](const Task &t) { return t.g >= 0; });
  kernels::Pool::get().run(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const Task &t = tasks[i];
    if (t.g < 0) attend(a, t.t0, t.g0, t.g1);
    else attend_gemm(a, t.t0, t.t1, t.g);
  });
  return 0;
}

}  // namespace

extern "C" int PagedAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if ((nparam != 7 && nparam != 8) || std::strcmp(dtypes[0], "float32") || std::strcmp(dtypes[1], dtypes[2]) ||
      std::strcmp(dtypes[3], "int32") || std::strcmp(dtypes[4], "int32") || std::strcmp(dtypes[5], "int32") ||
      (nparam == 8 && std::strcmp(dtypes[6], "int32")))
    return 1;
  const int64_t window = nparam == 8 ? *static_cast<const int32_t *>(params[6]) : 0;
  float *out = static_cast<float *>(params[nparam - 1]);
  if (!std::strcmp(dtypes[1], "float32")) return run<float>(params, shapes, out, window);
  if (!std::strcmp(dtypes[1], "uint16")) return run<Bf16>(params, shapes, out, window);  // bfloat16 bits
  if (!std::strcmp(dtypes[1], "float16")) return run<_Float16>(params, shapes, out, window);
  if (!std::strcmp(dtypes[1], "int8")) return run<int8_t>(params, shapes, out, window);  // hd values + a float32 scale
  return 1;
}
