"""Load a model's weights into Hugging Face names as float32 numpy arrays, plus its ModelConfig.

Safetensors and GGUF tensors are read lazily from memory-mapped files (`LazyWeights`): each is
converted to float32 when the model asks for it and dropped once the model has its own copy in its
final dtype, so loading never holds the whole model as float32 (llama2-7B: 27 GB) — peak memory is
the final weights plus about one layer. With ``int8``, GGUF Q8_0 projection tensors come as
agent.model.quant.Int8Rows, never as a float copy; everything else is float32 and the model converts it
at build time. Hugging Face and GGUF files are checked against their family (agent.weights.families): a
tensor nothing reads, or a config value nothing implements, is refused by name."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import yaml

from agent.weights.families import check_tensors, hf_config
from agent.weights.families import UnsupportedModel
from agent.weights.gguf import load_gguf
from agent.weights.lazy import LazyWeights
from agent.model_config import ModelConfig, Weights
from common.model_files import ModelFiles, mindformers_yaml

_MF_LAYER = {
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
}
_MF_TOP = {"model.tok_embeddings.embedding_weight": "model.embed_tokens.weight",
           "model.norm_out.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}


def load_model(files: ModelFiles, max_position: int | None = None, int8: bool = False,
               blocks: bool = False) -> tuple[ModelConfig, Weights]:
    """`int8`: Q8_0 matrices kept as int8 rows; `blocks` (model_dtype gguf): a GGUF file's matrices as stored."""
    if files.kind == "gguf":
        cfg, weights = load_gguf(files, int8, blocks)
    elif blocks:
        raise UnsupportedModel(f"model_dtype gguf serves a GGUF file's quantised blocks as stored; {files.path} is "
                               "not a .gguf (float32, bfloat16, float16 or int8 serve it)")
    else:
        cfg, weights = {"hf": _load_hf, "mindformers": _load_mindformers}[files.kind](files)
    if max_position:
        cfg.max_position = max_position
    return cfg, weights


# ---------------------------------------------------------------- Hugging Face folder
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def read_safetensors(path: Path) -> LazyWeights:
    """Minimal safetensors reader that also handles bf16 (numpy has no bfloat16). Each tensor is read
    with its own pread when asked for (not memory-mapped: mapped file pages count in RSS)."""
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
    out = LazyWeights()
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        out.add(name, lambda info=info: _st_tensor(path, 8 + header_len, info), info["shape"])
    return out


def _st_tensor(path: Path, base: int, info: dict) -> np.ndarray:
    start, end = info["data_offsets"]
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(end - start)
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = os.preadv(fd, [view[got:]], base + start + got)
            if n <= 0:
                raise ValueError(f"{path.name}: truncated tensor data")
            got += n
    finally:
        os.close(fd)
    raw = np.frombuffer(buf, _ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    if info["dtype"] == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw if raw.dtype == np.float32 else raw.astype(np.float32)


def _load_hf(files: ModelFiles) -> tuple[ModelConfig, Weights]:
    cfg = hf_config(json.loads((files.path / "config.json").read_text()))
    weights = LazyWeights()
    shards = sorted(files.path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {files.path}")
    for shard in shards:
        weights.update(read_safetensors(shard))
    check_tensors(cfg, weights, files.path.name)
    offset = cfg.family.norm_offset  # Gemma's norms scale by (1 + w)
    if offset:
        weights.transform(lambda name: name.endswith("norm.weight"), lambda a: a + np.float32(offset))
    return cfg, weights


# ---------------------------------------------------------------- MindFormers checkpoint + yaml
def mindformers_model_config(path: Path) -> dict:
    """`model.model_config` of a MindFormers yaml, its `base_config` chain resolved: by mindformers'
    own MindFormerConfig when the `mindformers` extra is installed, else by the same merge in plain
    YAML (common/model_files.py)."""
    doc = yaml.safe_load(path.read_text()) or {}
    if doc.get("base_config"):
        try:
            from mindformers import MindFormerConfig
        except ImportError:
            doc = mindformers_yaml(path)
        else:
            return dict(MindFormerConfig(str(path)).model.model_config)
    return doc.get("model", {}).get("model_config", doc.get("model_config", doc))


def _load_mindformers(files: ModelFiles) -> tuple[ModelConfig, Weights]:
    import mindspore as ms

    mc = mindformers_model_config(Path(files.cfg_path))
    hidden, heads = mc["hidden_size"], mc["num_heads"]
    # MindSpore reads a checkpoint whole (in its stored dtype); each tensor becomes float32 only when
    # the model asks for it, so loading peaks at the checkpoint plus the final weights, not plus a
    # float32 copy of everything.
    ckpt = ms.load_checkpoint(str(files.path))
    weights = LazyWeights()
    for name, param in ckpt.items():
        parts = name.split(".")  # model.layers.{i}.<key>.weight
        key = ".".join(parts[3:-1])
        if name in _MF_TOP:
            ours = _MF_TOP[name]
        elif parts[:2] == ["model", "layers"] and key in _MF_LAYER:
            ours = f"model.layers.{parts[2]}.{_MF_LAYER[key]}.{parts[-1]}"
        else:
            ours = f"(mindformers) {name}"  # reported by check_tensors as unread
        weights.add(ours, lambda p=param: p.asnumpy().astype(np.float32), tuple(param.shape))
    intermediate = weights.shape("model.layers.0.mlp.gate_proj.weight")[0]
    cfg = ModelConfig(
        vocab_size=mc["vocab_size"], hidden_size=hidden, intermediate_size=intermediate,
        num_layers=mc["num_layers"], num_heads=heads, num_kv_heads=mc.get("n_kv_heads") or heads,
        rms_eps=mc.get("rms_norm_eps", 1e-5), rope_theta=mc.get("theta", 10000.0),
        tie_word_embeddings="lm_head.weight" not in weights,
        max_position=mc.get("seq_length", 4096), bos_token_id=mc.get("bos_token_id", 1),
        eos_token_ids=[mc.get("eos_token_id", 2)])
    check_tensors(cfg, weights, Path(files.path).name)
    return cfg, weights
