// A whole decoder layer as one MindSpore op: the four fused ops of fused_linear.cpp and
// linear_int8.cpp (attention + output projection, residual add + RMSNorm + gate|up, SwiGLU + down,
// residual add + RMSNorm + the next layer's Q|K|V) called in turn, intermediates in this thread's
// buffers. MindSpore's runtime spends ~25 us per op launch whatever its size (perf, one-row int8
// decode step of SmolLM2 on Zen 3: 3.3 ms of a ~14 ms step in the launch path, ~130 ops), so a
// layer in one op saves 3 launches a layer, 87 a SmolLM2 step. The model's last layer, and
// tensor-parallel ranks (whose partial sums are combined between the parts), keep the four ops.
#include <cstdint>
#include <vector>

namespace {

using Op = int(int, void **, int *, int64_t **, const char **, void *, void *);
constexpr int MAX_ARGS = 16;

// One call's argument lists, filled in order.
struct Args {
  void *p[MAX_ARGS];
  int d[MAX_ARGS];
  int64_t *s[MAX_ARGS];
  const char *t[MAX_ARGS];
  int n = 0;

  void add(void *ptr, int ndim, int64_t *shape, const char *dtype) {
    p[n] = ptr, d[n] = ndim, s[n] = shape, t[n] = dtype, ++n;
  }
  void take(void **params, int *ndims, int64_t **shapes, const char **dtypes, int first, int count) {
    for (int i = first; i < first + count; ++i) add(params[i], ndims[i], shapes[i], dtypes[i]);
  }
  int run(Op *op, void *stream, void *extra) { return op(n, p, d, s, t, stream, extra); }
};

constexpr int ATTN = 1;     // RopeAttention's 9 inputs start here (qkv first)
constexpr int EPS = 10;     // the norms' epsilon [1]
constexpr int WEIGHTS = 11; // then o, gate|up, down, next Q|K|V: `per` inputs each

// `per`: inputs per weight (1: float blocks [N/64, K, 64]; 3: int8 qw [N, Kp], sw, g).
int decoder_layer(int per, Op *attention_linear, Op *add_rms_linear, Op *swiglu_linear, int nparam, void **params,
                  int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra) {
  if (nparam != WEIGHTS + 4 * per + 2 || ndims[0] != 2) return 1;
  const int64_t n = shapes[0][0], h = shapes[0][1];
  auto width = [&](int w) {  // output columns of weight w
    const int64_t *s = shapes[WEIGHTS + w * per];
    return per == 1 ? s[0] * s[2] : s[0];
  };
  const int64_t ngu = width(1);
  if (width(0) != h || width(2) != h) return 1;  // padded float blocks: the model keeps four ops
  thread_local std::vector<float> attn, mid, gu, delta;
  attn.resize(n * h), mid.resize(n * h), gu.resize(n * ngu), delta.resize(n * h);
  int64_t hs[2] = {n, h}, gs[2] = {n, ngu};
  auto weights = [&](Args &a, int w) { a.take(params, ndims, shapes, dtypes, WEIGHTS + w * per, per); };

  Args a;  // attention, output projection
  a.take(params, ndims, shapes, dtypes, ATTN, 9);
  weights(a, 0);
  a.add(attn.data(), 2, hs, "float32");
  if (int rc = a.run(attention_linear, stream, extra)) return rc;

  Args b;  // x + attention, its norm, gate|up
  b.take(params, ndims, shapes, dtypes, 0, 1);
  b.add(attn.data(), 2, hs, "float32");
  b.take(params, ndims, shapes, dtypes, EPS, 1);
  weights(b, 1);
  b.add(mid.data(), 2, hs, "float32");
  b.add(gu.data(), 2, gs, "float32");
  if (int rc = b.run(add_rms_linear, stream, extra)) return rc;

  Args c;  // SwiGLU, down
  c.add(gu.data(), 2, gs, "float32");
  weights(c, 2);
  c.add(delta.data(), 2, hs, "float32");
  if (int rc = c.run(swiglu_linear, stream, extra)) return rc;

  Args d;  // + MLP, its norm, the next layer's Q|K|V: this op's two outputs
  d.add(mid.data(), 2, hs, "float32");
  d.add(delta.data(), 2, hs, "float32");
  d.take(params, ndims, shapes, dtypes, EPS, 1);
  weights(d, 3);
  d.take(params, ndims, shapes, dtypes, nparam - 2, 2);
  return d.run(add_rms_linear, stream, extra);
}

}  // namespace

extern "C" {
Op RopeAttentionLinear, AddRmsLinear, SwiGluLinear, RopeAttentionLinearInt8, AddRmsLinearInt8, SwiGluLinearInt8;

// Inputs: x [n, H], RopeAttention's 9 (qkv first), eps [1], then the float weight blocks of o,
// gate|up, down and the next layer's Q|K|V. Outputs: x + attention + MLP [n, H], the next Q|K|V.
// Marked as writing memory (the KV caches), as RopeAttentionLinear is.
int DecoderLayer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                 void *extra) {
  return decoder_layer(1, RopeAttentionLinear, AddRmsLinear, SwiGluLinear, nparam, params, ndims, shapes, dtypes,
                       stream, extra);
}

// The same with int8 weights: qw, sw, g for each of the four.
int DecoderLayerInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                     void *extra) {
  return decoder_layer(3, RopeAttentionLinearInt8, AddRmsLinearInt8, SwiGluLinearInt8, nparam, params, ndims,
                       shapes, dtypes, stream, extra);
}
}
