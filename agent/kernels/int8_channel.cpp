// W8A8 per output channel on oneDNN's int8 matmul (`quant_group_size: -1`): int8 weights with one
// scale per output channel, activations quantised per token (linear_int8.cpp's channel_gemm).
// oneDNN picks the instructions at run time for the CPU it runs on: AMX-INT8 tiles on Xeons with
// AMX, AVX512-VNNI or AVX-VNNI vpdpbusd below them (ONEDNN_MAX_CPU_ISA caps the choice, which is how
// the tests run every path a CPU has). Without VNNI oneDNN's int8 gemm sums pairs of u8 x s8
// products in int16 (vpmaddubsw), which saturates on full-range int8 (errors of 4-20% measured
// with AVX2 alone): there the layout is refused and the agent says why at load. The grouped recipe cannot run there:
// oneDNN 3.10's int8 matmul takes weight scales per channel or per tensor and source scales per
// tensor only (grouped scales fall to its reference kernel, ~1000x slower).
//
// The weights are packed once, at load, into the layout oneDNN picks for this CPU (with the s8 x s8
// compensation the VNNI kernels need), and every step shape reads that one copy. Integer sums are
// exact; y[m, n] = ws[n] * acc[m, n] comes out of oneDNN in fp32 and the caller multiplies row m by
// its activation scale. The primitives run on the kernels' own worker pool (parallel.h) through
// oneDNN's threadpool interface.
//
// Per core, Zen 4 (AVX512-VNNI), 576 x 1536 weights in cache: 55 GMAC/s at one token, 190-220 from 8
// tokens; the grouped hand-written kernel 23 and 68-125.
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "buffers.h"
#include "dnnl.h"
#include "int8_channel.h"
#include "parallel.h"

namespace {

// Rows the packed layout is chosen for; every other row count reads the same layout.
constexpr int64_t PACK_M = 64;

thread_local bool in_pool = false;

// The kernels' pool as oneDNN's threadpool: parallel_for(n, fn) runs fn(i, n) for every i.
struct PoolThreads final : dnnl::threadpool_interop::threadpool_iface {
  int get_num_threads() const override { return static_cast<int>(kernels::pinned_cores()); }
  bool get_in_parallel() const override { return in_pool; }
  void parallel_for(int n, const std::function<void(int, int)> &fn) override {
    kernels::Pool::get().run(n, [&](int64_t i) {
      const bool outer = in_pool;
      in_pool = true;
      fn(static_cast<int>(i), n);
      in_pool = outer;
    });
  }
  uint64_t get_flags() const override { return 0; }
};

dnnl_stream_t pool_stream() {
  static PoolThreads threads;
  thread_local dnnl_stream_t stream = nullptr;
  if (!stream && dnnl_threadpool_interop_stream_create(&stream, kernels::cpu_engine(), &threads) != dnnl_success)
    stream = nullptr;
  return stream;
}

dnnl_memory_desc_t plain(int64_t rows, int64_t cols, int dt) {
  dnnl_dims_t d = {rows, cols};
  dnnl_memory_desc_t md = nullptr;
  return dnnl_memory_desc_create_with_tag(&md, 2, d, dt, dnnl_ab) == dnnl_success ? md : nullptr;
}

struct Desc {  // a memory desc destroyed with its owner
  dnnl_memory_desc_t md = nullptr;
  explicit Desc(dnnl_memory_desc_t m) : md(m) {}
  ~Desc() {
    if (md) dnnl_memory_desc_destroy(md);
  }
};

// src s8 [m, k] x weights s8 [k, n] (`wei`: a desc, or format any) -> dst f32 [m, n], weight scales
// per output channel. nullptr where oneDNN has no implementation.
dnnl_primitive_desc_t matmul_pd(int64_t m, int64_t k, int64_t n, const_dnnl_memory_desc_t wei) {
  Desc src(plain(m, k, dnnl_s8)), dst(plain(m, n, dnnl_f32));
  dnnl_dims_t d = {k, n};
  Desc any(nullptr);
  if (!wei && dnnl_memory_desc_create_with_tag(&any.md, 2, d, dnnl_s8, dnnl_format_tag_any) == dnnl_success) wei = any.md;
  dnnl_primitive_attr_t attr = nullptr;
  dnnl_primitive_attr_create(&attr);
  dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
  dnnl_primitive_attr_set_scales_mask(attr, DNNL_ARG_WEIGHTS, 1 << 1);
  dnnl_primitive_desc_t pd = nullptr;
  if (!src.md || !dst.md || !wei ||
      dnnl_matmul_primitive_desc_create(&pd, kernels::cpu_engine(), src.md, wei, nullptr, dst.md, attr) != dnnl_success)
    pd = nullptr;
  dnnl_primitive_attr_destroy(attr);
  return pd;
}

std::string impl_of(dnnl_primitive_desc_t pd) {
  const char *name = nullptr;
  dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name);
  return name ? name : "";
}

// Whether oneDNN's implementation sums int8 products exactly (dot-product instructions: VNNI or AMX).
bool exact_int8(const std::string &impl) {
  return impl.find("vnni") != std::string::npos || impl.find("amx") != std::string::npos;
}

// The packed layout for [k, n] weights on this CPU, chosen once per shape (kept for the process);
// none where oneDNN's int8 matmul is not exact here.
struct Layout {
  dnnl_memory_desc_t md = nullptr;
  size_t bytes = 0;
  std::string impl;
  bool stream = false;  // few-token steps stream it in our own loop (int8_stream.cpp)
};

// q [n, k] int8 (row j: output channel j's inputs) -> `out` (l.bytes) in layout l; 0 on success.
int pack(const Layout &l, int64_t k, int64_t n, const int8_t *q, void *out) {
  dnnl_dims_t d = {k, n}, strides = {1, k};
  Desc rows(nullptr);
  dnnl_memory_desc_create_with_strides(&rows.md, 2, d, dnnl_s8, strides);
  dnnl_engine_t eng = kernels::cpu_engine();
  dnnl_primitive_desc_t pd = nullptr;
  if (!rows.md || dnnl_reorder_primitive_desc_create(&pd, rows.md, eng, l.md, eng, nullptr) != dnnl_success) return 1;
  dnnl_primitive_t reorder = nullptr;
  dnnl_memory_t from = nullptr, to = nullptr;
  dnnl_stream_t stream = nullptr;
  int status = dnnl_primitive_create(&reorder, pd) != dnnl_success ||
               dnnl_memory_create(&from, rows.md, eng, const_cast<int8_t *>(q)) != dnnl_success ||
               dnnl_memory_create(&to, l.md, eng, out) != dnnl_success ||
               dnnl_stream_create(&stream, eng, dnnl_stream_in_order) != dnnl_success;
  if (!status) {
    const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, from}, {DNNL_ARG_DST, to}};
    status = dnnl_primitive_execute(reorder, stream, 2, args) != dnnl_success || dnnl_stream_wait(stream) != dnnl_success;
  }
  for (dnnl_memory_t mem : {from, to})
    if (mem) dnnl_memory_destroy(mem);
  if (reorder) dnnl_primitive_destroy(reorder);
  if (stream) dnnl_stream_destroy(stream);
  dnnl_primitive_desc_destroy(pd);
  return status;
}

// Whether oneDNN packs [k, n] as our stream reads it: a probe matrix of full-range values, packed.
bool streams(const Layout &l, int64_t k, int64_t n) {
  std::vector<int8_t> q(k * n);
  uint32_t state = 12345;
  for (int8_t &v : q) v = static_cast<int8_t>(static_cast<int>((state = state * 1664525u + 1013904223u) >> 24) % 255 - 127);
  kernels::line_vector<int8_t> packed(l.bytes);
  return pack(l, k, n, q.data(), packed.data()) == 0 &&
         kernels::stream_layout(q.data(), k, n, packed.data(), static_cast<int64_t>(l.bytes));
}

const Layout *layout(int64_t k, int64_t n) {
  static std::mutex lock;
  static std::map<std::pair<int64_t, int64_t>, Layout> layouts;
  std::lock_guard<std::mutex> hold(lock);
  auto found = layouts.find({k, n});
  if (found != layouts.end()) return found->second.md ? &found->second : nullptr;
  Layout &l = layouts[{k, n}];
  if (dnnl_primitive_desc_t pd = matmul_pd(PACK_M, k, n, nullptr)) {
    if (exact_int8(impl_of(pd)) && dnnl_memory_desc_clone(&l.md, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0)) == dnnl_success) {
      l.bytes = dnnl_memory_desc_get_size(l.md);
      l.impl = impl_of(pd);
      l.stream = streams(l, k, n);
    }
    dnnl_primitive_desc_destroy(pd);
  }
  return l.md ? &l : nullptr;
}

// One primitive per (thread, step shape), built on first use with its memories; the scratchpad is
// the thread's (dnnl.h).
struct Matmul {
  dnnl_primitive_t prim = nullptr;
  dnnl_memory_t src = nullptr, wei = nullptr, dst = nullptr, scales = nullptr, scratch = nullptr;
  size_t pad_bytes = 1;
  ~Matmul() {
    for (dnnl_memory_t mem : {src, wei, dst, scales, scratch})
      if (mem) dnnl_memory_destroy(mem);
    if (prim) dnnl_primitive_destroy(prim);
  }
};

// Narrow outputs (n < 64) are planned for one thread: where M x N is small, oneDNN 3.10's AMX int8
// matmul splits K over the threads, and under a threadpool its partial sums came back wrong (576 x 48
// weights, 6-31 tokens: errors as large as the results on a Sapphire Rapids Xeon, on our pool and on
// one thread running the parts in turn; planned for one thread, exact). Such a matmul is microseconds.
constexpr int64_t NARROW_N = 64;

std::unique_ptr<Matmul> build(int64_t m, int64_t k, int64_t n) {
  const Layout *l = layout(k, n);
  int threads = 0;
  dnnl_threadpool_interop_get_max_concurrency(&threads);
  if (n < NARROW_N) dnnl_threadpool_interop_set_max_concurrency(1);
  dnnl_primitive_desc_t pd = l ? matmul_pd(m, k, n, l->md) : nullptr;
  dnnl_threadpool_interop_set_max_concurrency(threads);
  if (!pd) return nullptr;
  auto mm = std::make_unique<Matmul>();
  dnnl_engine_t eng = kernels::cpu_engine();
  const_dnnl_memory_desc_t spm = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
  mm->pad_bytes = std::max<size_t>(1, dnnl_memory_desc_get_size(spm));
  dnnl_dims_t nd = {n};
  Desc src(plain(m, k, dnnl_s8)), dst(plain(m, n, dnnl_f32)), sc(nullptr);
  dnnl_memory_desc_create_with_tag(&sc.md, 1, nd, dnnl_f32, dnnl_a);
  const bool ok = dnnl_primitive_create(&mm->prim, pd) == dnnl_success &&
                  dnnl_memory_create(&mm->src, src.md, eng, nullptr) == dnnl_success &&
                  dnnl_memory_create(&mm->wei, l->md, eng, nullptr) == dnnl_success &&
                  dnnl_memory_create(&mm->dst, dst.md, eng, nullptr) == dnnl_success &&
                  dnnl_memory_create(&mm->scales, sc.md, eng, nullptr) == dnnl_success &&
                  dnnl_memory_create(&mm->scratch, spm, eng, kernels::thread_scratchpad(mm->pad_bytes)) == dnnl_success;
  dnnl_primitive_desc_destroy(pd);
  return ok ? std::move(mm) : nullptr;
}

}  // namespace

int64_t kernels::int8_channel_bytes(int64_t k, int64_t n) {
  const Layout *l = layout(k, n);
  return l ? static_cast<int64_t>(l->bytes) : 0;
}

int kernels::int8_channel_matmul(const int8_t *x, int64_t m, int64_t k, const void *w, const float *ws, int64_t n,
                                 float *y) {
  const Layout *l = layout(k, n);
  if (l && l->stream && m <= kernels::STREAM_M) {
    kernels::stream_channel(x, m, k, w, ws, n, y);
    return 0;
  }
  thread_local std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<Matmul>> cache;
  auto &mm = cache[{m, k, n}];
  dnnl_stream_t stream = pool_stream();
  if (!stream) return 1;
  if (!mm) {
    if (!(mm = build(m, k, n))) return 1;
    ++kernels::primitives_built();
  }
  dnnl_memory_set_data_handle(mm->src, const_cast<int8_t *>(x));
  dnnl_memory_set_data_handle(mm->wei, const_cast<void *>(w));
  dnnl_memory_set_data_handle(mm->dst, y);
  dnnl_memory_set_data_handle(mm->scales, const_cast<float *>(ws));
  dnnl_memory_set_data_handle(mm->scratch, kernels::thread_scratchpad(mm->pad_bytes));
  const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, mm->src}, {DNNL_ARG_WEIGHTS, mm->wei}, {DNNL_ARG_DST, mm->dst},
                                  {DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, mm->scales},
                                  {DNNL_ARG_SCRATCHPAD, mm->scratch}};
  if (dnnl_primitive_execute(mm->prim, stream, 5, args) != dnnl_success) return 1;
  return dnnl_stream_wait(stream) != dnnl_success;
}

// Bytes of packed [k, n] weights on this CPU (0: oneDNN has no exact int8 matmul here).
extern "C" int64_t Int8ChannelBytes(int64_t k, int64_t n) { return kernels::int8_channel_bytes(k, n); }

// q [n, k] int8 (row j: output channel j's inputs) -> `out` (Int8ChannelBytes(k, n) bytes) in the packed layout.
extern "C" int Int8ChannelPack(int64_t k, int64_t n, const int8_t *q, void *out) {
  const Layout *l = layout(k, n);
  return l ? pack(*l, k, n, q, out) : 1;
}

// The implementation oneDNN picked on this CPU (the agent logs it with the int8 path).
extern "C" const char *Int8ChannelKernelPath() {
  static const std::string path = [] {
    const Layout *l = layout(1024, 1024);
    if (l)
      return "int8 per channel: oneDNN int8 matmul, per-token s8 activations x s8 weights [" + l->impl + "]" +
             (l->stream ? "; up to " + std::to_string(kernels::STREAM_M) + " tokens: our AVX512-VNNI stream of its layout"
                        : "");
    dnnl_primitive_desc_t pd = matmul_pd(PACK_M, 1024, 1024, nullptr);
    const std::string offered = pd ? impl_of(pd) : "none";
    if (pd) dnnl_primitive_desc_destroy(pd);
    return "int8 per channel: unavailable, oneDNN offers [" + offered + "] here, no VNNI or AMX (int16 sums saturate)";
  }();
  return path.c_str();
}
