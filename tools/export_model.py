"""Write one model in the formats our peers load: a Hugging Face folder (config.json, safetensors,
tokenizer.json; vLLM and transformers) and GGUF files (llama.cpp), from the same weights.

    python -m tools.export_model --from smollm2 --out .peers/models/smollm2
    python -m tools.export_model --random --out .peers/models/llama-768x12   # hidden 768, 12 layers
    python -m tools.export_model --random --shape llama-7b --dtype bf16 --gguf "" --out .peers/models/llama-7b

Everything streams tensor by tensor (random tensors are generated as they are written, each from
its own seed): a 7B export holds one tensor at a time, never the model (27 GB as float32).
`--dtype` is the safetensors dtype (float32, bf16, f16).

The tokenizer always comes from the default model's GGUF vocabulary (random models share it), so
every system sees the same token ids.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any


import numpy as np

from agent.model_config import ModelConfig, Weights, rope_inv_freq
from agent.weights.lazy import LazyWeights
from agent.weights.load import load_model
from common.model_files import GGUF_ARCHITECTURES, resolve_model

# Named shapes (SmolLM2's vocabulary): TinyLlama-1.1B and llama2-7B.
SHAPES = {"llama-1b": dict(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632),
          "llama-7b": dict(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008)}


def random_llama(cfg: ModelConfig, seed: int = 0) -> LazyWeights:
    """Scaled-normal weights (std 0.02, unit norm gains): random, but with sane activations. Each
    tensor is generated when read, from its own seed: the same values every time, none held."""
    d, hd = cfg.hidden_size, cfg.head_dim
    shapes = {"self_attn.q_proj": (cfg.num_heads * hd, d), "self_attn.k_proj": (cfg.num_kv_heads * hd, d),
              "self_attn.v_proj": (cfg.num_kv_heads * hd, d), "self_attn.o_proj": (d, cfg.num_heads * hd),
              "mlp.gate_proj": (cfg.intermediate_size, d), "mlp.up_proj": (cfg.intermediate_size, d),
              "mlp.down_proj": (d, cfg.intermediate_size)}
    w = LazyWeights()

    def normal(name: str, shape: tuple[int, ...]) -> None:
        i = len(w)
        w.add(name, lambda: np.random.default_rng([seed, i]).standard_normal(shape, dtype=np.float32) * np.float32(0.02),
              shape)

    def ones(name: str) -> None:
        w.add(name, lambda: np.ones(d, np.float32), (d,))

    normal("model.embed_tokens.weight", (cfg.vocab_size, d))
    ones("model.norm.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        ones(p + "input_layernorm.weight")
        ones(p + "post_attention_layernorm.weight")
        for name, shape in shapes.items():
            normal(p + name + ".weight", shape)
    if not cfg.tie_word_embeddings:
        normal("lm_head.weight", (cfg.vocab_size, d))
    return w


_ST = {"float32": ("F32", np.float32), "bf16": ("BF16", np.uint16), "f16": ("F16", np.float16)}


def _as_stored(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":  # round to nearest even; numpy has no bfloat16
        u = np.ascontiguousarray(arr, np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.ascontiguousarray(arr, _ST[dtype][1])


def write_safetensors(path: Path, w: Weights, names: list[str], dtype: str = "float32") -> None:
    """A safetensors file written one tensor at a time (the header's offsets come from the shapes,
    read once per tensor here: random and lazily loaded tensors are produced twice, never held)."""
    code, np_type = _ST[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        shape = list(w.shape(name) if isinstance(w, LazyWeights) else w[name].shape)
        size = int(np.prod(shape)) * np.dtype(np_type).itemsize
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for name in names:
            fh.write(_as_stored(w[name], dtype).tobytes())


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert-time Q/K row order (interleaved rope); agent.weights.load undoes it."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf(out: Path, cfg: ModelConfig, w: Weights, tokenizer_gguf: Path, dtype: str = "float32") -> None:
    from common.tokenizer import load_tokenizer
    from common.model_files import ModelFiles

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "torch_dtype": {"float32": "float32", "bf16": "bfloat16", "f16": "float16"}[dtype],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    names = [k for k in w if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    write_safetensors(out / "model.safetensors", w, names, dtype)
    tok = load_tokenizer(ModelFiles("gguf", tokenizer_gguf))
    tok.tok.save(str(out / "tokenizer.json"))
    names = {v: k for k, v in tok.special_tokens.items()}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position,
        "bos_token": names.get(tok.bos_token_id), "eos_token": names.get(tok.eos_token_ids[0]),
        "add_bos_token": tok.add_bos, "chat_template": tok.chat_template}, indent=1))


# Our family -> the GGUF architecture that holds it: the loader's map inverted, and Mistral written as
# llama with its sliding window (as llama.cpp's converter does).
GGUF_ARCH = {family: arch for arch, family in GGUF_ARCHITECTURES.items()} | {"mistral": "llama"}


def _gemma3_keys(writer: Any, cfg: ModelConfig) -> None:
    """Gemma 3's sliding layers as llama.cpp reads them: one window, which layers slide (written only
    where they differ from llama.cpp's fixed every-6th-global), rope base 10000 on sliding layers and
    attention scale 1/sqrt(head_dim), which GGUF cannot state otherwise: refused."""
    from agent.weights.gguf import GEMMA3_SLIDING_THETA, gemma3_sliding

    if abs(cfg.scale - cfg.head_dim ** -0.5) > 1e-9 * cfg.scale:
        raise ValueError(f"query_pre_attn_scalar {cfg.scale ** -2:g} != head_dim {cfg.head_dim}: a gemma3 GGUF "
                         "cannot state it")
    windows = set(cfg.layer_windows) - {0}
    if not windows:
        return
    if len(windows) != 1:
        raise ValueError(f"sliding windows per layer {cfg.layer_windows}: a gemma3 GGUF holds one")
    if cfg.rope_table(next(i for i, w in enumerate(cfg.layer_windows) if w)) != 1 and (
            cfg.rope_theta != GEMMA3_SLIDING_THETA or cfg.rope_scaling):
        raise ValueError("gemma3 GGUF's sliding layers take rope base 10000, unscaled")
    if cfg.sliding_rope_theta not in (0.0, GEMMA3_SLIDING_THETA):
        raise ValueError(f"sliding rope base {cfg.sliding_rope_theta:g}: a gemma3 GGUF's is 10000")
    writer.add_sliding_window(windows.pop())
    sliding = [bool(w) for w in cfg.layer_windows]
    if sliding != gemma3_sliding(None, cfg.num_layers):
        writer.add_sliding_window_pattern(sliding)


def write_gguf(path: Path, cfg: ModelConfig, w: Weights, tokenizer_gguf: Path, dtype: str) -> None:
    """A GGUF of the model's architecture (llama for Llama and Mistral, qwen2, qwen3, gemma3: f32, f16 or
    q8_0, q4_0, q4_1, q5_0, q5_1 matrices (the gguf package's quantisers; K-quants need llama.cpp's); norms and biases stay f32, as llama.cpp's converter does), tensors named by the
    gguf package's own map (llama.cpp's), with the tokenizer fields copied from `tokenizer_gguf`."""
    import gguf

    arch = GGUF_ARCH.get(cfg.family.name)
    if arch is None:
        raise SystemExit(f"no GGUF architecture holds {cfg.family.name} (written: {', '.join(GGUF_ARCH)})")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else
                         getattr(gguf.LlamaFileType, f"MOSTLY_{dtype.upper()}", gguf.LlamaFileType.ALL_F32))
    src = gguf.GGUFReader(str(tokenizer_gguf))
    f = src.fields
    writer.add_tokenizer_model(f["tokenizer.ggml.model"].contents())
    if "tokenizer.ggml.pre" in f:
        writer.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
    writer.add_token_list(f["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(f["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(f["tokenizer.ggml.merges"].contents())
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("padding_token_id", writer.add_pad_token_id), ("unknown_token_id", writer.add_unk_token_id)):
        if f"tokenizer.ggml.{key}" in f:
            add(int(f[f"tokenizer.ggml.{key}"].contents()))
    if "tokenizer.ggml.add_bos_token" in f:
        writer.add_add_bos_token(bool(f["tokenizer.ggml.add_bos_token"].contents()))
    if "tokenizer.chat_template" in f:
        writer.add_chat_template(f["tokenizer.chat_template"].contents())
    names = [k for k in w if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    quant = getattr(gguf.GGMLQuantizationType, dtype.upper(), None) if dtype.startswith("q") else None

    if arch == "gemma3":
        _gemma3_keys(writer, cfg)
    elif cfg.layer_windows:  # GGUF has one window for every layer (`{arch}.attention.sliding_window`)
        if len(set(cfg.layer_windows)) != 1:
            raise ValueError(f"sliding windows per layer {cfg.layer_windows}: a {arch} GGUF holds one for all layers")
        writer.add_sliding_window(cfg.layer_windows[0])
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling["factor"])
    elif cfg.rope_scaling:  # Llama 3: per-frequency divisors as a tensor, as llama.cpp's converter writes them
        plain = rope_inv_freq(replace(cfg, rope_scaling=None))
        lazy, src = LazyWeights(), w
        for k in src:  # still read one tensor at a time
            lazy.add(k, lambda k=k: src[k], src.shape(k) if isinstance(src, LazyWeights) else src[k].shape)
        factors = (plain / rope_inv_freq(cfg)).astype(np.float32)
        lazy.add("rope_freqs.weight", lambda: factors, factors.shape)
        w, names = lazy, [*names, "rope_freqs.weight"]
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_layers)

    def gguf_name(name: str) -> str:
        return name if name == "rope_freqs.weight" else name_map.get_name(name, try_suffixes=(".weight", ".bias"))

    def gguf_array(name: str) -> np.ndarray:
        arr, kind = w[name], gguf_name(name).split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k") and name.endswith(".weight"):
            arr = permute_qk(arr, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        if quant is not None and arr.ndim == 2:
            return gguf.quants.quantize(np.asarray(arr, np.float32), quant)
        return np.ascontiguousarray(arr, np.float16 if dtype == "f16" and arr.ndim == 2 else np.float32)

    for name in names:  # tensor infos first, from shapes alone; then the data, one tensor at a time
        shape = w.shape(name) if isinstance(w, LazyWeights) else w[name].shape
        if quant is not None and len(shape) == 2:  # the rows' blocks, as bytes
            per, size = gguf.GGML_QUANT_SIZES[quant]
            raw = (shape[0], shape[1] // per * size)
            writer.add_tensor_info(gguf_name(name), raw, np.dtype(np.uint8), raw[0] * raw[1], raw_dtype=quant)
        else:
            item = np.dtype(np.float16 if dtype == "f16" and len(shape) == 2 else np.float32)
            writer.add_tensor_info(gguf_name(name), shape, item, int(np.prod(shape)) * item.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in names:
        writer.write_tensor_data(gguf_array(name))
    writer.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="source", help="a model path our server accepts (default model: smollm2)")
    src.add_argument("--random", action="store_true", help="a random Llama of the shape below")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a named shape instead of the sizes below")
    ap.add_argument("--dtype", choices=sorted(_ST), default="float32", help="the safetensors dtype")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--max-position", type=int, default=2048)
    ap.add_argument("--gguf", default="f32,f16", help="GGUF variants to write (f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1; empty: none)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    tokenizer_gguf = resolve_model("smollm2").path
    if args.shape:
        for key, value in SHAPES[args.shape].items():
            setattr(args, key, value)
    if args.random:
        base, _ = load_model(resolve_model("smollm2"))
        cfg = ModelConfig(vocab_size=base.vocab_size, hidden_size=args.hidden,
                          intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
                          num_kv_heads=args.kv_heads, rms_eps=1e-5, rope_theta=10000.0,
                          tie_word_embeddings=True, max_position=args.max_position,
                          bos_token_id=base.bos_token_id, eos_token_ids=base.eos_token_ids)
        weights = random_llama(cfg, args.seed)
    else:
        files = resolve_model(args.source)
        cfg, weights = load_model(files)
        if files.kind == "gguf":
            tokenizer_gguf = files.path
    write_hf(args.out, cfg, weights, tokenizer_gguf, args.dtype)
    for dtype in filter(None, args.gguf.split(",")):
        write_gguf(args.out / f"model-{dtype}.gguf", cfg, weights, tokenizer_gguf, dtype)
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer = cfg.hidden_size * (qkv + cfg.num_heads * cfg.head_dim + 3 * cfg.intermediate_size)
    n = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * per_layer
    print(f"wrote {args.out}: {n / 1e6:.1f}M parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
