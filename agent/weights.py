"""Load Llama weights into Hugging Face names as float32 numpy arrays, plus the LlamaConfig.

Safetensors and GGUF tensors are read lazily from memory-mapped files (`LazyWeights`): each is
converted to float32 when the model asks for it and dropped once the model has its own copy in its
final dtype, so loading never holds the whole model as float32 (llama2-7B: 27 GB) — peak memory is
the final weights plus about one layer. With ``int8``, GGUF Q8_0 projection tensors come as
agent.quant.Int8Rows, never as a float copy; everything else is float32 and the model converts it
at build time."""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from agent.model import LlamaConfig
from agent.quant import from_q8_0
from common.model_files import ModelFiles, mindformers_yaml

Weights = Mapping[str, Any]  # float32 arrays; Int8Rows for Q8_0 projections loaded with int8=True


class LazyWeights(Mapping):
    """Tensors by name, each read and converted when asked for (and again if asked again: nothing
    is cached, so a consumer's last reference frees it)."""

    def __init__(self) -> None:
        self._get: dict[str, Callable[[], Any]] = {}
        self._shape: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, get: Callable[[], Any], shape: tuple[int, ...] | None = None) -> None:
        self._get[name] = get
        if shape is not None:
            self._shape[name] = tuple(shape)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without reading it where the source said it."""
        return self._shape[name] if name in self._shape else tuple(self[name].shape)

    def update(self, other: "LazyWeights") -> None:
        self._get.update(other._get)
        self._shape.update(other._shape)

    def __getitem__(self, name: str) -> Any:
        return self._get[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._get)

    def __len__(self) -> int:
        return len(self._get)

_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_MF_LAYER = {
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
}
_MF_TOP = {"model.tok_embeddings.embedding_weight": "model.embed_tokens.weight",
           "model.norm_out.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}


def load_model(files: ModelFiles, max_position: int | None = None, int8: bool = False) -> tuple[LlamaConfig, Weights]:
    if files.kind == "gguf":
        cfg, weights = _load_gguf(files, int8)
    else:
        cfg, weights = {"hf": _load_hf, "mindformers": _load_mindformers}[files.kind](files)
    if max_position:
        cfg.max_position = max_position
    return cfg, weights


# ---------------------------------------------------------------- GGUF (llama.cpp)
def _unpermute(rows: int, n_heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's convert-time Q/K row permutation (interleaved -> rotate-half rope)."""
    return np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(rows)


def _gguf_tensor(t: Any, int8: bool) -> Any:
    """A GGUF tensor as float32 [rows, cols] (numpy order), or Int8Rows for a Q8_0 matrix when int8."""
    import gguf

    shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims fastest-first
    if int8 and t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and len(shape) == 2:
        blocks = np.asarray(t.data, np.uint8).reshape(shape[0], -1, 34)  # per 32 values: f16 scale, 32 x int8
        d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(shape)
        return from_q8_0(q, d)
    # a copy even for F32 (a view would map the file pages back in after _drop_pages)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)


def _load_gguf(files: ModelFiles, int8: bool = False) -> tuple[LlamaConfig, Weights]:
    import gguf

    reader = gguf.GGUFReader(str(files.path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    names = {t.name for t in reader.tensors}
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    cfg = LlamaConfig(
        vocab_size=int(meta.get("llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)),
        hidden_size=meta["llama.embedding_length"], intermediate_size=meta["llama.feed_forward_length"],
        num_layers=meta["llama.block_count"], num_heads=heads, num_kv_heads=kv_heads,
        rms_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get("llama.rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in names,
        max_position=meta.get("llama.context_length", 4096),
        bos_token_id=bos.contents() if bos else None, eos_token_ids=[int(eos)])
    reader.fields.clear()  # the tokenizer's ~100k parsed entries (~150 MB for SmolLM2's); read elsewhere
    weights = LazyWeights()
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            rows = {"attn_q": heads, "attn_k": kv_heads}.get(kind)
            weights.add(f"model.layers.{parts[1]}.{_GGUF_LAYER[kind]}.{parts[3]}",
                        lambda t=t, rows=rows: _gguf_unpermuted(reader, t, int8, rows))
        elif parts[0] in _GGUF_TOP:
            weights.add(f"{_GGUF_TOP[parts[0]]}.{parts[1]}", lambda t=t: _gguf_unpermuted(reader, t, int8, None))
    return cfg, weights


def _gguf_unpermuted(reader: Any, t: Any, int8: bool, heads: int | None) -> Any:
    arr = _gguf_tensor(t, int8)
    _drop_pages(reader, t)
    return arr if heads is None else arr[_unpermute(arr.shape[0], heads)]


def _drop_pages(reader: Any, t: Any) -> None:
    """Unmap a tensor's file pages from this process once read: mapped file pages count in its RSS
    (they stay in the page cache), and a whole model's would make loading peak at twice its size."""
    start = t.data_offset - t.data_offset % mmap.PAGESIZE
    try:
        reader.data._mmap.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)
    except (AttributeError, OSError, ValueError):  # another numpy or OS: the pages just stay mapped
        pass


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


def _load_hf(files: ModelFiles) -> tuple[LlamaConfig, Weights]:
    c = json.loads((files.path / "config.json").read_text())
    if c.get("model_type", "llama") not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"unsupported model_type {c.get('model_type')!r}")
    eos = c.get("eos_token_id", 2)
    cfg = LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]), head_dim=c.get("head_dim", 0),
        rms_eps=c.get("rms_norm_eps", 1e-6), rope_theta=c.get("rope_theta", 10000.0),
        rope_scaling=c.get("rope_scaling"), tie_word_embeddings=c.get("tie_word_embeddings", False),
        max_position=c.get("max_position_embeddings", 4096), bos_token_id=c.get("bos_token_id"),
        eos_token_ids=list(eos) if isinstance(eos, list) else [eos])
    weights = LazyWeights()
    shards = sorted(files.path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {files.path}")
    for shard in shards:
        weights.update(read_safetensors(shard))
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


def _load_mindformers(files: ModelFiles) -> tuple[LlamaConfig, Weights]:
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
            continue
        weights.add(ours, lambda p=param: p.asnumpy().astype(np.float32), tuple(param.shape))
    intermediate = weights.shape("model.layers.0.mlp.gate_proj.weight")[0]
    cfg = LlamaConfig(
        vocab_size=mc["vocab_size"], hidden_size=hidden, intermediate_size=intermediate,
        num_layers=mc["num_layers"], num_heads=heads, num_kv_heads=mc.get("n_kv_heads") or heads,
        rms_eps=mc.get("rms_norm_eps", 1e-5), rope_theta=mc.get("theta", 10000.0),
        tie_word_embeddings="lm_head.weight" not in weights,
        max_position=mc.get("seq_length", 4096), bos_token_id=mc.get("bos_token_id", 1),
        eos_token_ids=[mc.get("eos_token_id", 2)])
    return cfg, weights
