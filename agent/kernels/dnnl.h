// The part of oneDNN's C API the kernels use, from the libdnnl.so.3 (oneDNN 3.10) that MindSpore CPU
// ships and links (no headers ship with it). Primitives run sequentially when executed on a stream
// without a threadpool: the kernels split work over their own pool (parallel.h), or hand that pool to
// oneDNN as its threadpool.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

extern "C" {
typedef struct dnnl_engine *dnnl_engine_t;
typedef struct dnnl_stream *dnnl_stream_t;
typedef struct dnnl_memory_desc *dnnl_memory_desc_t;
typedef const struct dnnl_memory_desc *const_dnnl_memory_desc_t;
typedef struct dnnl_memory *dnnl_memory_t;
typedef struct dnnl_primitive_attr *dnnl_primitive_attr_t;
typedef struct dnnl_primitive_desc *dnnl_primitive_desc_t;
typedef struct dnnl_primitive *dnnl_primitive_t;
typedef int64_t dnnl_dims_t[12];
typedef struct {
  int arg;
  dnnl_memory_t memory;
} dnnl_exec_arg_t;

enum { dnnl_success = 0 };
enum { dnnl_f16 = 1, dnnl_bf16 = 2, dnnl_f32 = 3, dnnl_s8 = 5 };  // dnnl_data_type_t
enum { dnnl_format_tag_any = 1, dnnl_a = 2, dnnl_ab = 3 };          // dnnl_format_tag_t
enum { dnnl_cpu = 1 };                                  // dnnl_engine_kind_t
enum { dnnl_stream_in_order = 1 };                      // dnnl_stream_flags_t
enum { dnnl_scratchpad_mode_user = 1 };                 // dnnl_scratchpad_mode_t
enum { dnnl_query_impl_info_str = 8, dnnl_query_weights_md = 131, dnnl_query_scratchpad_md = 136 };  // dnnl_query_t
enum { DNNL_ARG_SRC = 1, DNNL_ARG_DST = 17, DNNL_ARG_WEIGHTS = 33, DNNL_ARG_SCRATCHPAD = 80, DNNL_ARG_ATTR_SCALES = 4096 };

int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
               const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
int dnnl_engine_create(dnnl_engine_t *engine, int kind, size_t index);
int dnnl_stream_create(dnnl_stream_t *stream, dnnl_engine_t engine, unsigned flags);
int dnnl_memory_desc_create_with_strides(dnnl_memory_desc_t *md, int ndims, const dnnl_dims_t dims, int data_type,
                                         const dnnl_dims_t strides);
int dnnl_memory_desc_create_with_tag(dnnl_memory_desc_t *md, int ndims, const dnnl_dims_t dims, int data_type, int tag);
int dnnl_memory_desc_clone(dnnl_memory_desc_t *md, const_dnnl_memory_desc_t existing);
int dnnl_memory_desc_destroy(dnnl_memory_desc_t md);
size_t dnnl_memory_desc_get_size(const_dnnl_memory_desc_t md);
int dnnl_memory_create(dnnl_memory_t *memory, const_dnnl_memory_desc_t md, dnnl_engine_t engine, void *handle);
int dnnl_memory_set_data_handle(dnnl_memory_t memory, void *handle);
int dnnl_primitive_attr_create(dnnl_primitive_attr_t *attr);
int dnnl_primitive_attr_destroy(dnnl_primitive_attr_t attr);
int dnnl_primitive_attr_set_scratchpad_mode(dnnl_primitive_attr_t attr, int mode);
int dnnl_primitive_attr_set_scales_mask(dnnl_primitive_attr_t attr, int arg, int mask);
int dnnl_reorder_primitive_desc_create(dnnl_primitive_desc_t *pd, const_dnnl_memory_desc_t src, dnnl_engine_t src_engine,
                                       const_dnnl_memory_desc_t dst, dnnl_engine_t dst_engine, dnnl_primitive_attr_t attr);
int dnnl_matmul_primitive_desc_create(dnnl_primitive_desc_t *pd, dnnl_engine_t engine, const_dnnl_memory_desc_t src,
                                      const_dnnl_memory_desc_t weights, const_dnnl_memory_desc_t bias,
                                      const_dnnl_memory_desc_t dst, dnnl_primitive_attr_t attr);
int dnnl_primitive_desc_query(dnnl_primitive_desc_t pd, int what, int index, void *result);
const_dnnl_memory_desc_t dnnl_primitive_desc_query_md(dnnl_primitive_desc_t pd, int what, int index);
int dnnl_primitive_desc_destroy(dnnl_primitive_desc_t pd);
int dnnl_primitive_create(dnnl_primitive_t *primitive, dnnl_primitive_desc_t pd);
int dnnl_primitive_execute(dnnl_primitive_t primitive, dnnl_stream_t stream, int nargs, const dnnl_exec_arg_t *args);
int dnnl_stream_wait(dnnl_stream_t stream);
int dnnl_stream_destroy(dnnl_stream_t stream);
int dnnl_primitive_destroy(dnnl_primitive_t primitive);
int dnnl_memory_destroy(dnnl_memory_t memory);
// A stream whose primitives split their work over `threadpool` (a dnnl::threadpool_interop::threadpool_iface).
int dnnl_threadpool_interop_stream_create(dnnl_stream_t *stream, dnnl_engine_t engine, void *threadpool);
// The threads a primitive created on this thread is planned for (its pd; execution then runs that plan).
int dnnl_threadpool_interop_set_max_concurrency(int max_concurrency);
int dnnl_threadpool_interop_get_max_concurrency(int *max_concurrency);
}

#include <functional>
// oneDNN's threadpool interface (dnnl_threadpool_iface.hpp, 3.x), declared as oneDNN declares it: the
// virtual functions' order is the ABI its threadpool runtime calls.
namespace dnnl::threadpool_interop {
struct threadpool_iface {
  virtual int get_num_threads() const = 0;
  virtual bool get_in_parallel() const = 0;
  virtual void parallel_for(int n, const std::function<void(int, int)> &fn) = 0;
  virtual uint64_t get_flags() const = 0;
  static constexpr uint64_t ASYNCHRONOUS = 1;
  virtual ~threadpool_iface() = default;
};
}  // namespace dnnl::threadpool_interop

namespace kernels {
// The rows a step's oneDNN primitives are built for: decoder_stack.cpp computes a step's real rows
// up to this count. Exact up to 32; above, rounded up to an eighth of m's power of two (at most 1/8
// more rows). The primitives are cached per row count (linear_blocks.cpp, int8_channel.cpp): one per
// real step length grew an agent by ~1 GiB in 20 minutes of traffic (issue 68, docs/perf-notes.md).
inline int64_t row_bucket(int64_t m) {
  if (m <= 32) return m;
  const int64_t step = (int64_t{1} << (63 - __builtin_clzll(static_cast<uint64_t>(m)))) / 8;
  return (m + step - 1) / step * step;
}

// oneDNN primitives the kernels have built and keep (OnednnPrimitives() reads it).
inline std::atomic<int64_t> &primitives_built() {
  static std::atomic<int64_t> count{0};
  return count;
}

// The scratchpad of the primitive a thread runs now: one buffer per thread, as large as the largest
// any of its primitives asked for (a thread runs one at a time). A buffer per cached primitive made
// the scratchpads' sum grow with every step shape kept.
inline void *thread_scratchpad(size_t bytes) {
  thread_local std::vector<char> pad;
  if (pad.size() < bytes) pad.resize(bytes);
  return pad.data();
}

// The process's one CPU engine.
inline dnnl_engine_t cpu_engine() {
  static dnnl_engine_t e = [] {
    dnnl_engine_t made = nullptr;
    return dnnl_engine_create(&made, dnnl_cpu, 0) == dnnl_success ? made : nullptr;
  }();
  return e;
}
}  // namespace kernels
