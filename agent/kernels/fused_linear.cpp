// The residual add + RMSNorm, or SwiGLU, or the attention that feeds a projection, and the
// projection, as one MindSpore op: a dispatch less each (each costs ~20 us whatever its size, and a
// one-row decode step of SmolLM2 was ~300 of them). The step feeding it runs over the rows first
// (rows.h, fused.cpp's RopeAttention, as its own op would), then the projection's core (linear.h):
// weights in column blocks [N/64, K, 64], fp32, bf16 bits (uint16) or f16; or int8 (linear_int8.cpp).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_rows.h"
#include "linear.h"
#include "parallel.h"
#include "rows.h"

namespace {

// y = h @ w for whichever weight format w is (see above); nonzero when none fits.
int project(const float *h, int64_t m, int64_t k, void *w, const char *dtype, int ndim, const int64_t *shape,
            float *y) {
  kernels::Weights kind;
  if (!kernels::weight_kind(dtype, ndim, shape, k, &kind)) return 1;
  return kernels::linear_blocks(h, m, k, shape[0], w, kind, y);
}

}  // namespace

// Inputs: x [M, K], delta [M, K], eps [1], w. Outputs: sum = x + delta [M, K], y = rms(sum) @ w [M, N].
extern "C" int AddRmsLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 6 || std::strcmp(dtypes[0], "float32") || std::strcmp(dtypes[1], "float32")) return 1;
  const int64_t m = shapes[0][0], k = shapes[0][1];
  const float *x = static_cast<const float *>(params[0]), *delta = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *sum = static_cast<float *>(params[4]);
  thread_local std::vector<float> h;
  h.resize(m * k);
  float *hp = h.data();
  kernels::parallel_ranges(m, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) kernels::add_rms_row(x + r * k, delta + r * k, eps, k, sum + r * k, hp + r * k);
  });
  return project(hp, m, k, params[3], dtypes[3], ndims[3], shapes[3], static_cast<float *>(params[5]));
}

// Inputs: gu [M, 2K] (gate | up), the norm constants [eps, activation (0 SiLU, 1 GELU-tanh)], w.
// Output: y = (act(gate) * up) @ w [M, N].
extern "C" int SwiGluLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 4 || std::strcmp(dtypes[0], "float32") || shapes[1][0] < 2) return 1;
  const int64_t m = shapes[0][0], k = shapes[0][1] / 2;
  const float *gu = static_cast<const float *>(params[0]);
  const float act = static_cast<const float *>(params[1])[1];
  thread_local std::vector<float> h;
  h.resize(m * k);
  float *hp = h.data();
  kernels::parallel_ranges(m, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) kernels::gated_row(gu + r * 2 * k, k, hp + r * k, act);
  });
  return project(hp, m, k, params[2], dtypes[2], ndims[2], shapes[2], static_cast<float *>(params[3]));
}

extern "C" int RopeAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra);
extern "C" int LinearBlocks(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra);
extern "C" int LinearInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra);

namespace {

using Op = int(int, void **, int *, int64_t **, const char **, void *, void *);
constexpr int ATTN_INPUTS = 10;  // RopeAttention's: qkv, cos, sin, positions, slots, caches, context, prologue

// RopeAttention's 10 inputs, then `project`'s weight inputs, then the output [n, N]: the attention
// [n, h * hd] (h * hd = the Q|K|V width less K and V's) goes into a buffer and `project` reads it.
int attention_then(Op *project, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                   void *stream, void *extra) {
  constexpr int MAX_PARAMS = 16;
  if (nparam <= ATTN_INPUTS + 1 || nparam > MAX_PARAMS || ndims[0] != 2 || ndims[5] != 3) return 1;
  const int64_t n = shapes[0][0], q_width = shapes[0][1] - 2 * shapes[5][1] * kernels::cache_head_dim(shapes[5][2], dtypes[5]);
  thread_local std::vector<float> attn;
  attn.resize(static_cast<size_t>(n * q_width));
  int64_t attn_shape[2] = {n, q_width};
  void *p[MAX_PARAMS];
  int d[MAX_PARAMS];
  int64_t *s[MAX_PARAMS];
  const char *t[MAX_PARAMS];
  std::copy(params, params + ATTN_INPUTS, p);
  std::copy(ndims, ndims + ATTN_INPUTS, d);
  std::copy(shapes, shapes + ATTN_INPUTS, s);
  std::copy(dtypes, dtypes + ATTN_INPUTS, t);
  p[ATTN_INPUTS] = attn.data(), d[ATTN_INPUTS] = 2, s[ATTN_INPUTS] = attn_shape, t[ATTN_INPUTS] = "float32";
  if (int rc = RopeAttention(ATTN_INPUTS + 1, p, d, s, t, stream, extra)) return rc;
  // The projection: the attention, then this op's remaining inputs and its output.
  const int rest = nparam - ATTN_INPUTS;
  p[0] = attn.data(), d[0] = 2, s[0] = attn_shape, t[0] = "float32";
  std::copy(params + ATTN_INPUTS, params + nparam, p + 1);
  std::copy(ndims + ATTN_INPUTS, ndims + nparam, d + 1);
  std::copy(shapes + ATTN_INPUTS, shapes + nparam, s + 1);
  std::copy(dtypes + ATTN_INPUTS, dtypes + nparam, t + 1);
  return project(rest + 1, p, d, s, t, stream, extra);
}

}  // namespace

// The decoder layer's attention (fused.cpp's RopeAttention: rope, the KV cache write, paged
// attention) and its output projection as one op: 4 ops a layer (decoder_stack.cpp chains them). Marked as writing memory (the
// caches), as RopeAttention is. Inputs: RopeAttention's 10, then w (float blocks). Output: [n, N].
extern "C" int RopeAttentionLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  return nparam == ATTN_INPUTS + 2 ? attention_then(LinearBlocks, nparam, params, ndims, shapes, dtypes, stream, extra) : 1;
}

// The same with an int8 output projection. Inputs: RopeAttention's 10, then qw, sw, g (and with LoRA, A and
// the tokens' slots: linear_int8.cpp's Shrink). Output: [n, N (+ E)].
extern "C" int RopeAttentionLinearInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                       void *stream, void *extra) {
  return nparam >= ATTN_INPUTS + 4 && nparam <= ATTN_INPUTS + 6 ? attention_then(LinearInt8, nparam, params, ndims, shapes, dtypes, stream, extra) : 1;
}

extern "C" int LinearGguf(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra);

// The same with an output projection on GGUF blocks as stored. Inputs: RopeAttention's 10, then w, seg,
// rs, g (linear_gguf.cpp). Output: [n, N].
extern "C" int RopeAttentionLinearGguf(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                       void *stream, void *extra) {
  return nparam == ATTN_INPUTS + 5 ? attention_then(LinearGguf, nparam, params, ndims, shapes, dtypes, stream, extra) : 1;
}
