"""GGUF files (llama.cpp) as Hugging Face-named tensors and our config: architectures `llama`
(Llama, Mistral), `qwen2`, `qwen3` and `gemma3` (norm weights as llama.cpp stores them: 1 + w). Every tensor type the gguf package dequantises is read
(F32, F16, BF16, Q8_0, the K-quants Q4_K, Q5_K, Q6_K...), to float32 at load; with ``int8``, Q8_0
projection matrices are kept as their int8 rows (agent.model.quant.Int8Rows) where every layer's are
Q8_0 (a mixed file, Q4_K_M's, is dequantised and requantised alike: the layers' int8 rows must
share one layout). Tensors and metadata that
would change the math and are not implemented are refused by name (agent.weights.families)."""
from __future__ import annotations

from typing import Any

import numpy as np

from agent.weights.families import FAMILIES, UnsupportedModel, check_tensors
from agent.weights.lazy import LazyWeights
from agent.model_config import ModelConfig
from agent.model.blocks import BLOCK_TYPES, TYPE_NAMES, BlockRows
from agent.model.quant import from_q8_0
from common.gguf_file import GgufFile
from common.model_files import GGUF_ARCHITECTURES, ModelFiles, unsupported_family

_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3's four norms a layer: its ffn_norm is the MLP's input norm, and the outputs have their own.
_SANDWICH = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF architectures map to our families in common.model_files.GGUF_ARCHITECTURES. llama.cpp permutes
# Llama's Q/K rows for its interleaved rope at convert time (undone here); Qwen's and Gemma's it
# leaves in the rotate-half order.
# What llama.cpp fixes for gemma3 rather than storing: every 6th layer global, the others sliding
# with rope base 10000; the attention scale 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 27B (62 layers).
GEMMA3_PATTERN, GEMMA3_SLIDING_THETA, GEMMA3_27B_LAYERS = 6, 10000.0, 62
ROPE_SCALING = ("none", "linear")


def unpermute_rows(rows: int, n_heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's convert-time Q/K row permutation (interleaved -> rotate-half rope)."""
    return np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(rows)


def read_tensor(t: Any, int8: bool = False, blocks: bool = False) -> Any:
    """A GGUF tensor as float32 [rows, cols] (numpy order), or Int8Rows for a Q8_0 matrix when int8,
    or (`blocks`: model_dtype gguf) a matrix's blocks as stored (BlockRows)."""
    import gguf

    shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims fastest-first
    if blocks and len(shape) == 2:
        if int(t.tensor_type) not in BLOCK_TYPES:
            raise UnsupportedModel(f"{t.name} is {t.tensor_type.name}: model_dtype gguf reads "
                                   f"{', '.join(TYPE_NAMES.values())} blocks as stored; serve this file in float32, "
                                   "bfloat16 or int8")
        return BlockRows(int(t.tensor_type), np.array(t.data, np.uint8).reshape(shape[0], -1), shape[1])
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        blocks = np.asarray(t.data, np.uint8).reshape(-1, 34)  # per 32 values: f16 scale, 32 x int8
        d = np.ascontiguousarray(blocks[:, :2]).view(np.float16)[:, 0]
        q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
        if int8 and len(shape) == 2:
            return from_q8_0(q.reshape(shape), d.reshape(shape[0], -1))
        # faster than gguf.quants' own loop (docs/perf-notes.md), with the same exact products
        return (q.astype(np.float32) * d[:, None].astype(np.float32)).reshape(shape)
    # a copy even for F32 (a view would map the file pages back in after drop_pages)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)


def load_gguf(files: ModelFiles, int8: bool = False, blocks: bool = False) -> tuple[ModelConfig, LazyWeights]:
    """`blocks`: the matrices as stored (model_dtype gguf); `int8`: Q8_0 matrices as int8 rows."""
    import gguf

    reader = GgufFile(files.path)
    meta = {k: v for k, v in reader.meta.items() if not k.startswith("tokenizer.ggml.")}
    eos = reader.meta["tokenizer.ggml.eos_token_id"]
    bos = reader.meta.get("tokenizer.ggml.bos_token_id")
    n_vocab = len(reader.meta["tokenizer.ggml.tokens"])
    reader.meta.clear()  # the tokenizer's entries (Gemma 3's: 262k strings); the server reads them
    by_name = {t.name: t for t in reader.tensors}
    factors = by_name.pop("rope_freqs.weight", None)  # Llama 3's rope scaling, as llama.cpp writes it
    cfg = _config(meta, "output.weight" in by_name, n_vocab, bos, int(eos),
                  None if factors is None else tuple(float(f) for f in read_tensor(factors, False).reshape(-1)))
    unpermute = cfg.family.name == "llama"
    q8 = [t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for n, t in by_name.items() if n.startswith("blk.")
          and len(t.shape) == 2]
    int8 = int8 and all(q8)
    layer_names = dict(_LAYER, **_SANDWICH) if cfg.family.sandwich_norms else _LAYER
    weights = LazyWeights()
    for name, t in by_name.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in layer_names:
            rows = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(parts[2]) if unpermute else None
            rows = rows if parts[3] == "weight" else None
            ours = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        elif parts[0] in _TOP and len(parts) == 2:
            rows, ours = None, f"{_TOP[parts[0]]}.{parts[1]}"
        else:
            ours, rows = f"(gguf) {name}", None  # reported by check_tensors as unread
        weights.add(ours, lambda t=t, rows=rows: _unpermuted(reader, t, int8, rows, blocks))
    check_tensors(cfg, weights, files.path.name)
    return cfg, weights


def _config(meta: dict[str, Any], untied: bool, n_vocab: int, bos: int | None, eos: int,
            factors: tuple[float, ...] | None) -> ModelConfig:
    arch = meta["general.architecture"]
    if why := unsupported_family(arch, gguf=True):
        raise UnsupportedModel(why)
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    scaling = a("rope.scaling.type", "none")
    if scaling not in ROPE_SCALING:
        raise UnsupportedModel(f"GGUF {arch}.rope.scaling.type {scaling!r} is not supported "
                               f"(supported: {', '.join(ROPE_SCALING)})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if a(key):
            raise UnsupportedModel(f"GGUF {arch}.{key} is not supported")
    heads, layers, window = a("attention.head_count"), a("block_count"), a("attention.sliding_window")
    windows = (window,) * layers if window else ()
    gemma = {}
    if arch == "gemma3":
        windows = tuple(window if s else 0 for s in gemma3_sliding(a("attention.sliding_window_pattern"), layers)) \
            if window else ()
        head_dim = a("attention.key_length") or a("embedding_length") // heads
        scalar = a("embedding_length") // heads if layers == GEMMA3_27B_LAYERS else head_dim
        gemma = dict(sliding_rope_theta=GEMMA3_SLIDING_THETA if window else 0.0, attn_scale=float(scalar) ** -0.5)
    return ModelConfig(
        vocab_size=int(a("vocab_size") or n_vocab), hidden_size=a("embedding_length"),
        intermediate_size=a("feed_forward_length"), num_layers=a("block_count"), num_heads=heads,
        num_kv_heads=a("attention.head_count_kv", heads), head_dim=a("attention.key_length", 0),
        rms_eps=a("attention.layer_norm_rms_epsilon"), rope_theta=a("rope.freq_base", 10000.0),
        rope_scaling={"rope_type": "linear", "factor": a("rope.scaling.factor")} if scaling == "linear" else None,
        rope_freq_factors=factors, tie_word_embeddings=not untied, max_position=a("context_length", 4096),
        bos_token_id=bos, eos_token_ids=[eos], layer_windows=windows, **gemma, family=FAMILIES[GGUF_ARCHITECTURES[arch]])


def gemma3_sliding(pattern: Any, layers: int) -> list[bool]:
    """Which layers slide: `{arch}.attention.sliding_window_pattern` as one bool a layer or a period
    (every period-th layer global); absent, llama.cpp's fixed period for gemma3."""
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise UnsupportedModel(f"GGUF sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        return [bool(s) for s in pattern]
    period = int(pattern or GEMMA3_PATTERN)
    return [(i + 1) % period != 0 for i in range(layers)]


def _unpermuted(reader: GgufFile, t: Any, int8: bool, heads: int | None, blocks: bool) -> Any:
    arr = read_tensor(t, int8, blocks)
    reader.drop_pages(t)
    if heads is None:
        return arr
    order = unpermute_rows(arr.shape[0], heads)
    return arr.take(order) if isinstance(arr, BlockRows) else arr[order]
