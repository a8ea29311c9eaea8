"""The model families the agent serves, as small descriptions, and the reading of a Hugging Face
config.json in either layout transformers writes (4.x: top-level `rope_theta` / `rope_scaling`,
`use_sliding_window`; 5.x: `rope_parameters`, `layer_types`). Whatever would change the math and is
not implemented is refused at load by name, in one line; so is a tensor in the file that nothing
reads."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agent.model_config import Family, ModelConfig
from common.model_files import MODEL_TYPES, unsupported_family


GEMMA3 = Family("gemma3_text", qk_norm=True, sandwich_norms=True, activation="gelu_tanh", norm_offset=1.0,
                embed_scale=True, tied_by_default=True)
FAMILIES = {f.name: f for f in (Family("llama"), Family("mistral"), Family("ministral"), Family("qwen2", qkv_bias=True),
                                 Family("qwen3", qk_norm=True), GEMMA3)}
assert tuple(FAMILIES) == MODEL_TYPES, "common.model_files.MODEL_TYPES names the families described here"
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> ours
ROPE_TYPES = ("default", "linear", "llama3")
# Fields whose non-default value changes the math in a way no family here implements.
_REFUSED = {"attention_bias": False, "mlp_bias": False, "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "partial_rotary_factor": 1.0, "quantization_config": None,
            "use_bidirectional_attention": False}
# Buffers some checkpoints carry that are derived from the config.
_DERIVED = ("rotary_emb.inv_freq",)


class UnsupportedModel(ValueError):
    """A model, config value or tensor this agent would serve wrong: refused by name."""


def hf_config(c: dict[str, Any]) -> ModelConfig:
    """Our config from a transformers config.json, either layout; refuses what it cannot serve."""
    kind = c.get("model_type", "llama")
    if why := unsupported_family(kind):
        raise UnsupportedModel(why)
    for key, default in _REFUSED.items():
        if c.get(key) is not None and c[key] != default:
            raise UnsupportedModel(f"{kind}: {key}={c[key]!r} is not supported (only {default!r})")
    family = FAMILIES[kind]
    key = "hidden_activation" if c.get("hidden_activation") else "hidden_act"
    act = c.get(key) or "silu"
    if ACTIVATIONS.get(act) != family.activation:
        only = next(k for k, v in ACTIVATIONS.items() if v == family.activation)
        raise UnsupportedModel(f"{kind}: {key}={act!r} is not supported (only {only!r})")
    windows = _layer_windows(c)
    theta, scaling, sliding_theta = _rope(c, windows)
    eos = c.get("eos_token_id", 2)
    return ModelConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], head_dim=c.get("head_dim") or 0,
        rms_eps=c.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=c.get("tie_word_embeddings", family.tied_by_default), max_position=c.get("max_position_embeddings", 4096),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=list(eos) if isinstance(eos, list) else [eos],
        layer_windows=windows, sliding_rope_theta=sliding_theta, attn_scale=_attn_scale(c), family=family)


def _attn_scale(c: dict[str, Any]) -> float:
    """Gemma's `query_pre_attn_scalar` ** -0.5 (0: the usual head_dim ** -0.5)."""
    scalar = c.get("query_pre_attn_scalar")
    return float(scalar) ** -0.5 if scalar else 0.0


def _rope(c: dict[str, Any], windows: tuple[int, ...]) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling, the sliding layers' own theta or 0) from 5.x `rope_parameters` (one, or one per
    layer type) or 4.x `rope_theta` + `rope_scaling` (+ Gemma's `rope_local_base_freq` for sliding layers)."""
    params = c.get("rope_parameters")
    sliding_theta = float(c.get("rope_local_base_freq") or 0.0)
    if params is not None and any(isinstance(v, dict) for v in params.values()):
        per_type = dict(params)
        params = per_type.pop("full_attention", None)
        local = per_type.pop("sliding_attention", None)
        if params is None or per_type:
            raise UnsupportedModel(f"rope_parameters per layer type ({', '.join(c['rope_parameters'])}) are "
                                   "supported for full_attention and sliding_attention layers only")
        if local is not None and any(windows):
            theta, scaling = _one_rope(local, c)
            if scaling is not None:
                raise UnsupportedModel(f"sliding_attention rope type {scaling['rope_type']!r} is not supported "
                                       "(only default)")
            sliding_theta = theta
    theta, scaling = _one_rope(params or c.get("rope_scaling") or {}, c)
    own = sliding_theta and any(windows) and (sliding_theta != theta or scaling is not None)
    return theta, scaling, (sliding_theta if own else 0.0)


def _one_rope(params: dict[str, Any], c: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    rope = dict(params)
    theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
    return theta, (dict(rope, rope_type=kind) if kind != "default" else None)


def _layer_windows(c: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window (0: none): 5.x `layer_types`; else Mistral's on every layer, Qwen2/3's
    (`use_sliding_window`) on layers from `max_window_layers` on, as transformers 4.x reads them."""
    n, window = c["num_hidden_layers"], c.get("sliding_window") or 0
    types = c.get("layer_types")
    if types is not None:
        if len(types) != n or any(t not in ("full_attention", "sliding_attention") for t in types):
            raise UnsupportedModel(f"layer_types {sorted(set(types))} are not supported (full_attention, "
                                   "sliding_attention, one per layer)")
        sliding = [t == "sliding_attention" for t in types]
    elif c.get("model_type") == "mistral":
        sliding = [True] * n
    elif c.get("sliding_window_pattern"):  # Gemma 3 before layer_types: every pattern-th layer is global
        sliding = [(i + 1) % c["sliding_window_pattern"] != 0 for i in range(n)]
    else:
        first = c.get("max_window_layers", n) if c.get("use_sliding_window") else n
        sliding = [i >= first for i in range(n)]
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()


def expected_tensors(cfg: ModelConfig) -> tuple[set[str], set[str]]:
    """(the tensors the model reads, those it may find and ignore: the tied LM head, derived buffers)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {p + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                               "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        if cfg.family.sandwich_norms:
            names |= {p + n + ".weight" for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")}
        if cfg.family.qkv_bias:
            names |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}
        if cfg.family.qk_norm:
            names |= {p + f"self_attn.{n}_norm.weight" for n in "qk"}
    return names, optional


def check_tensors(cfg: ModelConfig, found: Iterable[str], where: str) -> None:
    """Every tensor the model needs is in the file and every tensor in the file is read."""
    need, optional = expected_tensors(cfg)
    found = {n for n in found if not n.endswith(_DERIVED)}
    missing, unread = sorted(need - found), sorted(found - need - optional)
    if missing:
        raise UnsupportedModel(f"{where}: {cfg.family.name} needs tensors the file lacks: {_few(missing)}")
    if unread:
        raise UnsupportedModel(f"{where}: tensors no {cfg.family.name} layer reads (refused rather than ignored): "
                               f"{_few(unread)}")


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
