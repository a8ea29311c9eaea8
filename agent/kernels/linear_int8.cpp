// W8A8 projection: y = (x * g) @ w^T with int8 weights and int8 activations, both with one float
// scale per group of G consecutive inputs (G a multiple of 4). Weights come quantised (qw [N, Kp],
// scales sw [N, Kp/G]); activations are quantised per token and group on the fly (scale =
// max|x * g| / 127 over the group). Products are summed exactly in int32 within a group and scaled
// once per group. A decode step streams a quarter of the fp32 bytes.
//
// Layout: a row is cut into blocks of 8 groups (8G bytes), and within a block the bytes are
// interleaved so that 32-byte vector t holds bytes 4t..4t+3 of each of the 8 groups: the int32
// lane l of an accumulator then sums group l alone, and a block ends with one convert and one
// fused multiply-add by the vector of its 8 (activation x weight) scales. Scaling every group in
// its own instructions cost 25-45% of the multiply-adds' time at G = 64 (measured: prefill 0.86x
// of fp32 against 1.16x with one scale per row). agent/model/quant.py writes weights in this order.
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
// Inputs: x [M, K] float32, qw [N, Kp] int8 (Kp a multiple of 8G, zero-padded), sw [N, Kp/G]
// float32, g [K] float32. Output: y [M, N] float32.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "buffers.h"
#include "dnnl.h"
#include "int8_channel.h"
#include "parallel.h"
#include "rows.h"

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define OFFSET 1
#else
#define OFFSET 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define WIDE 1  // unsigned-activation tiles in 512-bit vectors (tile_wide)
#else
#define WIDE 0
#endif

namespace {

constexpr int64_t KB = 32;   // bytes per vector step
constexpr int64_t LANES = 8; // groups per block: one per int32 lane
// Channels per tile. With 16 ymm registers (AVX2 without AVX-512VL), 3 tokens x 3 channels is
// the largest tile whose 9 int32 accumulators, 3 weight vectors and the activation's temporaries
// all stay in registers: 3 x 4 spilled every accumulator to the stack on each 32-byte step. Zen 3,
// one core, in cache, K = 1536 / 576: 3 x 3 with the float sums in memory and the k loop unrolled
// twice 54 / 46 GMAC/s against 46 / 40 for 3 x 4 (mean of 8 alternating runs).
// With AVX-512VL's 32 registers, 4 tokens x 4 channels: 16 accumulators, 8 loads per 16 multiply-adds
// (3 x 4: 7 per 12). Zen 4, one core, int8 tile 3-4% faster than 3 x 4; 4 x 6 and 5 x 4 spill
// (0.85x and 0.9x).
#if defined(__AVX512VL__)
constexpr int TILE_M = 4;
constexpr int TILE_N = 4;
#else
constexpr int TILE_M = 3;
constexpr int TILE_N = 3;
#endif
// Output channels per cache block: NBLK x Kp bytes of weights stay in L1/L2 across tokens; a
// multiple of the tile's channels.
constexpr int64_t NBLK = TILE_N == 4 ? 32 : 48;
constexpr int64_t PF_ROWS = 4;  // weight rows prefetched ahead of the tile's
// Up to this many tokens a call walks the weight rows one at a time: one sequential stream from
// DRAM. Four rows at a time (4 streams, each only Kp bytes long) kept the prefetchers behind: SmolLM2's
// 30 layers at M = 1 took 14.6 ms (8 GB/s) against 8.8 ms (14 GB/s) one row at a time, and at
// M = 3 and 4 17.0 / 16.4 ms against 10.0 / 13.4 (Zen 3, AVX2); from 8 tokens, where the weights
// are reused from cache, 4 rows share each activation load again.
constexpr int64_t STREAM_M = 4;

struct Shape {
  int64_t kp, gs, ng;    // padded width, group size, groups per row
  bool channel = false;  // one scale per output channel: oneDNN's packed weights (int8_channel.cpp)
};

// Position of input i (of a row) in the interleaved layout.
inline int64_t slot(int64_t i, int64_t gs) {
  const int64_t block = i / (LANES * gs), in = i % (LANES * gs), lane = in / gs, e = in % gs;
  return block * LANES * gs + (e / 4) * KB + lane * 4 + e % 4;
}

// max |x[i] * g[i]| over [b, e).
float scaled_max(const float *x, const float *g, int64_t b, int64_t e) {
  float amax = 0.f;
  int64_t i = b;
#if defined(__AVX2__)
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (; i + 8 <= e; i += 8)
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(abs_mask, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(g + i))));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; i < e; ++i) amax = std::max(amax, std::fabs(x[i] * g[i]));
  return amax;
}

// Quantises row x[0..k) * g into q (interleaved, zero-padded to kp), one scale per group into s.
// Vectorised, four inputs at a time into their 4-byte slot: element by element (a slot() with three
// divisions each) it took a third of a 256-token down projection's time (K = 1536, Zen 4). The same
// float operations in the same order, and cvtps rounds to nearest even as nearbyint does: the same bytes.
void quantize_row(const float *x, const float *g, int64_t k, Shape sh, bool offset, int8_t *q, float *s) {
  std::memset(q, 0, sh.kp);
  for (int64_t b = 0; b < sh.kp; b += sh.gs) {
    const int64_t e = std::min(k, b + sh.gs);
    const float amax = scaled_max(x, g, b, e), inv = amax > 0.f ? 127.f / amax : 0.f;
    int64_t i = b;
#if defined(__AVX2__)
    // Group b / gs is lane (b / gs) % 8 of its block; its inputs 4j..4j+3 fill bytes 32j + 4 lane.
    int8_t *dst = q + (b / (LANES * sh.gs)) * LANES * sh.gs + ((b / sh.gs) % LANES) * 4;
    const __m128 vinv = _mm_set1_ps(inv);
    for (; i + 4 <= e; i += 4) {
      __m128i r = _mm_cvtps_epi32(_mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(x + i), _mm_loadu_ps(g + i)), vinv));
      const __m128i p8 = _mm_packs_epi16(_mm_packs_epi32(r, r), r);
      const int32_t packed = _mm_cvtsi128_si32(offset ? _mm_add_epi8(p8, _mm_set1_epi8(static_cast<char>(0x80))) : p8);
      std::memcpy(dst + (i - b) / 4 * KB, &packed, 4);
    }
#endif
    for (; i < e; ++i)
      q[slot(i, sh.gs)] = static_cast<int8_t>(static_cast<int>(std::nearbyint(x[i] * g[i] * inv)) + (offset ? 128 : 0));
    s[b / sh.gs] = amax / 127.f;
  }
}

#if defined(__AVX2__)
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): the order sum_lanes adds in, so a row's result
// has the same bits in any tile (batch 1 and batch N give the same tokens).
inline float hsum(__m256 v) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v, v), _mm256_hadd_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// out[o] = the sum of the 8 lanes of v[o], for o < N: eight at a time by a transpose of pair sums
// (7 adds and 2 permutes for 8 outputs against 6 operations each); 4% of a 3 x 3 tile's time at K = 576.
template <int N>
inline void sum_lanes(const __m256 (&v)[N], float *out) {
  int o = 0;
  for (; o + 8 <= N; o += 8) {
    const __m256 t0 = _mm256_hadd_ps(v[o], v[o + 1]), t1 = _mm256_hadd_ps(v[o + 2], v[o + 3]);
    const __m256 t2 = _mm256_hadd_ps(v[o + 4], v[o + 5]), t3 = _mm256_hadd_ps(v[o + 6], v[o + 7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [o..o+3 low | o..o+3 high], o+4..
    _mm256_storeu_ps(out + o, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
  }
  for (; o < N; ++o) out[o] = hsum(v[o]);
}

// The same for the float sums at f + 8o (in the same order: the same bits).
inline void sum_lanes(const float *f, int n, float *out) {
  int o = 0;
  for (; o + 8 <= n; o += 8, f += 64) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_load_ps(f), _mm256_load_ps(f + 8));
    const __m256 t1 = _mm256_hadd_ps(_mm256_load_ps(f + 16), _mm256_load_ps(f + 24));
    const __m256 t2 = _mm256_hadd_ps(_mm256_load_ps(f + 32), _mm256_load_ps(f + 40));
    const __m256 t3 = _mm256_hadd_ps(_mm256_load_ps(f + 48), _mm256_load_ps(f + 56));
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    _mm256_storeu_ps(out + o, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
  }
  for (; o < n; ++o, f += 8) out[o] = hsum(_mm256_load_ps(f));
}

#if OFFSET
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i w) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // The instruction itself, accumulating in place: with the intrinsic GCC 12 copied every
  // accumulator twice per step (24 register moves per 12 multiply-adds in the 3 x 4 tile).
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(w));
  return acc;
#else
  return _mm256_dpbusd_avx_epi32(acc, u, w);
#endif
}

// comp[j * ng + g] = 128 x (the sum of channel j's weights in group g), for `rows` channels of w:
// what the +128 offset of the activations adds to that group's sums (same lanes as the tiles).
void compensate(const int8_t *w, Shape s, int64_t rows, int32_t *comp) {
  const __m256i c128 = _mm256_set1_epi8(static_cast<char>(0x80));
  const int64_t block = LANES * s.gs;
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t b0 = 0; b0 < s.kp; b0 += block) {
      __m256i acc = _mm256_setzero_si256();
      for (int64_t k = b0; k < b0 + block; k += KB)
        acc = dpbusd(acc, c128, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + j * s.kp + k)));
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(comp + j * s.ng + b0 / s.gs), acc);
    }
}
#endif

inline __m256i dot_add(__m256i acc, __m256i ax, __m256i x, __m256i w) {
#if OFFSET
  return dpbusd(acc, ax, _mm256_sign_epi8(w, x));
#else
  const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

// One block's int32 sums (8 lanes, one per group), less the offset's compensation, scaled by the
// activation x weight scales into the float sums f.
inline void scale_block(__m256i acc, __m256 xs, const float *sw, const int32_t *cw, bool u, float *f) {
  if (u) acc = _mm256_sub_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(cw)));
  _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(xs, _mm256_loadu_ps(sw)), _mm256_load_ps(f)));
}

#if WIDE
// tile<.., true> in 512-bit vectors: a multiply-add covers two 32-byte steps of a block (lanes 8-15
// sum the same 8 groups as lanes 0-7; the halves are added once per block), so a block takes half
// the loads and multiply-adds, which CPUs with two 512-bit integer units (Xeon Ice Lake and later)
// also issue twice as fast. A 32-byte step (a block starting mid-line, or an odd count of steps:
// G = 36) zero-extends into the low half, so every 64-byte load stays within one cache line.
// Same int32 sums as tile<.., true>: the same bits out.
template <int MB, int NB>
void tile_wide(const int8_t *x, const float *sx, const int8_t *w, const float *sw, const int32_t *cw, Shape s,
               bool pf, float *out) {
  alignas(32) float accf[MB][NB][8] = {};
  const int64_t block = LANES * s.gs;
  auto full = [](const int8_t *p) { return _mm512_loadu_si512(p); };
  auto half = [](const int8_t *p) { return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))); };
  for (int64_t b0 = 0, g0 = 0; b0 < s.kp; b0 += block, g0 += LANES) {
    __m512i acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
    auto step = [&](int64_t k, auto load) __attribute__((always_inline)) {  // inlined: acc stays in registers
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = load(w + j * s.kp + k);
      if (pf && k % 64 == 0)  // as in tile: the first pass over a cache block
        for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char *>(w + (j + PF_ROWS) * s.kp + k), _MM_HINT_NTA);
      for (int i = 0; i < MB; ++i) {
        const __m512i xv = load(x + i * s.kp + k);
        for (int j = 0; j < NB; ++j) asm("vpdpbusd %2, %1, %0" : "+v"(acc[i][j]) : "v"(xv), "v"(wv[j]));
      }
    };
    int64_t k = b0;
    if (k % 64) step(k, half), k += KB;
#pragma GCC unroll 2
    for (; k + 64 <= b0 + block; k += 64) step(k, full);
    if (k < b0 + block) step(k, half);
    for (int i = 0; i < MB; ++i) {
      const __m256 xs = _mm256_loadu_ps(sx + i * s.ng + g0);
      for (int j = 0; j < NB; ++j) {
        const __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(acc[i][j]), _mm512_extracti64x4_epi64(acc[i][j], 1));
        scale_block(sum, xs, sw + j * s.ng + g0, cw + j * s.ng + g0, true, accf[i][j]);
      }
    }
  }
  sum_lanes(&accf[0][0][0], MB * NB, out);
}
#endif

// MB tokens x NB channels: every weight vector loaded once for MB tokens, every activation vector
// once for NB channels; exact int32 sums per group (lane), scaled into float sums per block. The
// float sums live in memory (touched once per block of 8 groups), so the int32 accumulators get
// the registers.
template <int MB, int NB, bool U>
void tile_blocks(const int8_t *x, const float *sx, const int8_t *w, const float *sw, const int32_t *cw, Shape s,
                 bool pf, float *out) {
  alignas(32) float sums[MB][NB][8] = {};
  float *accf = &sums[0][0][0];
#if defined(__AVX512VL__)
  // The float sums stay in memory: left visible, GCC 12 kept them in registers beside the 16 int32
  // accumulators, and spilled and shuffled the lot around every block (37 vectors for 32 registers;
  // the tile's code was twice the size). Through the opaque pointer: 1.02-1.04x on SmolLM2's shapes
  // at 64 and 256 tokens, one and two cores, Zen 4, same bits. Not in the AVX2 build (3 x 3 tiles,
  // 16 registers): there it made 576 x 3072 1.08-1.11x slower (its code built -march=znver3).
  asm("" : "+r"(accf));
#endif
  const int64_t block = LANES * s.gs;
  // g0: the block's first group (a running count: a division per block cost ~10% at G = 36)
  for (int64_t b0 = 0, g0 = 0; b0 < s.kp; b0 += block, g0 += LANES) {
    __m256i acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int64_t k = b0; k < b0 + block; k += KB) {
      __m256i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + j * s.kp + k));
      // The rows PF_ROWS ahead, one line per 64 bytes: the hardware prefetcher alone kept a decode
      // step's weight stream at ~9 GB/s from DRAM (oneDNN's sgemm reached 16-25). Non-temporal: a
      // step streams every weight once, and as T0 lines they pushed the step's other state (the KV
      // cache, MindSpore's and Python's) out of the caches: SmolLM2 int8 B=1 step 5-11% faster, 7
      // pairs of 400-600 steps, 6 faster; 64 rows no slower (Zen 3). Only on the first pass over a
      // cache block (`pf`): later passes find the weights in cache, and the prefetches cost 15% of
      // a compute-bound tile's time (Zen 4, one core, 64-256 tokens).
      if (pf && k % 64 == 0)
        for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char *>(w + (j + PF_ROWS) * s.kp + k), _MM_HINT_NTA);
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + i * s.kp + k));
#if OFFSET
        if constexpr (U) {
          for (int j = 0; j < NB; ++j) acc[i][j] = dpbusd(acc[i][j], xv, wv[j]);
          continue;
        }
#endif
        const __m256i ax = _mm256_sign_epi8(xv, xv);
        for (int j = 0; j < NB; ++j) acc[i][j] = dot_add(acc[i][j], ax, xv, wv[j]);
      }
    }
    for (int i = 0; i < MB; ++i) {
      const __m256 xs = _mm256_loadu_ps(sx + i * s.ng + g0);
      for (int j = 0; j < NB; ++j)
        scale_block(acc[i][j], xs, sw + j * s.ng + g0, cw + j * s.ng + g0, U, accf + (i * NB + j) * 8);
    }
  }
  sum_lanes(accf, MB * NB, out);
}

// tile_blocks for rows of one block (K = 576 at G = 72: every SmolLM2 projection but the down one):
// the scaled sums go from registers to the lanes' totals. Per perf the start and end of a 4 x 4
// tile were a third of its time at K = 576: zeroing, storing and reloading the float sums.
// fmul(x, s) = fma(x, s, 0): the same bits as tile_blocks. Its step loop is tile_blocks' own, written
// out again: shared through an always-inline helper (acc by reference), GCC 12 made both tiles
// 1-3% slower (M = 4: 1.03x from DRAM; 576 x 3072 and 1536 x 576 at 64 tokens 1.01x, Zen 4).
template <int MB, int NB, bool U>
void tile_one(const int8_t *x, const float *sx, const int8_t *w, const float *sw, const int32_t *cw, Shape s,
              bool pf, float *out) {
  __m256i acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
  // A row has at least one step: told so, GCC drops the path of none, for which it had kept the
  // accumulators in memory (16 stores and 16 loads a tile; 576 x 3072 at 64-256 tokens 1.06x faster
  // without them, Zen 4).
  if (s.kp <= 0) __builtin_unreachable();
#pragma GCC unroll 2
  for (int64_t k = 0; k < s.kp; k += KB) {
    __m256i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + j * s.kp + k));
    if (pf && k % 64 == 0)
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char *>(w + (j + PF_ROWS) * s.kp + k), _MM_HINT_NTA);
    for (int i = 0; i < MB; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + i * s.kp + k));
#if OFFSET
      if constexpr (U) {
        for (int j = 0; j < NB; ++j) acc[i][j] = dpbusd(acc[i][j], xv, wv[j]);
        continue;
      }
#endif
      const __m256i ax = _mm256_sign_epi8(xv, xv);
      for (int j = 0; j < NB; ++j) acc[i][j] = dot_add(acc[i][j], ax, xv, wv[j]);
    }
  }
  __m256 v[MB * NB];
  for (int i = 0; i < MB; ++i) {
    const __m256 xs = _mm256_loadu_ps(sx + i * s.ng);
    for (int j = 0; j < NB; ++j) {
      __m256i a = acc[i][j];
      if (U) a = _mm256_sub_epi32(a, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(cw + j * s.ng)));
      v[i * NB + j] = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(xs, _mm256_loadu_ps(sw + j * s.ng)));
    }
  }
  sum_lanes(v, out);
}

template <int MB, int NB, bool U>
void tile(const int8_t *x, const float *sx, const int8_t *w, const float *sw, const int32_t *cw, Shape s,
          bool pf, float *out) {
  if (s.kp == LANES * s.gs) return tile_one<MB, NB, U>(x, sx, w, sw, cw, s, pf, out);
  tile_blocks<MB, NB, U>(x, sx, w, sw, cw, s, pf, out);
}
#else
template <int MB, int NB, bool U>
void tile(const int8_t *x, const float *sx, const int8_t *w, const float *sw, const int32_t *, Shape s, bool,
          float *out) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float acc = 0.f;
      for (int64_t gi = 0; gi < s.ng; ++gi) {
        int32_t d = 0;
        for (int64_t e = gi * s.gs; e < (gi + 1) * s.gs; ++e) {
          const int64_t p = slot(e, s.gs);
          d += int32_t(x[i * s.kp + p]) * int32_t(w[j * s.kp + p]);
        }
        acc += float(d) * sx[i * s.ng + gi] * sw[j * s.ng + gi];
      }
      out[i * NB + j] = acc;
    }
}
#endif

#if WIDE
// Whether unsigned-activation tiles run in 512-bit vectors, timed once per process on a 64 x 128
// product at K = 576 (in cache, ~3 ms) and kept if 5% faster: AMD's Zen 4 splits a 512-bit vpdpbusd
// into two 256-bit halves, and there tile_wide ran at 0.77-0.92x of tile from 16 tokens (one core,
// SmolLM2's shapes; 1.02-1.04x at 4), while Xeons with two 512-bit units issue it at the 256-bit
// rate (not measured here: no such CPU). Both give the same bits. LLM_SERVING_INT8_VECTOR=256 or
// 512 skips the timing.
bool wide_tiles() {
  static const bool wide = [] {
    const char *v = std::getenv("LLM_SERVING_INT8_VECTOR");
    if (v && *v) return std::strcmp(v, "512") == 0;
    constexpr int64_t M = 64, N = 128;
    const Shape s{576, 36, 16};
    kernels::line_vector<int8_t> x(M * s.kp, 3), w((N + PF_ROWS) * s.kp, 5);
    const std::vector<float> sx(M * s.ng, 1.f), sw(N * s.ng, 1.f);
    const std::vector<int32_t> cw(N * s.ng, 0);
    float out[TILE_M * TILE_N];
    volatile float sink = 0.f;  // keeps the timed tiles from being optimised away
    auto best = [&](auto tile_fn, double &t) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < M; i += TILE_M)
        for (int64_t j = 0; j < N; j += TILE_N) {
          tile_fn(x.data() + i * s.kp, sx.data() + i * s.ng, w.data() + j * s.kp, sw.data() + j * s.ng,
                  cw.data() + j * s.ng, s, false, out);
          sink = sink + out[0];
        }
      t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    };
    double narrow = 1e9, wide = 1e9;
    for (int r = 0; r < 11; ++r) {
      best(tile<TILE_M, TILE_N, true>, narrow);
      best(tile_wide<TILE_M, TILE_N>, wide);
    }
    return wide < 0.95 * narrow;
  }();
  return wide;
}
#endif

// Channels [n0, n0 + NBLK) of one call: weights, scales, and their compensation rows (OFFSET).
struct Channels {
  const int8_t *qw;
  const float *sw;
  const int32_t *comp;
  int64_t n0;
  bool pf;  // prefetch the weights ahead: the first tokens' pass over the block
};

template <int MB, int NB, bool U>
void run_tile(const int8_t *qx, const float *sx, Channels c, Shape s, int64_t n, float *y, int64_t ldy) {
  float out[MB * NB];
  const int8_t *w = c.qw + n * s.kp;
  const float *sw = c.sw + n * s.ng;
  const int32_t *cw = c.comp + (n - c.n0) * s.ng;
#if WIDE
  if (U && wide_tiles())
    tile_wide<MB, NB>(qx, sx, w, sw, cw, s, c.pf, out);
  else
#endif
    tile<MB, NB, U>(qx, sx, w, sw, cw, s, c.pf, out);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + n + j] = out[i * NB + j];
}

// The next cache block's weight rows, brought into L2 a few lines after each tile of the passes
// that find this block's rows in L1, so the next block's first pass does not wait on DRAM (PF_ROWS
// rows ahead alone are ~2 KiB, less than the memory latency at compute speed); a pass's share at
// once (up to 256 lines) queued behind the core's outstanding misses: 1.14x slower at 16 tokens.
// Weights from DRAM (40 copies), both cores, Zen 4, same process, both orders, new / old time:
// 576 x 3072 at 8 / 32 / 64 / 128 tokens 0.79-0.82x / 0.91-0.95x / 0.97x / 0.99x; 1536 x 576
// (blocks past L1) 0.91-1.02x / 0.93-0.98x / 0.98-1.0x / 0.99-1.02x. Same bits.
struct Ahead {
  const char *p = nullptr;
  int64_t line = 0, lines = 0, per = 0;  // next line, lines in all, lines after each tile
  void step() {
    for (const int64_t end = std::min(lines, line + per); line < end; ++line) __builtin_prefetch(p + 64 * line, 0, 2);
  }
};

// Tokens [m0, m0+MB) against channels [b, e): up to TILE_M tokens x TILE_N channels, 9-16
// independent multiply-add chains (2 x 2 kept the multiply-adds waiting on their own latency: int8
// 0.64-0.84x of fp32 in 64-256-token steps on a Zen 4, 1.0-1.4x with 3 x 4);
// `one_row`: a channel at a time (STREAM_M).
template <int MB, bool U>
void token_block(const int8_t *qx, const float *sx, Channels c, Shape s, int64_t b, int64_t e, float *y,
                 int64_t ldy, bool one_row, Ahead &ahead) {
  int64_t n = b;
  if (!one_row) {
    for (; n + TILE_N <= e; n += TILE_N) run_tile<MB, TILE_N, U>(qx, sx, c, s, n, y, ldy), ahead.step();
    for (; n + 2 <= e; n += 2) run_tile<MB, 2, U>(qx, sx, c, s, n, y, ldy);
  }
  for (; n < e; ++n) run_tile<MB, 1, U>(qx, sx, c, s, n, y, ldy);
}

// All m tokens against channels [n0, n1), TILE_M tokens at a time, then 3 and 2; a tail of one
// token becomes 3 + 2 or 2 + 2 (a one-token tile reads its weights for a third of the work: 1.5% of a
// 64-row int8 decode step). Only the first pass prefetches the block's weights (with STREAM_M
// rows or fewer, every pass).
template <bool U>
void channel_block(int64_t m, const int8_t *qx, const float *sx, Channels c, Shape s, int64_t n0, int64_t n1,
                   float *y, int64_t n, int64_t ldy) {
  const bool one_row = m <= STREAM_M;
  const int64_t tail = m % TILE_M == 1 && m > TILE_M ? TILE_M + 1 : m % TILE_M;
  Ahead none, next;
  if (!one_row) {  // spread over the tiles of every pass but the first
    const int64_t tiles = (m / TILE_M - 1) * ((n1 - n0) / TILE_N);
    next.p = reinterpret_cast<const char *>(c.qw + n1 * s.kp);
    next.lines = (std::min(n, 2 * n1 - n0) - n1) * s.kp / 64;
    next.per = tiles > 0 ? (next.lines + tiles - 1) / tiles : 0;
  }
  auto run = [&](auto mb, int64_t i) {
    token_block<decltype(mb)::value, U>(qx + i * s.kp, sx + i * s.ng, c, s, n0, n1, y + i * ldy, ldy, one_row,
                                        i == 0 ? none : next);
    c.pf = one_row;  // a channel at a time, each pass streams its block again
  };
  int64_t i = 0;
  for (; i < m - tail; i += TILE_M) run(std::integral_constant<int, TILE_M>{}, i);
  if constexpr (TILE_M > 3)
    for (; i + 3 <= m; i += 3) run(std::integral_constant<int, 3>{}, i);
  for (; i + 2 <= m; i += 2) run(std::integral_constant<int, 2>{}, i);
  if (i < m) run(std::integral_constant<int, 1>{}, i);
}

// Parses qw [N, Kp] int8, sw [N, Kp/G], g [K] at params index w for inputs of width k; or, with
// one scale per channel (sw [N, 1]), qw as oneDNN's packed bytes for [k, N].
bool weight_shape(int nparam, int w, int64_t **shapes, const char **dtypes, int64_t k, Shape *s, int64_t *n) {
  if (nparam <= w + 2 || std::strcmp(dtypes[w], "int8") || std::strcmp(dtypes[w + 1], "float32") ||
      std::strcmp(dtypes[w + 2], "float32") || shapes[w + 2][0] != k)
    return false;
  *n = shapes[w + 1][0];
  if (shapes[w + 1][1] == 1) {
    *s = Shape{k, k, 1, true};
    const int64_t bytes = kernels::int8_channel_bytes(k, *n);
    return bytes > 0 && shapes[w][0] == bytes;
  }
  *s = Shape{shapes[w][1], 0, shapes[w + 1][1]};
  if (s->ng <= 0 || s->kp % s->ng || shapes[w][0] != *n) return false;
  s->gs = s->kp / s->ng;
  return s->ng % LANES == 0 && s->gs % 4 == 0 && s->kp >= k && s->kp - k < LANES * s->gs;
}

// LoRA's shrink on an int8 base (agent/model/lora.py): every adapter slot's A rows, float32 [e, k]
// after the weight's inputs (slot s's e / slots rows in turn), times the projection's float input as
// it is before quantisation, into the output's columns n.. n + e: an int8 base serves its adapters
// in float, as they were trained. With each token's slot one-hot [m, slots] after A (as the decoder
// stack passes it), a token gets its own slot's columns alone (the others zeros), a step of the base
// model none: every slot for every token cost SmolLM2's int8 steps 0.86x of their time.
struct Shrink {
  const float *a = nullptr;
  int64_t e = 0;
  const float *mask = nullptr;  // none: every slot's columns for every token
  int64_t slots = 0;

  int64_t slot(int64_t t) const {  // token t's slot, -1: none
    for (int64_t s = 0; s < slots; ++s)
      if (mask[t * slots + s] != 0.f) return s;
    return -1;
  }
  bool any(int64_t m) const {
    if (!e || !mask) return e > 0;
    for (int64_t t = 0; t < m; ++t)
      if (slot(t) >= 0) return true;
    return false;
  }
};

// The op's inputs at w (qw, sw, g), then with one input more A, with two A and the tokens' slots.
bool weights_at(int nparam, int w, int64_t **shapes, const char **dtypes, int64_t m, int64_t k, int plain, Shape *s,
                int64_t *n, Shrink *sh, void **params) {
  if (nparam == plain + 1 || nparam == plain + 2) {
    if (std::strcmp(dtypes[w + 3], "float32") || shapes[w + 3][1] != k) return false;
    *sh = Shrink{static_cast<const float *>(params[w + 3]), shapes[w + 3][0]};
  } else if (nparam != plain) {
    return false;
  }
  if (nparam == plain + 2) {
    sh->mask = static_cast<const float *>(params[w + 4]), sh->slots = shapes[w + 4][1];
    if (std::strcmp(dtypes[w + 4], "float32") || shapes[w + 4][0] < m || sh->slots < 1 || sh->e % sh->slots) return false;
  }
  return weight_shape(nparam, w, shapes, dtypes, k, s, n);
}

// Row x[0..k) * g quantised to s8 with one scale, max|x * g| / 127 (per token). Vectorised as
// quantize_row, with the same operations (cvtps rounds to nearest even, as nearbyint does).
void quantize_token(const float *x, const float *g, int64_t k, int8_t *q, float *scale) {
  const float amax = scaled_max(x, g, 0, k), inv = amax > 0.f ? 127.f / amax : 0.f;
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= k; i += 8) {
    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(g + i)), vinv));
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i *>(q + i), _mm_packs_epi16(w16, w16));
  }
#endif
  for (; i < k; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * g[i] * inv));
  *scale = amax / 127.f;
}

// out[j] = x . a[j] for the e rows of a [e, k], each sum in one order that depends on k alone (one
// vector of partial sums over k, added up lane by lane, then the tail): a token's adapter columns are
// the same bits whatever else its step holds. oneDNN's sgemm blocked by the rows it was given, so
// identical tokens of one adapter gathered into one call came back apart. C rows of a at a time share
// the loads of x (C independent sums: the FMA latency hides); each row's order is the same for any C.
template <int C>
void dot_rows_of(const float *x, const float *a, int64_t k, float *out) {
  float sum[C] = {};
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(v, _mm512_loadu_ps(a + c * k + i), acc[c]);
  }
  for (int c = 0; c < C; ++c) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[c]);
    for (float l : lanes) sum[c] += l;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(v, _mm256_loadu_ps(a + c * k + i), acc[c]);
  }
  for (int c = 0; c < C; ++c) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[c]);
    for (float l : lanes) sum[c] += l;
  }
#endif
  for (int c = 0; c < C; ++c) {
    for (int64_t t = i; t < k; ++t) sum[c] += x[t] * a[c * k + t];
    out[c] = sum[c];
  }
}

void dot_rows(const float *x, const float *a, int64_t e, int64_t k, float *out) {
  int64_t j = 0;
  for (; j + 8 <= e; j += 8) dot_rows_of<8>(x, a + j * k, k, out + j);
  for (; j < e; ++j) dot_rows_of<1>(x, a + j * k, k, out + j);
}

// y[:, n:n + e] (row stride ldy) = xf [m, k] @ A^T, a token at a time (dot_rows): with the tokens'
// slots, each token's own slot's rows of A and zeros for the others; else every row.
int shrink(int64_t m, int64_t k, const float *xf, Shrink sh, float *y, int64_t ldy) {
  const int64_t per = sh.mask ? sh.e / sh.slots : sh.e;
  kernels::parallel_ranges(m, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float *out = y + t * ldy;
      if (!sh.mask) {
        dot_rows(xf + t * k, sh.a, sh.e, k, out);
        continue;
      }
      std::fill(out, out + sh.e, 0.f);
      if (const int64_t s = sh.slot(t); s >= 0) dot_rows(xf + t * k, sh.a + s * per * k, per, k, out + s * per);
    }
  });
  return 0;
}

// A step no token of which uses a slot: its shrink columns are zeros.
int zero_columns(int64_t m, int64_t e, float *y, int64_t ldy) {
  for (int64_t t = 0; t < m && e; ++t) std::fill(y + t * ldy, y + t * ldy + e, 0.f);
  return 0;
}

// The per-channel recipe: tokens quantised whole, oneDNN's int8 matmul, then each row times its scale
// (with a shrink, from a buffer into rows of n + e).
template <typename Row>
int channel_gemm(int64_t m, int64_t k, const int8_t *qw, const float *sw, const float *g, int64_t n, float *y,
                 Shrink sh, Row row) {
  kernels::line_vector<int8_t> qx(m * k);
  const bool lora = sh.any(m);
  std::vector<float> sx(m);
  // this caller's (a call's workers read them): a buffer of a step's rows a call, new pages each time
  // (past malloc's mmap threshold), cost a 64-row step ~5% in page faults
  thread_local std::vector<float> xf, own;
  xf.resize(lora ? m * k : 0), own.resize(sh.e ? m * n : 0);
  float *rows = xf.data();  // the workers' lambdas would name their own thread_local
  kernels::parallel_ranges(m, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf(k);
    for (int64_t i = b; i < e; ++i) {
      const float *r = row(i, buf.data());
      quantize_token(r, g, k, &qx[i * k], &sx[i]);
      if (lora) std::memcpy(rows + i * k, r, k * sizeof(float));
    }
  });
  float *yi = sh.e ? own.data() : y;
  if (kernels::int8_channel_matmul(qx.data(), m, k, qw, sw, n, yi)) return 1;
  const int64_t ld = n + sh.e;
  kernels::parallel_ranges(m, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t j = 0; j < n; ++j) y[i * ld + j] = yi[i * n + j] * sx[i];
  });
  return lora ? shrink(m, k, rows, sh, y + n, ld) : zero_columns(m, sh.e, y + n, ld);
}

// y [m, n (+ e)] = quantised rows @ qw^T (then the shrink), where row(i, buf) returns token i's k inputs
// (x itself, or computed into buf: the element-wise op before the projection, fused into its quantisation pass).
template <typename Row>
int gemm(int64_t m, int64_t k, const int8_t *qw, const float *sw, const float *g, Shape s, int64_t n, float *y,
         Shrink sh, Row row) {
  if (s.channel) return channel_gemm(m, k, qw, sw, g, n, y, sh, row);
  // Per call, not per thread: MindSpore may run two projections at once (each then owns its buffers).
  kernels::line_vector<int8_t> qx(m * s.kp);  // rows of Kp bytes (a multiple of 32), each 32-byte load in one line
  const bool lora = sh.any(m);
  std::vector<float> sx(m * s.ng);
  thread_local std::vector<float> xf;  // as channel_gemm's
  xf.resize(lora ? m * k : 0);
  float *rows = xf.data();
  // Unsigned activations (OFFSET) from 4 tokens up: below, the compensation pass costs more than
  // the sign operations it saves (a decode step streams the weights once, at memory speed).
  const bool offset = OFFSET && m >= 4;
  kernels::parallel_ranges(m, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf(k);
    for (int64_t i = b; i < e; ++i) {
      const float *r = row(i, buf.data());
      quantize_row(r, g, k, s, offset, &qx[i * s.kp], &sx[i * s.ng]);
      if (lora) std::memcpy(rows + i * k, r, k * sizeof(float));
    }
  });
  const int64_t ld = n + sh.e;
  // One cache block a chunk: the last chunk is short, so the caller rarely waits on a worker.
  kernels::parallel_chunks(n, NBLK, [&](int64_t b, int64_t e) {
    std::vector<int32_t> comp(offset ? NBLK * s.ng : 0);
    for (int64_t n0 = b; n0 < e; n0 += NBLK) {
      const int64_t n1 = std::min(e, n0 + NBLK);
      const Channels c{qw, sw, comp.data(), n0, true};
      if (offset) {
#if OFFSET
        compensate(qw + n0 * s.kp, s, n1 - n0, comp.data());  // the block stays in cache for the tiles
        channel_block<true>(m, qx.data(), sx.data(), c, s, n0, n1, y, n, ld);
#endif
      } else {
        channel_block<false>(m, qx.data(), sx.data(), c, s, n0, n1, y, n, ld);
      }
    }
  });
  return lora ? shrink(m, k, rows, sh, y + n, ld) : zero_columns(m, sh.e, y + n, ld);
}

}  // namespace

// Inputs: x [M, K], qw, sw, g, and with LoRA A [E, K] (and the tokens' slots [M, S]: Shrink). Output: y [M, N (+ E)].
extern "C" int LinearInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  const int64_t m = shapes[0][0], k = shapes[0][1];
  Shape s;
  Shrink sh;
  int64_t n;
  if (std::strcmp(dtypes[0], "float32") || !weights_at(nparam, 1, shapes, dtypes, m, k, 5, &s, &n, &sh, params)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  return gemm(m, k, static_cast<const int8_t *>(params[1]), static_cast<const float *>(params[2]),
              static_cast<const float *>(params[3]), s, n, static_cast<float *>(params[nparam - 1]), sh,
              [&](int64_t i, float *) { return x + i * k; });
}

// The residual add and RMSNorm (fused.cpp's AddRmsNorm) feeding the next projection: one op
// instead of two per norm. Inputs: x [M, K], delta [M, K], eps [1], qw, sw, g (, A (, slots)).
// Outputs: sum = x + delta [M, K], y = rms(sum) @ w^T [M, N (+ E)].
extern "C" int AddRmsLinearInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                void *stream, void *extra) {
  const int64_t m = shapes[0][0], k = shapes[0][1];
  Shape s;
  Shrink sh;
  int64_t n;
  if (std::strcmp(dtypes[0], "float32") || std::strcmp(dtypes[1], "float32") ||
      !weights_at(nparam, 3, shapes, dtypes, m, k, 8, &s, &n, &sh, params))
    return 1;
  const float *x = static_cast<const float *>(params[0]), *delta = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *sum = static_cast<float *>(params[nparam - 2]);
  return gemm(m, k, static_cast<const int8_t *>(params[3]), static_cast<const float *>(params[4]),
              static_cast<const float *>(params[5]), s, n, static_cast<float *>(params[nparam - 1]), sh,
              [&](int64_t i, float *buf) {
                kernels::add_rms_row(x + i * k, delta + i * k, eps, k, sum + i * k, buf);
                return static_cast<const float *>(buf);
              });
}

// SwiGLU or GeGLU (fused.cpp's SwiGlu) feeding the down projection. Inputs: gu [M, 2K] (gate | up),
// the norm constants [eps, activation], qw, sw, g (, A (, slots)). Output: y = (act(gate) * up) @ w^T [M, N (+ E)].
extern "C" int SwiGluLinearInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                void *stream, void *extra) {
  const int64_t m = shapes[0][0], k = shapes[0][1] / 2;
  Shape s;
  Shrink sh;
  int64_t n;
  if (std::strcmp(dtypes[0], "float32") || shapes[1][0] < 2 ||
      !weights_at(nparam, 2, shapes, dtypes, m, k, 6, &s, &n, &sh, params))
    return 1;
  const float *gu = static_cast<const float *>(params[0]);
  const float act = static_cast<const float *>(params[1])[1];
  return gemm(m, k, static_cast<const int8_t *>(params[2]), static_cast<const float *>(params[3]),
              static_cast<const float *>(params[4]), s, n, static_cast<float *>(params[nparam - 1]), sh,
              [&](int64_t i, float *buf) {
                kernels::gated_row(gu + i * 2 * k, k, buf, act);
                return static_cast<const float *>(buf);
              });
}

// Which int8 path this build runs (the agent logs it and reports it; benchmarks print it).
extern "C" const char *Int8KernelPath() {
#if WIDE
  return wide_tiles() ? "int8: AVX512-VNNI vpdpbusd, unsigned activations + exact compensation from 4 tokens, "
                        "in 512-bit tiles (timed 5% faster than 256-bit on this CPU)"
                      : "int8: AVX512-VNNI vpdpbusd (256-bit), unsigned activations + exact compensation from 4 "
                        "tokens (512-bit tiles timed slower on this CPU)";
#elif OFFSET && defined(__AVX512VNNI__)
  return "int8: AVX512-VNNI vpdpbusd (256-bit), unsigned activations + exact compensation from 4 tokens";
#elif OFFSET
  return "int8: AVX-VNNI vpdpbusd (256-bit), unsigned activations + exact compensation from 4 tokens";
#elif defined(__AVX2__)
  return "int8: AVX2 vpmaddubsw + vpmaddwd (no VNNI: from ~16 tokens a step computes at about fp32 speed)";
#else
  return "int8: scalar (no AVX2)";
#endif
}
