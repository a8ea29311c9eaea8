// Every decoder layer of the model as one MindSpore op: per layer, the four fused ops of
// fused_linear.cpp / linear_int8.cpp (attention + output projection, residual add + RMSNorm +
// gate|up, SwiGLU + down, residual add + RMSNorm + the next layer's Q|K|V) called in turn,
// intermediates in this thread's buffers. The graph around it is then ~8 ops, not ~35:
// - building a graph is per op and per input node (the unrolled 30-layer SmolLM2 graph took ~3.4 s,
//   25 of them at start);
// - each step pays MindSpore ~7 us an op launch (no-op custom ops, 30 against 1, Zen 3).
// - each input costs a step ~0.8 us too, so every layer's weights of a kind, and its K and V
//   caches, come stacked in one tensor [layers, ...] each: ~14-22 inputs, not 188 (fp32) or 428 (int8).
// Tensor-parallel ranks (their partial sums are combined between the parts) and float weights
// padded to whole blocks keep four ops a layer.
// LoRA (agent/model/lora.py): each weight then has every adapter slot's A rows after its own (int8:
// float A rows beside the int8 weight, linear_int8.cpp's Shrink), so
// each call's output holds x·W and x·A of every slot; `Lora::expand` adds each token's own slot's
// (x·A)·B to x·W and packs the rows back to x·W's width before the next call reads them.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "buffers.h"
#include "dnnl.h"
#include "kv_rows.h"
#include "parallel.h"
#include "prologue.h"
#include "rows.h"

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
  void take(void **params, int *ndims, int64_t **shapes, const char **dtypes, int i) {
    add(params[i], ndims[i], shapes[i], dtypes[i]);
  }
  int run(Op *op, void *stream, void *extra) { return op(n, p, d, s, t, stream, extra); }
};

// Inputs, in order: x [n, H]; cos and sin tables, positions, slots, context slots, token rows (the
// attention's shared inputs); the norm constants [eps, activation]; the key caches [L, S, kv, hd];
// the value caches; the layer prologues (prologue.h: Q|K|V bias, q/k norm gains and eps, window,
// rope table; where P has room for them, the gains of the norms on the attention's and the MLP's
// outputs, applied before each residual add) [L, P]; then the
// weights of Q|K|V, o, gate|up and down, `per` inputs each, every layer's stacked [L, ...] (`per`:
// 1 for float blocks [N/64, K, 64]; 3 for int8 qw [N, Kp], sw, g, or oneDNN's packed bytes, sw [N, 1], g; 4 with
// LoRA on int8: A [E, K] more). Output: the final RMSNorm of
// the last layer's output [n, H] (its gain is folded into the LM head). With LoRA, 5 inputs more:
// each token's slot, one-hot [n, slots] (zeros: none), and the expand rows of Q|K|V, o, gate|up
// and down, [L, slots, rank, the kind's width] each.
constexpr int COS = 1, SIN = 2, POSITIONS = 3, SLOTS = 4, CONTEXT = 5, ROWS = 6, EPS = 7, K_CACHE = 8, V_CACHE = 9,
              PROLOGUE = 10, WEIGHTS = 11;

int64_t element_bytes(const char *dtype) {
  for (const char *t : {"float32", "int32"})
    if (!std::strcmp(dtype, t)) return 4;
  for (const char *t : {"float16", "uint16", "bfloat16"})
    if (!std::strcmp(dtype, t)) return 2;
  return !std::strcmp(dtype, "int8") ? 1 : 0;
}

struct Stack {
  int per;
  int64_t layers;
  void **params;
  int *ndims;
  int64_t **shapes;
  const char **dtypes;
  void *mask = nullptr;  // int8 with LoRA: each token's slot, after each call's A (linear_int8.cpp's Shrink)
  int64_t mask_shape[2] = {};

  // Whether every stacked input has `layers` slices of a known element type.
  bool valid() const {
    for (int in = K_CACHE; in < WEIGHTS + 4 * per; ++in)
      if (ndims[in] < 2 || shapes[in][0] != layers || !element_bytes(dtypes[in])) return false;
    return true;
  }
  // Layer i's slice of stacked input `in`, as the next argument of a call.
  void slice(Args &a, int in, int64_t i) const {
    int64_t size = element_bytes(dtypes[in]);
    for (int d = 1; d < ndims[in]; ++d) size *= shapes[in][d];
    a.add(static_cast<char *>(params[in]) + i * size, ndims[in] - 1, shapes[in] + 1, dtypes[in]);
  }
  // Input index of input `j` of weight `kind` (0 Q|K|V, 1 o, 2 gate|up, 3 down).
  int weight(int kind, int j) const { return WEIGHTS + kind * per + j; }
  void weights(Args &a, int kind, int64_t i) {
    for (int j = 0; j < per; ++j) slice(a, weight(kind, j), i);
    if (per == 4) a.add(mask, 2, mask_shape, "float32");
  }
  int64_t width(int kind) const {  // output columns of a weight of this kind (int8: rows of its scales, A's)
    if (per == 3) return shapes[weight(kind, 1)][1];
    if (per == 4) return shapes[weight(kind, 1)][1] + shapes[weight(kind, 3)][1];
    const int64_t *s = shapes[weight(kind, 0)] + 1;
    return s[0] * s[2];
  }
};

// The LoRA inputs after the weights (none: `on` is false and every width is the weight's). Kind k
// fuses MODULES[k] modules (Q|K|V, o, gate|up, down); a slot's x·A columns are module by module,
// `rank` each, and its B rows [rank, width] hold each module's B^T in that module's output columns.
constexpr int64_t MODULES[4] = {3, 1, 2, 1};
constexpr int64_t MAX_RANK = 256;  // max_lora_rank's bound (common/config_keys.py)

struct Lora {
  bool on = false;
  const float *mask = nullptr;
  int64_t slots = 0;
  const float *b[4] = {};  // per kind [L, slots, rank, width]
  int64_t rank[4] = {}, out[4] = {}, cols[4][4] = {};  // cols: each module's first output column, then the width

  // Reads the inputs from `first` on (kv_width: K's columns of Q|K|V); false where their shapes do
  // not fit the weights'.
  bool read(const Stack &st, int first, void **params, int *ndims, int64_t **shapes, int64_t padded, int64_t kv_width) {
    on = true;
    if (ndims[first] != 2 || shapes[first][0] != padded) return false;
    mask = static_cast<const float *>(params[first]);
    slots = shapes[first][1];
    for (int k = 0; k < 4; ++k) {
      const int in = first + 1 + k;
      if (ndims[in] != 4 || shapes[in][0] != st.layers || shapes[in][1] != slots) return false;
      b[k] = static_cast<const float *>(params[in]), rank[k] = shapes[in][2], out[k] = shapes[in][3];
      if (rank[k] > MAX_RANK) return false;
      if (out[k] + slots * MODULES[k] * rank[k] > st.width(k)) return false;
    }
    const int64_t q = out[0] - 2 * kv_width, i = out[2] / 2;
    const int64_t c[4][4] = {{0, q, q + kv_width, out[0]}, {0, out[1]}, {0, i, out[2]}, {0, out[3]}};
    std::memcpy(cols, c, sizeof(cols));
    return q > 0;
  }
  // Columns of kind k's x·W (the weight's own rows, without the adapters').
  int64_t width(const Stack &st, int k) const { return on ? out[k] : st.width(k); }
  // y [n, stride]: x·W in its first out[k] columns, then x·A of every slot. Each token's row gets its
  // slot's (x·A)·B, module by module, and the rows are packed to out[k] columns (row t moves down to
  // t * out[k], below every later row's start, so rows are moved in order). Grouped as punica's
  // SGMV: per slot, per module, per 256 columns, every token of the slot in turn while that block
  // of B (rank x 256 floats) stays in L1; a token at a time re-read its slot's whole B.
  void expand(float *y, int64_t n, int64_t stride, int k, int64_t layer) const {
    if (!on) return;
    constexpr int64_t CHUNK = 256;
    const int64_t per_slot = MODULES[k] * rank[k];
    thread_local std::vector<std::vector<int64_t>> tokens;
    tokens.assign(slots, {});
    for (int64_t t = 0; t < n; ++t)
      for (int64_t s = 0; s < slots; ++s)
        if (mask[t * slots + s] != 0.f) tokens[s].push_back(t);
    struct Item { int64_t s, m, begin, end; };
    thread_local std::vector<Item> items;
    items.clear();
    for (int64_t s = 0; s < slots; ++s) {
      if (tokens[s].empty()) continue;
      for (int64_t m = 0; m < MODULES[k]; ++m)
        for (int64_t o = cols[k][m]; o < cols[k][m + 1]; o += CHUNK)
          items.push_back({s, m, o, std::min(o + CHUNK, cols[k][m + 1])});
    }
    // the workers read this thread's lists (a thread_local named inside the lambda is the worker's own)
    const auto &by_slot = tokens;
    const auto &work = items;
    kernels::parallel_chunks(static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t it = begin; it < end; ++it) {
        const Item &c = work[it];
        const std::vector<int64_t> &ts = by_slot[c.s];
        Rows rows{y, stride, out[k], c.s * per_slot + c.m * rank[k], c.s, slots, mask};
        const float *bs = b[k] + (layer * slots + c.s) * rank[k] * out[k];
        // Every token through the same 4-token code, a short last group filled with its last token
        // (computed, not stored): a token's sums do not depend on where the step's other tokens put
        // it. A separate one-token tail summed in another order (the compiler may reassociate each
        // variant's loops its own way), so identical rows of one adapter came back apart.
        for (size_t i = 0; i < ts.size(); i += 4) {
          const size_t n = std::min<size_t>(4, ts.size() - i);
          const int64_t group[4] = {ts[i], ts[i + std::min<size_t>(1, n - 1)], ts[i + std::min<size_t>(2, n - 1)],
                                    ts[i + n - 1]};
          rows.add(group, n, bs, rank[k], c.begin, c.end);
        }
      }
    });
    for (int64_t t = 1; t < n; ++t) std::memmove(y + t * out[k], y + t * stride, out[k] * sizeof(float));
  }

  // NT tokens' rows of y: columns [begin, end) += sum over j of u[j] x B row j, in 16-column blocks
  // whose NT x 16 sums stay in registers across the rank (each B row loaded once for NT tokens).
  // A column at a time in place (rank-1 updates of the whole row chunk) ran ~3x slower: every update
  // loaded and stored the row again.
  struct Rows {
    float *y;
    int64_t stride, w, u0, s, slots;
    const float *mask;

    // The first `n` of the NT tokens are stored (the others repeat one of them to fill the group).
    void add(const int64_t *ts, size_t n, const float *bs, int64_t r, int64_t begin, int64_t end) const {
      constexpr int NT = 4;
      constexpr int64_t OB = 16;
      float *row[NT];
      float coef[NT][MAX_RANK];  // the slot's x·A times its mask
      for (int a = 0; a < NT; ++a) {
        row[a] = y + ts[a] * stride;
        const float on_s = mask[ts[a] * slots + s];
        for (int64_t j = 0; j < r; ++j) coef[a][j] = row[a][w + u0 + j] * on_s;
      }
      int64_t o = begin;
      for (; o + OB <= end; o += OB) {
        float acc[NT][OB];
        for (int a = 0; a < NT; ++a)
          for (int64_t c = 0; c < OB; ++c) acc[a][c] = row[a][o + c];
        for (int64_t j = 0; j < r; ++j) {
          const float *bj = bs + j * w + o;
          for (int a = 0; a < NT; ++a)
            for (int64_t c = 0; c < OB; ++c) acc[a][c] += coef[a][j] * bj[c];
        }
        for (size_t a = 0; a < n; ++a)
          for (int64_t c = 0; c < OB; ++c) row[a][o + c] = acc[a][c];
      }
      for (; o < end; ++o)
        for (size_t a = 0; a < n; ++a)
          for (int64_t j = 0; j < r; ++j) row[a][o] += coef[a][j] * bs[j * w + o];
    }
  };
};

int decoder_stack(int per, Op *attention_linear, Op *add_rms_linear, Op *swiglu_linear, Op *add_rms, int nparam,
                  void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra) {
  const int inputs = nparam - 1, plain = WEIGHTS + 4 * per;
  if (ndims[0] != 2 || (inputs != plain && inputs != plain + 5) || (per == 4 && inputs == plain) ||
      ndims[K_CACHE] < 1)
    return 1;
  Stack st{per, shapes[K_CACHE][0], params, ndims, shapes, dtypes};
  if (!st.valid() || (per == 1 ? ndims[st.weight(0, 0)] != 4 : ndims[st.weight(0, 1)] != 3)) return 1;
  const int64_t padded = shapes[0][0], h = shapes[0][1];
  Lora lora;
  const int64_t kv_width = shapes[K_CACHE][2] * kernels::cache_head_dim(shapes[K_CACHE][3], dtypes[K_CACHE]);
  if (inputs > plain && !lora.read(st, plain, params, ndims, shapes, padded, kv_width)) return 1;
  const int64_t nqkv = lora.width(st, 0), ngu = lora.width(st, 2);
  if (lora.width(st, 1) != h || lora.width(st, 3) != h) return 1;  // padded float blocks: the model keeps four ops
  const int64_t wq = st.width(0), wo = st.width(1), wg = st.width(2), wd = st.width(3);  // each call's output
  const int64_t hd = kernels::cache_head_dim(shapes[K_CACHE][3], dtypes[K_CACHE]);
  const int64_t pro_len = shapes[PROLOGUE][1], post_gains = kernels::prologue::length(nqkv, hd);
  const bool sandwich = pro_len == kernels::prologue::sandwich_length(nqkv, hd, h);
  if (!sandwich && pro_len != post_gains) return 1;
  const float eps = static_cast<const float *>(params[EPS])[0];
  // The step's tokens up to its bucket are padding after the real ones, each writing slot 0 (block 0
  // is reserved for them; agent/runner.py refuses real tokens there). A step pads to its bucket,
  // ~1.5x apart: up to a third of a step was padding. Only the real rows and the padding up to their
  // row bucket (dnnl.h: <= 1/8 more, so that oneDNN's primitives come in few shapes) are computed;
  // the output's rows past the real ones are zeros (no sampled row reads them).
  const int32_t *slot = static_cast<const int32_t *>(params[SLOTS]);
  int64_t real = padded;
  while (real > 1 && slot[real - 1] == 0) --real;
  const int64_t n = std::min(kernels::row_bucket(real), padded);
  if (per == 4) st.mask = params[plain], st.mask_shape[0] = n, st.mask_shape[1] = shapes[plain][1];
  float *out = static_cast<float *>(params[nparam - 1]);
  std::fill(out + n * h, out + padded * h, 0.f);
  thread_local kernels::line_vector<float> x, mid, attn, gu, delta, qkv;
  delta.assign(n * wd, 0.f);  // layer 0 adds nothing: the embeddings, their norm and Q|K|V in one call
  x.resize(n * h), mid.resize(n * h), attn.resize(n * wo), gu.resize(n * wg), qkv.resize(n * wq);
  int64_t hs[2] = {n, h}, gs[2] = {n, ngu}, qs[2] = {n, nqkv};
  int64_t qo[2] = {n, wq}, ao[2] = {n, wo}, go[2] = {n, wg}, dout[2] = {n, wd};  // the calls' outputs
  float *in = static_cast<float *>(params[0]);
  auto f32 = [](kernels::line_vector<float> &v) { return static_cast<void *>(v.data()); };

  Args first;  // the embeddings, their norm, layer 0's Q|K|V
  first.add(in, 2, hs, "float32");
  first.add(f32(delta), 2, hs, "float32");
  first.take(params, ndims, shapes, dtypes, EPS);
  st.weights(first, 0, 0);
  first.add(f32(x), 2, hs, "float32");
  first.add(f32(qkv), 2, qo, "float32");
  if (int rc = first.run(add_rms_linear, stream, extra)) return rc;
  lora.expand(qkv.data(), n, wq, 0, 0);

  for (int64_t i = 0; i < st.layers; ++i) {
    Args a;  // attention, output projection: RopeAttention's 10 inputs (qkv first), o, the output
    a.add(f32(qkv), 2, qs, "float32");
    for (int k : {COS, SIN, POSITIONS, SLOTS}) a.take(params, ndims, shapes, dtypes, k);
    st.slice(a, K_CACHE, i);
    st.slice(a, V_CACHE, i);
    for (int k : {CONTEXT, ROWS}) a.take(params, ndims, shapes, dtypes, k);
    st.slice(a, PROLOGUE, i);
    st.weights(a, 1, i);
    a.add(f32(attn), 2, ao, "float32");
    if (int rc = a.run(attention_linear, stream, extra)) return rc;
    lora.expand(attn.data(), n, wo, 1, i);
    const float *gains = static_cast<const float *>(params[PROLOGUE]) + i * pro_len + post_gains;
    if (sandwich)
      for (int64_t r = 0; r < n; ++r) kernels::rms_gain_row(attn.data() + r * h, h, eps, gains);

    Args b;  // x + attention, its norm, gate|up
    b.add(f32(x), 2, hs, "float32");
    b.add(f32(attn), 2, hs, "float32");
    b.take(params, ndims, shapes, dtypes, EPS);
    st.weights(b, 2, i);
    b.add(f32(mid), 2, hs, "float32");
    b.add(f32(gu), 2, go, "float32");
    if (int rc = b.run(add_rms_linear, stream, extra)) return rc;
    lora.expand(gu.data(), n, wg, 2, i);

    Args c;  // SwiGLU or GeGLU, down
    c.add(f32(gu), 2, gs, "float32");
    c.take(params, ndims, shapes, dtypes, EPS);
    st.weights(c, 3, i);
    c.add(f32(delta), 2, dout, "float32");
    if (int rc = c.run(swiglu_linear, stream, extra)) return rc;
    lora.expand(delta.data(), n, wd, 3, i);
    if (sandwich)
      for (int64_t r = 0; r < n; ++r) kernels::rms_gain_row(delta.data() + r * h, h, eps, gains + h);

    Args d;  // + MLP, its norm, and the next layer's Q|K|V or (last layer) the op's output
    d.add(f32(mid), 2, hs, "float32");
    d.add(f32(delta), 2, hs, "float32");
    d.take(params, ndims, shapes, dtypes, EPS);
    if (i + 1 == st.layers) {
      d.add(f32(x), 2, hs, "float32");
      d.take(params, ndims, shapes, dtypes, nparam - 1);
      const int rc = d.run(add_rms, stream, extra);
      std::fill(out + real * h, out + n * h, 0.f);
      return rc;
    }
    st.weights(d, 0, i + 1);
    d.add(f32(x), 2, hs, "float32");
    d.add(f32(qkv), 2, qo, "float32");
    if (int rc = d.run(add_rms_linear, stream, extra)) return rc;
    lora.expand(qkv.data(), n, wq, 0, i + 1);
  }
  return 1;  // no layers
}

}  // namespace

extern "C" {
Op RopeAttentionLinear, AddRmsLinear, SwiGluLinear, RopeAttentionLinearInt8, AddRmsLinearInt8, SwiGluLinearInt8,
    AddRmsNorm;

// Float weight blocks (fp32, bf16, f16). Marked as writing memory (the KV caches), as
// RopeAttentionLinear is.
int DecoderStack(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                 void *extra) {
  return decoder_stack(1, RopeAttentionLinear, AddRmsLinear, SwiGluLinear, AddRmsNorm, nparam, params, ndims, shapes,
                       dtypes, stream, extra);
}

// int8 weights: qw, sw, g for each; with LoRA, each kind's float A rows after them (linear_int8.cpp's Shrink).
int DecoderStackInt8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                     void *extra) {
  return decoder_stack(nparam - 1 == WEIGHTS + 4 * 3 ? 3 : 4, RopeAttentionLinearInt8, AddRmsLinearInt8, SwiGluLinearInt8, AddRmsNorm, nparam, params,
                       ndims, shapes, dtypes, stream, extra);
}
}
