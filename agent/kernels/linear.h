// The float projections' core, shared by their plain op (LinearBlocks, linear_blocks.cpp) and the
// fused ones that run the norm or SwiGLU feeding them first (fused_linear.cpp).
#pragma once
#include <cstdint>

namespace kernels {

enum class Weights { F32, BF16, F16 };

// y [m, blocks * 64] = x [m, k] @ w, w in column blocks [blocks, k, 64] of `kind`.
int linear_blocks(const float *x, int64_t m, int64_t k, int64_t blocks, const void *w, Weights kind, float *y);

// The kind of a weight input from its MindSpore dtype and shape ([blocks, k, 64]); false if none.
bool weight_kind(const char *dtype, int ndim, const int64_t *shape, int64_t k, Weights *kind);

}  // namespace kernels
