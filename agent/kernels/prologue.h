// A decoder layer's prologue (agent/model/fusion.layer_prologues), one float32 array: the Q|K|V bias
// [width] (zeros where the family has none), the q and k heads' RMSNorm gains [hd] each, the
// scalars below, then (sandwich-norm families, Gemma 3) the gains of the RMSNorms on the attention's
// and the MLP's outputs [hidden] each.
#pragma once

#include <cstdint>

namespace kernels::prologue {

// Scalars after the gains: the q/k norm's eps (0: no q/k norm), the sliding window (0: none), this
// layer's rope table as a row offset and a row count into the stacked cos/sin tables.
constexpr int64_t QK_EPS = 0, WINDOW = 1, ROPE_OFFSET = 2, ROPE_ROWS = 3, SCALARS = 4;

// Index of the first scalar for a Q|K|V width and head dim.
inline int64_t scalars(int64_t width, int64_t hd) { return width + 2 * hd; }

// Length without and with the output norms' gains.
inline int64_t length(int64_t width, int64_t hd) { return scalars(width, hd) + SCALARS; }
inline int64_t sandwich_length(int64_t width, int64_t hd, int64_t hidden) { return length(width, hd) + 2 * hidden; }

}  // namespace kernels::prologue
