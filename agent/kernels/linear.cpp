// y = x @ w for the decoder's projections with oneDNN's sgemm (the libdnnl that MindSpore CPU ships
// and links), its output columns split over the pinned cores. MindSpore CPU's own MatMul reached
// 40-100 GFLOP/s at the model's shapes and needed the weights in both layouts to get there.
//
// Inputs: x [M, K], w [K, N] (row-major, "in x out"). Output: y [M, N].
#include <atomic>
#include <cstdint>
#include <cstring>

#include "dnnl.h"
#include "linear.h"
#include "parallel.h"

int kernels::linear_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y) {
  std::atomic<int> status{0};
  // 16 columns: whole 64-byte lines of w and y per thread.
  kernels::parallel_ranges(n, 16, [&](int64_t b, int64_t e) {
    if (dnnl_sgemm('N', 'N', m, e - b, k, 1.f, x, k, w + b, n, 0.f, y + b, n)) status.store(1);
  });
  return status;
}

extern "C" int Linear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  if (nparam != 3 || std::strcmp(dtypes[0], "float32") || std::strcmp(dtypes[1], "float32")) return 1;
  return kernels::linear_f32(static_cast<const float *>(params[0]), shapes[0][0], shapes[0][1],
                             static_cast<const float *>(params[1]), shapes[1][1], static_cast<float *>(params[2]));
}
