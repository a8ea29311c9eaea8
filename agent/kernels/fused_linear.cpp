// The residual add + RMSNorm, or SwiGLU, that feeds a float projection, and the projection, as one
// MindSpore op: a dispatch less per norm and per MLP (3 of a layer's ops; each costs ~20 us whatever
// its size, and a one-row decode step of SmolLM2 is ~300 of them). The element-wise step runs over
// the rows first (rows.h, as its own op would), then the projection's core (linear.h): weights in
// column blocks [N/64, K, 64], fp32, bf16 bits (uint16) or f16.
#include <cstdint>
#include <cstring>
#include <vector>

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

// Inputs: gu [M, 2K] (gate | up), w. Output: y = (silu(gate) * up) @ w [M, N].
extern "C" int SwiGluLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 3 || std::strcmp(dtypes[0], "float32")) return 1;
  const int64_t m = shapes[0][0], k = shapes[0][1] / 2;
  const float *gu = static_cast<const float *>(params[0]);
  thread_local std::vector<float> h;
  h.resize(m * k);
  float *hp = h.data();
  kernels::parallel_ranges(m, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) kernels::swiglu_row(gu + r * 2 * k, k, hp + r * k);
  });
  return project(hp, m, k, params[1], dtypes[1], ndims[1], shapes[1], static_cast<float *>(params[2]));
}
