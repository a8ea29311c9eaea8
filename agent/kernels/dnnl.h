// oneDNN's row-major sgemm from the libdnnl MindSpore CPU ships and links (C API; sequential when
// called without a threadpool, so the kernels split work over their own pool).
#pragma once
#include <cstdint>

extern "C" int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
