// Steps of up to STREAM_M tokens of the per-channel int8 projections (int8_channel.cpp) as one stream
// over oneDNN's packed weights. 30 layers of SmolLM2's q|k|v, o and gate|up from DRAM, Zen 4, both
// cores, against the hand-written grouped kernel: oneDNN's brgemm 4.15 / 3.0 ms at one token (it
// reads at ~19 GB/s); this loop 2.6-2.7 / 2.8 ms at one token, 3.0 / 4.2 ms at four; from five tokens
// oneDNN is as fast or faster (5-6 tokens 3.3-3.5 ms here against 3.4-3.8, 8 tokens 4.1 against 5.2).
//
// The layout is oneDNN's BA16a64b4a, as its AVX512-VNNI kernels pack int8 weights: 64-column
// blocks, each a run of 64-input blocks of [16][64 columns][4 inputs] (vpdpbusd's operand: 16
// columns x 4 inputs in one 512-bit load); whatever oneDNN appends (its s8 x s8 compensation) is not
// read. Activations go in unsigned (x + 128) and the loop sums each column's weights alongside
// (vpdpbusd by ones) to take 128 x that sum back off, so layouts without compensation (AMX's s8 x s8
// needs none) stream the same way. The layout is checked against a packed probe matrix before it is
// used (stream_layout); where oneDNN packs otherwise every step runs on oneDNN. Integer sums are
// exact and the float step is oneDNN's (int32 sum times the channel's scale): the same bits.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>

#include "buffers.h"
#include "int8_channel.h"
#include "parallel.h"

namespace {

constexpr int64_t NB = 64, KB = 64;  // columns and inputs per block
constexpr int64_t AHEAD = 32;        // steps (256 bytes each) prefetched ahead

inline int64_t blocks(int64_t v, int64_t b) { return (v + b - 1) / b; }

// Byte offset of w[i, j] (input i, column j) in the packed layout.
inline int64_t offset(int64_t i, int64_t j, int64_t kb) {
  return ((j / NB) * kb + i / KB) * KB * NB + ((i % KB) / 4) * NB * 4 + (j % NB) * 4 + i % 4;
}

}  // namespace

bool kernels::stream_layout(const int8_t *q, int64_t k, int64_t n, const int8_t *packed, int64_t bytes) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t kb = blocks(k, KB), nb = blocks(n, NB);
  if (bytes < nb * kb * KB * NB) return false;
  for (int64_t j = 0; j < nb * NB; ++j)
    for (int64_t i = 0; i < kb * KB; ++i)  // padding must be zeros: the loop sums whole blocks
      if (packed[offset(i, j, kb)] != (i < k && j < n ? q[j * k + i] : 0)) return false;
  return true;
#else
  (void)q, (void)k, (void)n, (void)packed, (void)bytes;
  return false;  // the stream needs AVX512-VNNI
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace {

// Column block `blk` for M tokens of unsigned activations ux (rows of kp bytes): four 16-column
// accumulators a token, registers only.
template <int M>
void stream_block(const uint8_t *ux, int64_t kp, int64_t kb, int64_t n, const int8_t *base, const float *ws, float *y,
                  int64_t blk) {
  const int8_t *p = base + blk * kb * KB * NB;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[M][4], colsum[4];
  for (int j = 0; j < 4; ++j) colsum[j] = _mm512_setzero_si512();
  for (int t = 0; t < M; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_si512();
  for (int64_t step = 0; step < kp / 4; ++step, p += 4 * NB) {
    for (int line = 0; line < 4; ++line) __builtin_prefetch(p + AHEAD * 4 * NB + 64 * line, 0, 3);
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) {
      wv[j] = _mm512_loadu_si512(p + 64 * j);
      colsum[j] = _mm512_dpbusd_epi32(colsum[j], ones, wv[j]);
    }
    for (int t = 0; t < M; ++t) {
      int32_t four;
      std::memcpy(&four, ux + t * kp + 4 * step, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], xb, wv[j]);
    }
  }
  const int64_t cols = std::min(NB, n - blk * NB);
  for (int t = 0; t < M; ++t) {
    alignas(64) int32_t sums[NB];
    for (int j = 0; j < 4; ++j)
      _mm512_store_si512(sums + 16 * j, _mm512_sub_epi32(acc[t][j], _mm512_slli_epi32(colsum[j], 7)));
    for (int64_t j = 0; j < cols; ++j) y[t * n + blk * NB + j] = static_cast<float>(sums[j]) * ws[blk * NB + j];
  }
}

}  // namespace
#endif

void kernels::stream_channel(const int8_t *x, int64_t m, int64_t k, const void *w, const float *ws, int64_t n,
                             float *y) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t kb = blocks(k, KB), nb = blocks(n, NB), kp = kb * KB;
  kernels::line_vector<uint8_t> ux(m * kp, 128);  // x + 128; the padding's weights are zero
  for (int64_t t = 0; t < m; ++t)
    for (int64_t i = 0; i < k; ++i) ux[t * kp + i] = static_cast<uint8_t>(x[t * k + i] ^ 0x80);
  const int8_t *base = static_cast<const int8_t *>(w);
  // A block's tokens four at a time: its weights come from memory once, then from cache.
  kernels::parallel_chunks(nb, 1, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk)
      for (int64_t t = 0; t < m; t += 4) {
        const uint8_t *u = ux.data() + t * kp;
        float *out = y + t * n;
        switch (std::min<int64_t>(4, m - t)) {
          case 1: stream_block<1>(u, kp, kb, n, base, ws, out, blk); break;
          case 2: stream_block<2>(u, kp, kb, n, base, ws, out, blk); break;
          case 3: stream_block<3>(u, kp, kb, n, base, ws, out, blk); break;
          default: stream_block<4>(u, kp, kb, n, base, ws, out, blk);
        }
      }
  });
#else
  (void)x, (void)m, (void)k, (void)w, (void)ws, (void)n, (void)y;
#endif
}
