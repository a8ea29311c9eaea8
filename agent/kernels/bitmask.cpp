// Constrained decoding (agent/grammar.py): each constrained row's logits set to -inf wherever its
// grammar's bitmask (llguidance's layout: bit t % 32 of word t / 32 allows token t) has a 0. A
// word of all ones (most words inside a JSON string) costs one compare; NumPy's putmask took ~30 us
// a 49k-token row, this ~2-3.
#include <cstdint>
#include <limits>

extern "C" void MaskLogits(float *logits, int64_t row_stride, const int32_t *masks, int64_t mask_words,
                           const int64_t *rows, const int64_t *mask_rows, int64_t n, int64_t vocab) {
  const float neg = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    float *row = logits + rows[i] * row_stride;
    const uint32_t *m = reinterpret_cast<const uint32_t *>(masks + mask_rows[i] * mask_words);
    for (int64_t w = 0; w * 32 < vocab; ++w) {
      uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t end = vocab - w * 32 < 32 ? vocab - w * 32 : 32;
      for (int64_t b = 0; b < end; ++b)
        if (!((bits >> b) & 1u)) row[w * 32 + b] = neg;
    }
  }
}
