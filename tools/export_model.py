"""Write one model in the formats our peers load: a Hugging Face folder (config.json, safetensors,
tokenizer.json; vLLM and transformers) and GGUF files (llama.cpp), from the same float32 weights.

    python tools/export_model.py --from smollm2 --out .peers/models/smollm2
    python tools/export_model.py --random --out .peers/models/llama-768x12   # hidden 768, 12 layers

The tokenizer always comes from the default model's GGUF vocabulary (random models share it), so
every system sees the same token ids.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from agent.model import LlamaConfig  # noqa: E402
from agent.weights import Weights, load_model  # noqa: E402
from common.model_files import resolve_model  # noqa: E402

_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def random_llama(cfg: LlamaConfig, seed: int = 0) -> Weights:
    """Scaled-normal weights (std 0.02, unit norm gains): random, but with sane activations."""
    rng = np.random.default_rng(seed)
    d, hd = cfg.hidden_size, cfg.head_dim
    shapes = {"self_attn.q_proj": (cfg.num_heads * hd, d), "self_attn.k_proj": (cfg.num_kv_heads * hd, d),
              "self_attn.v_proj": (cfg.num_kv_heads * hd, d), "self_attn.o_proj": (d, cfg.num_heads * hd),
              "mlp.gate_proj": (cfg.intermediate_size, d), "mlp.up_proj": (cfg.intermediate_size, d),
              "mlp.down_proj": (d, cfg.intermediate_size)}
    normal = lambda shape: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)  # noqa: E731
    w: Weights = {"model.embed_tokens.weight": normal((cfg.vocab_size, d)),
                  "model.norm.weight": np.ones(d, np.float32)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(d, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(d, np.float32)
        for name, shape in shapes.items():
            w[p + name + ".weight"] = normal(shape)
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = normal((cfg.vocab_size, d))
    return w


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert-time Q/K row order (interleaved rope); agent.weights undoes it."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf(out: Path, cfg: LlamaConfig, w: Weights, tokenizer_gguf: Path) -> None:
    from safetensors.numpy import save_file

    from common.tokenizer import load_tokenizer
    from common.model_files import ModelFiles

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
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
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in w.items()
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = load_tokenizer(ModelFiles("gguf", tokenizer_gguf))
    tok.tok.save(str(out / "tokenizer.json"))
    names = {v: k for k, v in tok.special_tokens.items()}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position,
        "bos_token": names.get(tok.bos_token_id), "eos_token": names.get(tok.eos_token_ids[0]),
        "add_bos_token": tok.add_bos, "chat_template": tok.chat_template}, indent=1))


def write_gguf(path: Path, cfg: LlamaConfig, w: Weights, tokenizer_gguf: Path, dtype: str) -> None:
    """A llama-architecture GGUF (f32, f16 or q8_0 matrices; norms stay f32, as llama.cpp's
    converter does), with the tokenizer fields copied from `tokenizer_gguf`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
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
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(
        dtype, gguf.LlamaFileType.ALL_F32))
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
    for name, arr in w.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name in _GGUF_TOP:
            gname = _GGUF_TOP[name]
        else:
            _, _, i, *mid, _ = name.split(".")
            kind = _GGUF_NAMES[".".join(mid)]
            gname = f"blk.{i}.{kind}.weight"
            if kind == "attn_q":
                arr = permute_qk(arr, cfg.num_heads)
            elif kind == "attn_k":
                arr = permute_qk(arr, cfg.num_kv_heads)
        if dtype == "q8_0" and arr.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gname, gguf.quants.quantize(np.asarray(arr, np.float32), q8), raw_dtype=q8)
            continue
        half = dtype == "f16" and arr.ndim == 2
        writer.add_tensor(gname, np.ascontiguousarray(arr, np.float16 if half else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="source", help="a model path our server accepts (default model: smollm2)")
    src.add_argument("--random", action="store_true", help="a random Llama of the shape below")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--max-position", type=int, default=2048)
    ap.add_argument("--gguf", default="f32,f16", help="GGUF variants to write (f32, f16, q8_0; empty: none)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    tokenizer_gguf = resolve_model("smollm2").path
    if args.random:
        base, _ = load_model(resolve_model("smollm2"))
        cfg = LlamaConfig(vocab_size=base.vocab_size, hidden_size=args.hidden,
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
    write_hf(args.out, cfg, weights, tokenizer_gguf)
    for dtype in filter(None, args.gguf.split(",")):
        write_gguf(args.out / f"model-{dtype}.gguf", cfg, weights, tokenizer_gguf, dtype)
    n = sum(v.size for k, v in weights.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight"))
    print(f"wrote {args.out}: {n / 1e6:.1f}M parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
