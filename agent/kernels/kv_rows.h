// The KV cache's row of one head for one token: hd values in the cache's dtype; an int8 row then
// carries its float32 scale (max |x| / 127) in 4 more bytes, so the cache is [S, kv, hd + 4] int8
// and no op takes a second tensor for the scales.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kernels {

constexpr int64_t INT8_SCALE_BYTES = 4;

// Elements after a head's hd values in a row of a cache of element type T.
template <typename T>
constexpr int64_t SCALE_BYTES = std::is_same_v<T, int8_t> ? INT8_SCALE_BYTES : 0;

// hd of a cache whose last dimension is `row`, of dtype name `dtype`.
inline int64_t cache_head_dim(int64_t row, const char *dtype) {
  return row - (std::strcmp(dtype, "int8") ? 0 : INT8_SCALE_BYTES);
}

}  // namespace kernels
