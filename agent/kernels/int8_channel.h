// W8A8 per output channel on oneDNN's int8 matmul (int8_channel.cpp), for linear_int8.cpp's projections.
#pragma once
#include <cstdint>

namespace kernels {

// Bytes of [k, n] int8 weights in the layout oneDNN packs them in on this CPU; 0 where it has no int8 matmul.
int64_t int8_channel_bytes(int64_t k, int64_t n);

// y [m, n] = (x [m, k] s8 @ packed w) * ws [n] (one scale per output channel); 0 on success.
int int8_channel_matmul(const int8_t *x, int64_t m, int64_t k, const void *w, const float *ws, int64_t n, float *y);

// Steps of at most STREAM_M tokens stream the packed weights in our own loop where the layout is
// the one it reads (int8_stream.cpp): stream_layout checks a probe matrix q [n, k] against its packing.
constexpr int64_t STREAM_M = 4;
bool stream_layout(const int8_t *q, int64_t k, int64_t n, const int8_t *packed, int64_t bytes);
void stream_channel(const int8_t *x, int64_t m, int64_t k, const void *w, const float *ws, int64_t n, float *y);

}  // namespace kernels
