// The part of oneDNN's C API the kernels use, from the libdnnl.so.3 (oneDNN 3.10) that MindSpore CPU
// ships and links (no headers ship with it). Primitives run sequentially when executed on a stream
// without a threadpool, so the kernels split work over their own pool (parallel.h).
#pragma once
#include <cstddef>
#include <cstdint>

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
enum { dnnl_f16 = 1, dnnl_bf16 = 2, dnnl_f32 = 3 };     // dnnl_data_type_t
enum { dnnl_cpu = 1 };                                  // dnnl_engine_kind_t
enum { dnnl_stream_in_order = 1 };                      // dnnl_stream_flags_t
enum { dnnl_scratchpad_mode_user = 1 };                 // dnnl_scratchpad_mode_t
enum { dnnl_query_impl_info_str = 8, dnnl_query_scratchpad_md = 136 };  // dnnl_query_t
enum { DNNL_ARG_SRC = 1, DNNL_ARG_DST = 17, DNNL_ARG_WEIGHTS = 33, DNNL_ARG_SCRATCHPAD = 80 };

int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
               const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
int dnnl_engine_create(dnnl_engine_t *engine, int kind, size_t index);
int dnnl_stream_create(dnnl_stream_t *stream, dnnl_engine_t engine, unsigned flags);
int dnnl_memory_desc_create_with_strides(dnnl_memory_desc_t *md, int ndims, const dnnl_dims_t dims, int data_type,
                                         const dnnl_dims_t strides);
int dnnl_memory_desc_destroy(dnnl_memory_desc_t md);
size_t dnnl_memory_desc_get_size(const_dnnl_memory_desc_t md);
int dnnl_memory_create(dnnl_memory_t *memory, const_dnnl_memory_desc_t md, dnnl_engine_t engine, void *handle);
int dnnl_memory_set_data_handle(dnnl_memory_t memory, void *handle);
int dnnl_primitive_attr_create(dnnl_primitive_attr_t *attr);
int dnnl_primitive_attr_destroy(dnnl_primitive_attr_t attr);
int dnnl_primitive_attr_set_scratchpad_mode(dnnl_primitive_attr_t attr, int mode);
int dnnl_matmul_primitive_desc_create(dnnl_primitive_desc_t *pd, dnnl_engine_t engine, const_dnnl_memory_desc_t src,
                                      const_dnnl_memory_desc_t weights, const_dnnl_memory_desc_t bias,
                                      const_dnnl_memory_desc_t dst, dnnl_primitive_attr_t attr);
int dnnl_primitive_desc_query(dnnl_primitive_desc_t pd, int what, int index, void *result);
const_dnnl_memory_desc_t dnnl_primitive_desc_query_md(dnnl_primitive_desc_t pd, int what, int index);
int dnnl_primitive_desc_destroy(dnnl_primitive_desc_t pd);
int dnnl_primitive_create(dnnl_primitive_t *primitive, dnnl_primitive_desc_t pd);
int dnnl_primitive_execute(dnnl_primitive_t primitive, dnnl_stream_t stream, int nargs, const dnnl_exec_arg_t *args);
int dnnl_stream_wait(dnnl_stream_t stream);
}
