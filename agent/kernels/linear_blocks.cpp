// y = x @ w for the decoder's float projections, weights in column blocks of NB = 64: w [N/NB, K, NB]
// (agent/model/linear.py writes them), so one block is a contiguous [K, NB] matrix: the hand-written loop
// streams it front to back, and oneDNN reads it as one batch entry of a batched matmul. Weights are
// fp32, or stay bfloat16 / float16 in memory (half the bytes: a decode step reads every weight once,
// so up to twice as fast wherever memory bandwidth bounds it).
//
// Measured on a 2-vCPU Zen 4 (AVX512-BF16), one core, against fp32 sgemm on plain [K, N] rows:
// oneDNN's batched matmul on this layout, fp32 1.0-1.15x at M >= 64 and 1.0-2.2x at M = 8; bf16
// 1.7-2.2x at M = 64-256 and 1.3-2.9x at M = 8 (on plain rows 1.4-1.9x, and 0.4-1.0x at M = 1,
// where its brgemm is poor). Fewer than ONEDNN_MIN_M rows go through the streaming loop below
// (fp32 FMAs on weights widened as they are loaded): a one-row fp32 step ran at 1.7x the
// weight-streaming limit on sgemm.
//
// bf16: every path computes the same thing: x rounded to bf16, exact products, fp32 sums (summation
// order aside), so a row's tokens do not depend on its step's row count. f16: x stays fp32 (f16's
// range would overflow on large activations); oneDNN's f16 matmul needs AVX512-FP16 / AMX-FP16 and
// rounds x to f16, so it is not used. Paths, chosen per call (Bf16KernelPath() / F16KernelPath()):
// - M < ONEDNN_MIN_M: the streaming loop (AVX-512 or AVX2 FMAs).
// - M >= ONEDNN_MIN_M, fp32, or bf16 with AVX512-BF16 / AMX: oneDNN's batched matmul.
// - M >= ONEDNN_MIN_M otherwise (f16; bf16 on AVX2 CPUs; fp32 where oneDNN fails): weight tiles
//   widened to fp32 in a per-thread buffer and multiplied by oneDNN's sgemm.
//
// Inputs: x [M, K] float32, w [N/NB, K, NB] float32, uint16 (bf16 bits) or float16. Output: y [M, N].
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "deterministic.h"
#include "dnnl.h"
#include "linear.h"
#include "parallel.h"

namespace {

constexpr int64_t NB = 64;           // columns per weight block
// Rows from which oneDNN's brgemm beats the streaming loop: 8 with AVX-512 (4 rows share each weight
// load; Zen 4); 20 with AVX2, whose loop takes one row at a time (fp32, SmolLM2's 30 layers from
// DRAM on a Zen 3, loop vs oneDNN: M = 8 53 vs 83 ms, 16 79 vs 91, 20 89 vs 90, 24 122 vs 113).
#if defined(__AVX512F__)
constexpr int64_t ONEDNN_MIN_M = 8;
#else
constexpr int64_t ONEDNN_MIN_M = 20;
#endif

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}

// The weight formats, widened to fp32 as they are loaded.
struct F32W {
  using T = float;
  static float widen(float x) { return x; }
#if defined(__AVX512F__)
  static __m512 widen16(const float *p) { return _mm512_loadu_ps(p); }
#elif defined(__AVX2__)
  static __m256 widen8(const float *p) { return _mm256_loadu_ps(p); }
#endif
};

struct Bf16W {
  using T = uint16_t;
  static float widen(uint16_t b) { return bf16_to_f32(b); }
#if defined(__AVX512F__)
  static __m512 widen16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#elif defined(__AVX2__)
  static __m256 widen8(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#endif
};

struct F16W {
  using T = uint16_t;
  static float widen(uint16_t h) { return f16_to_f32(h); }
#if defined(__AVX512F__)
  static __m512 widen16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))); }
#elif defined(__AVX2__) && defined(__F16C__)
  static __m256 widen8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
#endif
};

inline uint16_t f32_to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// y[r, 0:NB] = x[r, :] @ block for R rows: the block is read once for all R rows; accumulators
// live in registers (AVX-512: 4 x 16 columns x R = 4 rows; AVX2: 8 x 8 columns x R = 1 row).
template <int R, typename W>
void block_rows(const float *x, int64_t k, const typename W::T *blk, float *y, int64_t ldy) {
#if defined(__AVX512F__)
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const typename W::T *row = blk + i * NB;
    __m512 w[4];
    for (int j = 0; j < 4; ++j) w[j] = W::widen16(row + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k + i]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + r * ldy + 16 * j, acc[r][j]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m256 acc[R][8];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 8; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const typename W::T *row = blk + i * NB;
    for (int j = 0; j < 8; ++j) {
      const __m256 w = W::widen8(row + 8 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * k + i]), w, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(y + r * ldy + 8 * j, acc[r][j]);
#else
  float acc[R][NB] = {};
  for (int64_t i = 0; i < k; ++i)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < NB; ++j) acc[r][j] += x[r * k + i] * W::widen(blk[i * NB + j]);
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(float) * NB);
#endif
}

#if defined(__AVX512F__)
constexpr int ROWS = 4;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int ROWS = 6;

// AVX2, R rows: the block as four 16-column slices, 2R accumulators each (R = 6: 12 of 16 registers,
// 2 weight loads and 6 broadcasts per 12 FMAs, where one row at a time loads a weight per FMA). Every
// output still sums its k products in order, one FMA each from zero: the bits of block_rows<1>.
template <int R, typename W>
void slice_rows(const float *x, int64_t k, const typename W::T *blk, float *y, int64_t ldy) {
  for (int64_t j0 = 0; j0 < NB; j0 += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
      const typename W::T *row = blk + i * NB + j0;
      const __m256 w0 = W::widen8(row), w1 = W::widen8(row + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[r * k + i]);
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * ldy + j0, acc[r][0]);
      _mm256_storeu_ps(y + r * ldy + j0 + 8, acc[r][1]);
    }
  }
}
#else
constexpr int ROWS = 1;
#endif

// ROWS rows of a block at once (one row: block_rows' eight accumulators hide the FMA latency).
template <typename W>
inline void tile_rows(const float *x, int64_t k, const typename W::T *blk, float *y, int64_t ldy) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  slice_rows<ROWS, W>(x, k, blk, y, ldy);
#else
  block_rows<ROWS, W>(x, k, blk, y, ldy);
#endif
}

// Blocks [b, e) of the streaming loop, ROWS rows at a time. AVX2's slices only where the loop takes
// every row count (deterministic.h): below ONEDNN_MIN_M rows, a decode step's weights come from DRAM,
// where the one-row loop's sequential read held its own (Zen 3, fp32, 8 rows: 41-50 ms against 50-54).
template <typename W>
void stream_blocks(const float *x, int64_t m, int64_t k, int64_t n, const typename W::T *w, float *y, int64_t b,
                   int64_t e) {
#if defined(__AVX512F__)
  const bool tiles = true;
#else
  const bool tiles = ROWS > 1 && kernels::deterministic();
#endif
  for (int64_t blk = b; blk < e; ++blk) {
    const typename W::T *wb = w + blk * k * NB;
#if !defined(__AVX512F__) && defined(__AVX2__)
    if (tiles && m >= ROWS)  // front to back into L2 once: the slices read it at a 4-line stride, 4 times
      for (int64_t off = 0; off < k * NB * static_cast<int64_t>(sizeof(*wb)); off += 64)
        _mm_prefetch(reinterpret_cast<const char *>(wb) + off, _MM_HINT_T1);
#endif
    int64_t r = 0;
    for (; tiles && r + ROWS <= m; r += ROWS) tile_rows<W>(x + r * k, k, wb, y + r * n + blk * NB, n);
    for (; r < m; ++r) block_rows<1, W>(x + r * k, k, wb, y + r * n + blk * NB, n);
  }
}

// One block row (NB values) widened to fp32, in vectors where the CPU has them.
template <typename W>
inline void widen_row(const typename W::T *src, float *dst) {
#if defined(__AVX512F__)
  for (int64_t c = 0; c < NB; c += 16) _mm512_storeu_ps(dst + c, W::widen16(src + c));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (int64_t c = 0; c < NB; c += 8) _mm256_storeu_ps(dst + c, W::widen8(src + c));
#else
  for (int64_t c = 0; c < NB; ++c) dst[c] = W::widen(src[c]);
#endif
}

// Blocks [b, e) converted to fp32 in tiles of KC x CB*NB (256 KiB: they stay in L2) and multiplied
// by sgemm, accumulating over K (CPUs without bf16 math). One block at a time left sgemm too narrow:
// 0.8x fp32 at M = 64.
constexpr int64_t KC = 256, CB = 4;
template <typename W>
int convert_blocks(const float *x, int64_t m, int64_t k, int64_t n, const typename W::T *w, float *y, int64_t b,
                   int64_t e) {
  thread_local std::vector<float> buf;
  buf.resize(KC * CB * NB);
  for (int64_t c0 = b; c0 < e; c0 += CB) {
    const int64_t cb = std::min(CB, e - c0), cols = cb * NB;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
      const int64_t kc = std::min(KC, k - k0);
      for (int64_t j = 0; j < cb; ++j) {
        const typename W::T *src = w + (c0 + j) * k * NB + k0 * NB;
        for (int64_t i = 0; i < kc; ++i) widen_row<W>(src + i * NB, &buf[i * cols + j * NB]);
      }
      if (dnnl_sgemm('N', 'N', m, cols, kc, 1.f, x + k0, k, buf.data(), cols, k0 ? 1.f : 0.f, y + c0 * NB, n)) return 1;
    }
  }
  return 0;
}

// One batched bf16 matmul per (thread, shape): src [1, M, K] bf16 broadcast over the batch, weights
// [blocks, K, NB], dst [blocks, M, NB] written into y's columns. Primitives are built on first use
// and kept per thread (each thread also owns its stream and scratchpad, dnnl.h: no locks).
struct Dnnl {
  dnnl_primitive_t prim = nullptr;
  dnnl_memory_t src = nullptr, wei = nullptr, dst = nullptr, scratch = nullptr;
  size_t pad_bytes = 1;
  std::string impl;
};

dnnl_memory_desc_t strided(std::initializer_list<int64_t> dims, int dt, std::initializer_list<int64_t> strides) {
  dnnl_dims_t d = {}, s = {};
  std::copy(dims.begin(), dims.end(), d);
  std::copy(strides.begin(), strides.end(), s);
  dnnl_memory_desc_t md = nullptr;
  return dnnl_memory_desc_create_with_strides(&md, static_cast<int>(dims.size()), d, dt, s) == dnnl_success ? md
                                                                                                            : nullptr;
}

// dt: dnnl_f32 or dnnl_bf16, for x and w alike.
std::unique_ptr<Dnnl> build(int dt, int64_t m, int64_t k, int64_t blocks, int64_t n) {
  dnnl_engine_t eng = kernels::cpu_engine();
  if (!eng) return nullptr;
  dnnl_memory_desc_t sm = strided({1, m, k}, dt, {m * k, k, 1});
  dnnl_memory_desc_t wm = strided({blocks, k, NB}, dt, {k * NB, NB, 1});
  dnnl_memory_desc_t dm = strided({blocks, m, NB}, dnnl_f32, {NB, n, 1});
  dnnl_primitive_attr_t attr = nullptr;
  dnnl_primitive_attr_create(&attr);
  dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
  dnnl_primitive_desc_t pd = nullptr;
  std::unique_ptr<Dnnl> d;
  if (sm && wm && dm && dnnl_matmul_primitive_desc_create(&pd, eng, sm, wm, nullptr, dm, attr) == dnnl_success) {
    d = std::make_unique<Dnnl>();
    const char *name = nullptr;
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name);
    d->impl = name ? name : "";
    const_dnnl_memory_desc_t spm = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    d->pad_bytes = std::max<size_t>(1, dnnl_memory_desc_get_size(spm));
    bool ok = dnnl_primitive_create(&d->prim, pd) == dnnl_success && dnnl_memory_create(&d->src, sm, eng, nullptr) == 0 &&
              dnnl_memory_create(&d->wei, wm, eng, nullptr) == 0 && dnnl_memory_create(&d->dst, dm, eng, nullptr) == 0 &&
              dnnl_memory_create(&d->scratch, spm, eng, kernels::thread_scratchpad(d->pad_bytes)) == 0;
    if (!ok) d.reset();
    dnnl_primitive_desc_destroy(pd);
  }
  for (auto md : {sm, wm, dm})
    if (md) dnnl_memory_desc_destroy(md);
  dnnl_primitive_attr_destroy(attr);
  return d;
}

// oneDNN has bf16 math here when its chosen implementation names the instructions (an emulated
// avx512_core or reference kernel would be slower than converting to fp32).
bool native_bf16(const std::string &impl) {
  return impl.find("bf16") != std::string::npos || impl.find("amx") != std::string::npos;
}

const std::string &probe_impl() {
  static const std::string impl = [] {
    auto d = build(dnnl_bf16, ONEDNN_MIN_M, 256, 1, NB);
    return d ? d->impl : std::string();
  }();
  return impl;
}

// Blocks [b, e) by oneDNN; x and w both of `dt` (elements of `size` bytes).
int dnnl_blocks(int dt, const void *x, int64_t m, int64_t k, int64_t n, const void *w, float *y, int64_t b, int64_t e) {
  thread_local std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t>, std::unique_ptr<Dnnl>> cache;
  auto &d = cache[{dt, m, k, e - b, n}];
  if (!d) {
    if (!(d = build(dt, m, k, e - b, n))) return 1;
    ++kernels::primitives_built();
  }
  const int64_t size = dt == dnnl_f32 ? 4 : 2;
  dnnl_stream_t stream = nullptr;
  thread_local dnnl_stream_t own = nullptr;
  if (!own && dnnl_stream_create(&own, kernels::cpu_engine(), dnnl_stream_in_order) != dnnl_success) return 1;
  stream = own;
  dnnl_memory_set_data_handle(d->src, const_cast<void *>(x));
  dnnl_memory_set_data_handle(d->wei, const_cast<char *>(static_cast<const char *>(w) + b * k * NB * size));
  dnnl_memory_set_data_handle(d->dst, y + b * NB);
  dnnl_memory_set_data_handle(d->scratch, kernels::thread_scratchpad(d->pad_bytes));
  const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, d->src}, {DNNL_ARG_WEIGHTS, d->wei}, {DNNL_ARG_DST, d->dst},
                                  {DNNL_ARG_SCRATCHPAD, d->scratch}};
  if (dnnl_primitive_execute(d->prim, stream, 4, args) != dnnl_success) return 1;
  return dnnl_stream_wait(stream) != dnnl_success;
}

const char *const STREAM_ISA =
#if defined(__AVX512F__)
    "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    "AVX2";
#else
    "scalar";
#endif

template <typename W>
int blocks_path(const float *x, int64_t m, int64_t k, int64_t blocks, const typename W::T *w, float *y) {
  std::atomic<int> status{0};
  // Chunks of CB blocks, each thread's front to back, the late one's tail taken by the other. oneDNN's
  // path below keeps one range a thread: its primitives are built per range shape during warm-up.
  const bool stream = m < ONEDNN_MIN_M || kernels::deterministic();
  kernels::parallel_chunks(blocks, CB, [&](int64_t b, int64_t e) {
    if (stream) stream_blocks<W>(x, m, k, blocks * NB, w, y, b, e);
    else if (convert_blocks<W>(x, m, k, blocks * NB, w, y, b, e)) status.store(1);
  });
  return status;
}

int onednn_path(int dt, const void *x, int64_t m, int64_t k, int64_t blocks, const void *w, float *y) {
  std::atomic<int> status{0};
  kernels::parallel_ranges(blocks, 1, [&](int64_t b, int64_t e) {
    if (dnnl_blocks(dt, x, m, k, blocks * NB, w, y, b, e)) status.store(1);
  });
  return status;
}

}  // namespace

int kernels::linear_blocks(const float *x, int64_t m, int64_t k, int64_t blocks, const void *w, Weights kind,
                           float *y) {
  if (kind == Weights::F32) {
    const float *wf = static_cast<const float *>(w);
    if (m >= ONEDNN_MIN_M && !kernels::deterministic() && onednn_path(dnnl_f32, x, m, k, blocks, w, y) == 0) return 0;
    return blocks_path<F32W>(x, m, k, blocks, wf, y);  // few rows, or oneDNN failed: widen = copy
  }
  const uint16_t *wh = static_cast<const uint16_t *>(w);
  if (kind == Weights::F16) return blocks_path<F16W>(x, m, k, blocks, wh, y);
  // bf16: x rounded first, on every path (see above)
  thread_local std::vector<uint16_t> xb;
  thread_local std::vector<float> xr;
  xb.resize(m * k);
  for (int64_t i = 0; i < m * k; ++i) xb[i] = f32_to_bf16(x[i]);
  if (m >= ONEDNN_MIN_M && !kernels::deterministic() && native_bf16(probe_impl()))
    return onednn_path(dnnl_bf16, xb.data(), m, k, blocks, w, y);
  xr.resize(m * k);
  for (int64_t i = 0; i < m * k; ++i) xr[i] = bf16_to_f32(xb[i]);
  return blocks_path<Bf16W>(xr.data(), m, k, blocks, wh, y);
}

bool kernels::weight_kind(const char *dtype, int ndim, const int64_t *shape, int64_t k, Weights *kind) {
  if (ndim != 3 || shape[1] != k || shape[2] != NB) return false;
  if (!std::strcmp(dtype, "float32")) *kind = Weights::F32;
  else if (!std::strcmp(dtype, "uint16")) *kind = Weights::BF16;
  else if (!std::strcmp(dtype, "float16")) *kind = Weights::F16;
  else return false;
  return true;
}

extern "C" const char *Bf16KernelPath() {
  static const std::string path = std::string("bf16: weights in bf16; below ") + std::to_string(ONEDNN_MIN_M) +
                                  " rows: streaming fp32 loop (" + STREAM_ISA + "); more: " +
                                  (native_bf16(probe_impl()) ? "oneDNN bf16 matmul [" + probe_impl() + "]"
                                                             : "blocks converted to fp32 + oneDNN sgemm (oneDNN offers [" +
                                                                   probe_impl() + "], no bf16 math)");
  return path.c_str();
}

extern "C" const char *F16KernelPath() {
  static const std::string path = std::string("f16: weights in f16, fp32 math; below ") + std::to_string(ONEDNN_MIN_M) +
                                  " rows: streaming loop (" + STREAM_ISA + "); more: blocks converted to fp32 + oneDNN sgemm";
  return path.c_str();
}

extern "C" const char *F32KernelPath() {
  static const std::string path = std::string("fp32: weights in 64-column blocks; below ") + std::to_string(ONEDNN_MIN_M) +
                                  " rows: streaming loop (" + STREAM_ISA + "); more: oneDNN batched matmul";
  return path.c_str();
}

// serving_config.deterministic (deterministic.h), for this process; the paths it takes instead.
extern "C" void SetDeterministic(int on) { kernels::deterministic_flag().store(on != 0); }

extern "C" const char *DeterministicPath() {
  static const std::string path = std::string("deterministic: float projections on the streaming loop (") + STREAM_ISA +
                                  ") at every row count; attention one token at a time over its keys in order";
  return path.c_str();
}

// The oneDNN primitives built and kept so far, in every kernel's cache (tests: a bounded set).
extern "C" int64_t OnednnPrimitives() { return kernels::primitives_built().load(); }

// The rows a step of m real tokens computes in the decoder stack (tools/kernel_memory.py).
extern "C" int64_t RowBucket(int64_t m) { return kernels::row_bucket(m); }

extern "C" int LinearBlocks(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                            void *extra) {
  kernels::Weights kind;
  if (nparam != 3 || std::strcmp(dtypes[0], "float32") || !kernels::weight_kind(dtypes[1], ndims[1], shapes[1], shapes[0][1], &kind))
    return 1;
  return kernels::linear_blocks(static_cast<const float *>(params[0]), shapes[0][0], shapes[0][1], shapes[1][0],
                                params[1], kind, static_cast<float *>(params[2]));
}
