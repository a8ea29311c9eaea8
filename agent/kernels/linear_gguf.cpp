// Projections on GGUF's quantised blocks as the file stores them (gguf_blocks.h): y = rs * ((x * g) @ W^T).
// The activations are quantised per token and block of 32 to int8 (scale max|x * g| / 127, as
// llama.cpp's Q8_0 / Q8_K). Each row is read block by block and unpacked in registers into integers
// u (value = a u + b per 16 values, gguf::unpack); per 32 values and token, the exact int32 sums of
// u x q over each 16 (vpmaddubsw, vpmaddwd) times a x the token's scale go into 8 float lanes, even
// and odd chunks in two chains; the b terms are one dot product of the row's b with the token's
// 16-value sums at the end. Every token runs the same operations in the same order whatever else
// its step holds: batch 1 = batch N by construction.
//
// A call walks each row once per four tokens: a decode step streams the file's bytes once (about
// 0.56 bytes a weight for Q4_K against int8's 1.06); a prefill step finds a chunk of rows in cache
// after its first four tokens.
//
// Inputs: x [M, K] float32, w [B] uint8 (the segments' rows, each segment 64-byte aligned), seg [S, 3]
// int64 (GGML type, rows, byte offset of each segment of the output rows, in order), rs [N] float32
// (each output row's factor: the attention scale on the query rows), g [K] float32 (the norm gain in
// front). Output: y [M, N] float32.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "buffers.h"
#include "gguf_blocks.h"
#include "parallel.h"
#include "rows.h"

// The build's -fassociative-math would let GCC reorder the scalar sums below differently in each
// template instance (1-4 tokens): a token's bits would follow its step's size.
#pragma GCC optimize("no-associative-math")

namespace {

namespace gg = kernels::gguf;

// The 8 lanes' sum in one fixed order.
inline float lanes_sum(const float *l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }
constexpr int64_t QB = 32, ROWS = 16, MAX_SEGMENTS = 8;
constexpr int64_t AHEAD = 512;  // bytes of the row's stream prefetched ahead

struct Segment {
  int64_t type, rows, offset, row_bytes;
};

struct Weights {
  const uint8_t *w;
  Segment seg[MAX_SEGMENTS];
  int64_t count = 0, n = 0;
  const float *rs;

  // Output row r's bytes and type.
  const uint8_t *row(int64_t r, int64_t *type) const {
    for (int64_t s = 0;; r -= seg[s].rows, ++s)
      if (r < seg[s].rows || s + 1 == count) return *type = seg[s].type, w + seg[s].offset + r * seg[s].row_bytes;
  }
};

// Parses w, seg, rs, g at index i for inputs of width k; false if they do not describe such weights.
bool weights_at(int nparam, int i, void **params, int64_t **shapes, const char **dtypes, int64_t k, Weights *out) {
  if (nparam < i + 5 || std::strcmp(dtypes[i], "uint8") || std::strcmp(dtypes[i + 1], "int64") ||
      std::strcmp(dtypes[i + 2], "float32") || std::strcmp(dtypes[i + 3], "float32") || shapes[i + 3][0] != k ||
      k % QB || shapes[i + 1][1] != 3 || shapes[i + 1][0] < 1 || shapes[i + 1][0] > MAX_SEGMENTS)
    return false;
  const int64_t *seg = static_cast<const int64_t *>(params[i + 1]), bytes = shapes[i][0];
  *out = Weights{static_cast<const uint8_t *>(params[i])};
  for (int64_t s = 0; s < shapes[i + 1][0]; ++s) {
    const int64_t t = seg[3 * s], per = gg::block_values(t);
    if (!gg::block_bytes(t) || k % per) return false;
    Segment g{t, seg[3 * s + 1], seg[3 * s + 2], k / per * gg::block_bytes(t)};
    if (g.rows < 0 || g.offset < 0 || g.offset + g.rows * g.row_bytes > bytes) return false;
    out->seg[out->count++] = g, out->n += g.rows;
  }
  out->rs = static_cast<const float *>(params[i + 2]);
  return out->n == shapes[i + 2][0];
}

// A token's int8 values (q [k]), its block scales (d [k / 32]) and its 16-value sums times the scale (s [k / 16]).
void quantize(const float *x, const float *g, int64_t k, int8_t *q, float *d, float *s) {
  float h[QB];
  for (int64_t b = 0; b < k / QB; ++b) {
    float amax = 0.f;
    for (int64_t j = 0; j < QB; ++j) amax = std::max(amax, std::fabs(h[j] = x[b * QB + j] * g[b * QB + j]));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum[2] = {0, 0};
    for (int64_t j = 0; j < QB; ++j) sum[j / 16] += q[b * QB + j] = static_cast<int8_t>(std::nearbyint(h[j] * inv));
    d[b] = scale, s[2 * b] = scale * float(sum[0]), s[2 * b + 1] = scale * float(sum[1]);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256i nibbles(__m128i q) {  // bytes 0-15: the low nibbles, 16-31: the high ones
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

inline __m256i fifth_bits(const uint8_t *qh) {  // 0x10 in byte j where bit j of the 32 is set (llama.cpp's bytes_from_bits_32)
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i b = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuffle),
                                    _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

inline __m256i at32(const uint8_t *q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q)); }

// Values 32c .. 32c + 31 of the block at p as u (gguf::unpack's integers), in a register.
template <int64_t T>
inline __m256i chunk(const uint8_t *p, int c) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const auto q128 = [&](int at) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p + at)); };
  if constexpr (T == gg::Q4_0) return nibbles(q128(2));
  if constexpr (T == gg::Q4_1) return nibbles(q128(4));
  if constexpr (T == gg::Q5_0) return _mm256_or_si256(nibbles(q128(6)), fifth_bits(p + 2));
  if constexpr (T == gg::Q5_1) return _mm256_or_si256(nibbles(q128(8)), fifth_bits(p + 4));
  if constexpr (T == gg::Q8_0) return at32(p + 2);
  if constexpr (T == gg::Q4_K || T == gg::Q5_K) {
    const __m256i q = at32(p + (T == gg::Q5_K ? 48 : 16) + 32 * (c / 2));
    __m256i u = c % 2 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), m4) : _mm256_and_si256(q, m4);
    if constexpr (T == gg::Q5_K)  // bit c of qh[l]: the fifth bit of value l of this chunk
      u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(at32(p + 16), c), _mm256_set1_epi8(1)), 4));
    return u;
  }
  if constexpr (T == gg::Q6_K) {
    const int half = c / 4, r = c % 4;
    const __m256i l = at32(p + 64 * half + 32 * (r % 2)), qh = at32(p + 128 + 32 * half);
    const __m256i low = r < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
    return _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), _mm256_set1_epi8(3)), 4));
  }
  return _mm256_setzero_si256();
}
#endif

// sum over h of b[h] * s[h] for h < n (n even), 8 lanes in order, then the lanes in one fixed order.
inline float b_dot(const float *b, const float *s, int64_t n) {
  alignas(32) float l[8];
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const int64_t full = n / 8 * 8;
  for (int64_t h = 0; h < full; h += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(b + h), _mm256_loadu_ps(s + h), acc);
  if (full < n) {
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - full)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(b + full, tail), _mm256_maskload_ps(s + full, tail), acc);
  }
  _mm256_store_ps(l, acc);
#else
  std::fill(l, l + 8, 0.f);
  for (int64_t h = 0; h < n; ++h) l[h % 8] += b[h] * s[h];
#endif
  return lanes_sum(l);
}

// Tokens [0, M) (q [M, k] int8, d [M, k / 32] their scales, s [M, k / 16] their 16-value sums times d)
// against the row of type T at p: out[t]. Lanes 0-3 of a chunk's integer sums are its first 16
// values', 4-7 its second's; every lane of every token sums in block order, whatever M is, and the b
// terms are one dot product over the row's b at the end.
template <int64_t T, int M>
void dot_row(const uint8_t *p, const int8_t *q, const float *d, const float *s, int64_t k, float *out) {
  constexpr int64_t per = T == gg::Q4_K || T == gg::Q5_K || T == gg::Q6_K ? 256 : 32, chunks = per / 32;
  const int64_t nb = k / QB, bytes = gg::block_bytes(T);
  thread_local std::vector<float> row_b;
  row_b.resize(k / 16);
  alignas(32) float lanes[M][8];
#if defined(__AVX2__) && defined(__FMA__)
  const __m256i ones = _mm256_set1_epi16(1);
  // even and odd chunks sum in two chains of multiply-adds: one token alone waited on their latency
  __m256 even[M], odd[M];
  for (int t = 0; t < M; ++t) even[t] = odd[t] = _mm256_setzero_ps();
  float a[2][per / 16];
  // chunk ci = blk * chunks + c into acc: the block's factors are a[blk % 2] (written when c == 0)
  const auto step = [&](const uint8_t *blkp, int64_t blk, int c, __m256 (&acc)[M]) __attribute__((always_inline)) {
    const int64_t ci = blk * chunks + c;
    const float *f = a[blk % 2];
    const __m256i u = chunk<T>(blkp, c);
    const __m256 av = T == gg::Q6_K ? _mm256_set_m128(_mm_set1_ps(f[2 * c + 1]), _mm_set1_ps(f[2 * c]))
                                    : _mm256_set1_ps(f[2 * c]);
    for (int t = 0; t < M; ++t) {
      const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i *>(q + t * k + ci * QB));
      // u >= 0 (every type but Q8_0) is vpmaddubsw's unsigned operand as it is
      const __m256i prod = T == gg::Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u))
                                         : _mm256_maddubs_epi16(u, x);
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
      acc[t] = _mm256_fmadd_ps(sum, _mm256_mul_ps(av, _mm256_set1_ps(d[t * nb + ci])), acc[t]);
    }
  };
  const auto block = [&](int64_t blk) __attribute__((always_inline)) {
    const uint8_t *bp = p + blk * bytes;
    __builtin_prefetch(bp + AHEAD);
    gg::factors(T, bp, a[blk % 2], row_b.data() + blk * (per / 16));
    return bp;
  };
  const int64_t blocks = k / per;
  if constexpr (chunks == 1) {
    int64_t blk = 0;
    for (; blk + 1 < blocks; blk += 2) {
      const uint8_t *p0 = block(blk), *p1 = block(blk + 1);
      step(p0, blk, 0, even), step(p1, blk + 1, 0, odd);
    }
    if (blk < blocks) step(block(blk), blk, 0, even);
  } else {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const uint8_t *bp = block(blk);
#pragma GCC unroll 4
      for (int c = 0; c < chunks; c += 2) step(bp, blk, c, even), step(bp, blk, c + 1, odd);
    }
  }
  for (int t = 0; t < M; ++t) _mm256_store_ps(lanes[t], _mm256_add_ps(even[t], odd[t]));
#else
  float chains[2][M][8] = {};
  for (int64_t blk = 0; blk < k / per; ++blk, p += bytes) {
    int8_t u[per];
    float a[per / 16];
    gg::unpack(T, p, u, a, row_b.data() + blk * (per / 16));
    for (int c = 0; c < chunks; ++c)
      for (int t = 0; t < M; ++t)
        for (int l = 0; l < 8; ++l) {
          const int64_t ci = blk * chunks + c;
          int32_t sum = 0;
          for (int j = 0; j < 4; ++j) sum += int32_t(u[32 * c + 4 * l + j]) * q[t * k + ci * QB + 4 * l + j];
          chains[ci % 2][t][l] += float(sum) * (a[2 * c + l / 4] * d[t * nb + ci]);
        }
  }
  for (int t = 0; t < M; ++t)
    for (int l = 0; l < 8; ++l) lanes[t][l] = chains[0][t][l] + chains[1][t][l];
#endif
  for (int t = 0; t < M; ++t) out[t] = lanes_sum(lanes[t]) + (T == gg::Q8_0 ? 0.f : b_dot(row_b.data(), s + t * 2 * nb, 2 * nb));
}

using RowDot = void(const uint8_t *, const int8_t *, const float *, const float *, int64_t, float *);

template <int64_t T>
RowDot *row_dot(int m) {
  switch (m) {
    case 1: return dot_row<T, 1>;
    case 2: return dot_row<T, 2>;
    case 3: return dot_row<T, 3>;
    default: return dot_row<T, 4>;
  }
}

RowDot *row_dot(int64_t type, int m) {
  switch (type) {
    case gg::Q4_0: return row_dot<gg::Q4_0>(m);
    case gg::Q4_1: return row_dot<gg::Q4_1>(m);
    case gg::Q5_0: return row_dot<gg::Q5_0>(m);
    case gg::Q5_1: return row_dot<gg::Q5_1>(m);
    case gg::Q8_0: return row_dot<gg::Q8_0>(m);
    case gg::Q4_K: return row_dot<gg::Q4_K>(m);
    case gg::Q5_K: return row_dot<gg::Q5_K>(m);
    default: return row_dot<gg::Q6_K>(m);
  }
}

// y [m, n] for rows(i, buf) giving token i's k inputs (x, or the fused step before the projection into
// buf). A call walks each row once per four tokens: a decode step streams the weights once, a prefill
// step finds a row in cache after its first four tokens.
template <typename Row>
int gemm(int64_t m, int64_t k, const Weights &w, const float *g, float *y, Row row) {
  const int64_t nb = k / QB;
  kernels::line_vector<int8_t> q(m * k);
  kernels::line_vector<float> d(m * nb), s(m * 2 * nb);
  kernels::parallel_ranges(m, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf(k);
    for (int64_t i = b; i < e; ++i) quantize(row(i, buf.data()), g, k, &q[i * k], &d[i * nb], &s[i * 2 * nb]);
  });
  const int64_t n = w.n;
  kernels::parallel_chunks(n, ROWS, [&](int64_t r0, int64_t r1) {
    for (int64_t t = 0; t < m; t += 4) {
      const int left = int(std::min<int64_t>(4, m - t));
      for (int64_t r = r0; r < r1; ++r) {
        int64_t type;
        const uint8_t *p = w.row(r, &type);
        float out[4];
        row_dot(type, left)(p, &q[t * k], &d[t * nb], &s[t * 2 * nb], k, out);
        for (int j = 0; j < left; ++j) y[(t + j) * n + r] = w.rs[r] * out[j];
      }
    }
  });
  return 0;
}

}  // namespace

extern "C" {

int LinearGguf(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra) {
  const int64_t m = shapes[0][0], k = shapes[0][1];
  Weights w;
  if (nparam != 6 || std::strcmp(dtypes[0], "float32") || !weights_at(nparam, 1, params, shapes, dtypes, k, &w)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  return gemm(m, k, w, static_cast<const float *>(params[4]), static_cast<float *>(params[5]),
              [&](int64_t i, float *) { return x + i * k; });
}

// The residual add and RMSNorm feeding the projection. Inputs: x [M, K], delta [M, K], eps [1], w, seg, rs, g.
// Outputs: sum = x + delta [M, K], y = rms(sum) @ W^T [M, N].
int AddRmsLinearGguf(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                     void *extra) {
  const int64_t m = shapes[0][0], k = shapes[0][1];
  Weights w;
  if (nparam != 9 || std::strcmp(dtypes[0], "float32") || std::strcmp(dtypes[1], "float32") ||
      !weights_at(nparam, 3, params, shapes, dtypes, k, &w))
    return 1;
  const float *x = static_cast<const float *>(params[0]), *delta = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *sum = static_cast<float *>(params[7]);
  return gemm(m, k, w, static_cast<const float *>(params[6]), static_cast<float *>(params[8]), [&](int64_t i, float *buf) {
    kernels::add_rms_row(x + i * k, delta + i * k, eps, k, sum + i * k, buf);
    return static_cast<const float *>(buf);
  });
}

// SwiGLU or GeGLU feeding the down projection. Inputs: gu [M, 2K], [eps, activation], w, seg, rs, g. Output: [M, N].
int SwiGluLinearGguf(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                     void *extra) {
  const int64_t m = shapes[0][0], k = shapes[0][1] / 2;
  Weights w;
  if (nparam != 7 || std::strcmp(dtypes[0], "float32") || shapes[1][0] < 2 ||
      !weights_at(nparam, 2, params, shapes, dtypes, k, &w))
    return 1;
  const float *gu = static_cast<const float *>(params[0]);
  const float act = static_cast<const float *>(params[1])[1];
  return gemm(m, k, w, static_cast<const float *>(params[5]), static_cast<float *>(params[6]), [&](int64_t i, float *buf) {
    kernels::gated_row(gu + i * 2 * k, k, buf, act);
    return static_cast<const float *>(buf);
  });
}

// Rows of the embedding table as stored, dequantised as llama.cpp does, times scale [H] (Gemma's
// sqrt(hidden); ones elsewhere). Inputs: tokens [T] int32, w [B] uint8, seg [1, 3], scale [H]. Output: [T, H].
int EmbedGguf(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra) {
  if (nparam != 5 || std::strcmp(dtypes[0], "int32") || std::strcmp(dtypes[1], "uint8") ||
      std::strcmp(dtypes[2], "int64") || std::strcmp(dtypes[3], "float32") || shapes[2][0] != 1)
    return 1;
  const int64_t tokens = shapes[0][0], h = shapes[3][0], *seg = static_cast<const int64_t *>(params[2]);
  const int64_t type = seg[0], vocab = seg[1], per = gg::block_values(type), bytes = gg::block_bytes(type);
  if (!bytes || h % per || seg[2] + vocab * (h / per) * bytes > shapes[1][0]) return 1;
  const int32_t *ids = static_cast<const int32_t *>(params[0]);
  const uint8_t *w = static_cast<const uint8_t *>(params[1]) + seg[2];
  const float *scale = static_cast<const float *>(params[3]);
  float *y = static_cast<float *>(params[4]);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t id = std::clamp<int64_t>(ids[t], 0, vocab - 1);
    float *out = y + t * h;
    for (int64_t b = 0; b < h / per; ++b) gg::dequantize(type, w + (id * (h / per) + b) * bytes, out + b * per);
    for (int64_t j = 0; j < h; ++j) out[j] *= scale[j];
  }
  return 0;
}

// Rows [n, k] of one type dequantised (tests, and the reference forward): inputs w [n, row bytes] uint8, type [1] int64.
int DequantizeGguf(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                   void *extra) {
  if (nparam != 3 || std::strcmp(dtypes[0], "uint8") || std::strcmp(dtypes[2], "float32")) return 1;
  const int64_t type = *static_cast<const int64_t *>(params[1]), per = gg::block_values(type), bytes = gg::block_bytes(type);
  const int64_t n = shapes[2][0], k = shapes[2][1];
  if (!bytes || k % per || shapes[0][0] != n || shapes[0][1] != k / per * bytes) return 1;
  const uint8_t *w = static_cast<const uint8_t *>(params[0]);
  float *y = static_cast<float *>(params[2]);
  for (int64_t i = 0; i < n * (k / per); ++i) gg::dequantize(type, w + i * bytes, y + i * per);
  return 0;
}

const char *GgufKernelPath() {
#if defined(__AVX2__) && defined(__FMA__)
  return "gguf blocks as stored: int8 activations per 32, AVX2 vpmaddubsw + vpmaddwd on blocks unpacked in registers";
#else
  return "gguf blocks as stored: int8 activations per 32, scalar (no AVX2)";
#endif
}

}  // extern "C"
