// GGUF's quantised block formats (llama.cpp's ggml-quants), read as stored. Two views of a block:
// - dequantize: the float values, in llama.cpp's own expressions and order (dequantize_row_*), so a
//   row comes out with the bits llama.cpp's and the gguf package's NumPy dequantisers give;
// - unpack: integers u (|u| <= 127) and, per 16 values, a and b with value = a * u + b exactly in
//   real arithmetic: the dot product kernel (linear_gguf.cpp) sums u against int8 activations in
//   integers and applies a and b once per 16.
// Types by GGML's numbers. Q4_0/Q4_1/Q5_0/Q5_1/Q8_0: 32 values a block; Q4_K/Q5_K/Q6_K: 256.
#pragma once
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>

namespace kernels::gguf {

enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// Values a block holds and its bytes; 0 for a type not read here.
inline int64_t block_values(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K ? 256 : 32; }
inline int64_t block_bytes(int64_t t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

// IEEE half -> float, exact (subnormals included); F16C's conversion where the CPU has it (the same bits).
__attribute__((always_inline)) inline float half(const uint8_t *p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | man << 13;
  } else if (exp) {
    bits = sign | (exp + 112) << 23 | man << 13;
  } else if (man) {  // subnormal: normalise
    int e = 113;
    uint32_t m = man;
    while (!(m & 0x400)) m <<= 1, --e;
    bits = sign | uint32_t(e) << 23 | (m & 0x3ff) << 13;
  } else {
    bits = sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Q4_K / Q5_K's 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4).
__attribute__((always_inline)) inline void scale_min(int j, const uint8_t *q, int *sc, int *mn) {
  if (j < 4) {
    *sc = q[j] & 63, *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The low four (and fifth) bits of a 32-value legacy block: u[j] from byte j's low nibble, u[j + 16]
// from its high one; qh bit j the fifth bit of u[j] (Q5_0 / Q5_1).
inline void legacy_nibbles(const uint8_t *qs, const uint8_t *qh, int8_t *u) {
  uint32_t h = 0;
  if (qh) std::memcpy(&h, qh, 4);
  for (int j = 0; j < 16; ++j) {
    u[j] = int8_t((qs[j] & 0xF) | (qh ? ((h >> j) & 1) << 4 : 0));
    u[j + 16] = int8_t((qs[j] >> 4) | (qh ? ((h >> (j + 16)) & 1) << 4 : 0));
  }
}

// Q4_K / Q5_K's 256 values as u in [0, 31]: four runs of 64, each two sub-blocks (low nibbles, high).
inline void k_nibbles(const uint8_t *qs, const uint8_t *qh, int8_t *u) {
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      const uint8_t b = qs[32 * j + l];
      u[64 * j + l] = int8_t((b & 0xF) | (qh ? ((qh[l] >> (2 * j)) & 1) << 4 : 0));
      u[64 * j + 32 + l] = int8_t((b >> 4) | (qh ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0));
    }
}

// Q6_K's 256 values as u in [0, 63] (value = d * scale * (u - 32)); 16 sub-blocks of 16, sub-block g's scale at g.
inline void q6_values(const uint8_t *ql, const uint8_t *qh, int8_t *u) {
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, u += 128)
    for (int l = 0; l < 32; ++l) {
      u[l] = int8_t((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4);
      u[l + 32] = int8_t((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4);
      u[l + 64] = int8_t((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
      u[l + 96] = int8_t((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
    }
}

// One block's a and b [block_values / 16].
__attribute__((always_inline)) inline void factors(int64_t t, const uint8_t *p, float *a, float *b) {
  switch (t) {
    case Q4_0: case Q5_0:
      a[0] = a[1] = half(p), b[0] = b[1] = (t == Q5_0 ? -16.f : -8.f) * a[0];
      return;
    case Q4_1: case Q5_1:
      a[0] = a[1] = half(p), b[0] = b[1] = half(p + 2);
      return;
    case Q8_0:
      a[0] = a[1] = half(p), b[0] = b[1] = 0.f;
      return;
    case Q4_K: case Q5_K: {
      const float d = half(p), dmin = half(p + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min(j, p + 4, &sc, &mn);
        a[2 * j] = a[2 * j + 1] = d * float(sc), b[2 * j] = b[2 * j + 1] = -(dmin * float(mn));
      }
      return;
    }
    case Q6_K: {
      const float d = half(p + 208);
      for (int g = 0; g < 16; ++g) a[g] = d * float(int8_t(p[192 + g])), b[g] = -32.f * a[g];
      return;
    }
    default:
      return;
  }
}

// One block: u [block_values], a and b [block_values / 16].
inline void unpack(int64_t t, const uint8_t *p, int8_t *u, float *a, float *b) {
  factors(t, p, a, b);
  switch (t) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      const int64_t qs = t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8;
      legacy_nibbles(p + qs, t == Q5_0 || t == Q5_1 ? p + qs - 4 : nullptr, u);
      return;
    }
    case Q8_0:
      std::memcpy(u, p + 2, 32);
      return;
    case Q4_K: case Q5_K:
      k_nibbles(p + (t == Q5_K ? 48 : 16), t == Q5_K ? p + 16 : nullptr, u);
      return;
    case Q6_K:
      q6_values(p, p + 128, u);
      return;
    default:
      return;
  }
}

// One block's float values, as llama.cpp's dequantize_row_* computes them.
inline void dequantize(int64_t t, const uint8_t *p, float *y) {
  int8_t u[256];
  switch (t) {
    case Q4_0: case Q5_0: {
      const float d = half(p);
      legacy_nibbles(p + (t == Q5_0 ? 6 : 2), t == Q5_0 ? p + 2 : nullptr, u);
      const int off = t == Q5_0 ? 16 : 8;
      for (int j = 0; j < 32; ++j) y[j] = float(u[j] - off) * d;
      return;
    }
    case Q4_1: case Q5_1: {
      const float d = half(p), m = half(p + 2);
      legacy_nibbles(p + (t == Q5_1 ? 8 : 4), t == Q5_1 ? p + 4 : nullptr, u);
      for (int j = 0; j < 32; ++j) y[j] = float(u[j]) * d + m;
      return;
    }
    case Q8_0: {
      const float d = half(p);
      for (int j = 0; j < 32; ++j) y[j] = float(int8_t(p[2 + j])) * d;
      return;
    }
    case Q4_K: case Q5_K: {
      const float d = half(p), dmin = half(p + 2);
      k_nibbles(p + (t == Q5_K ? 48 : 16), t == Q5_K ? p + 16 : nullptr, u);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min(j, p + 4, &sc, &mn);
        const float d1 = d * float(sc), m1 = dmin * float(mn);
        for (int l = 0; l < 32; ++l) y[32 * j + l] = d1 * float(u[32 * j + l]) - m1;
      }
      return;
    }
    case Q6_K: {
      const float d = half(p + 208);
      q6_values(p, p + 128, u);
      for (int j = 0; j < 256; ++j) y[j] = d * float(int8_t(p[192 + j / 16])) * float(u[j] - 32);
      return;
    }
    default:
      return;
  }
}

}  // namespace kernels::gguf
