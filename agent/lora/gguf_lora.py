"""llama.cpp's LoRA adapters: a GGUF of `general.type: adapter`, `adapter.type: lora` (what its
convert_lora_to_gguf.py writes from a PEFT folder), read as llama.cpp applies them: tensors
`blk.N.<module>.weight.lora_a` [r, in] and `.lora_b` [out, r], each pair scaled by
`adapter.lora.alpha` / r (1 where alpha is 0). Llama's Q/K rows (of lora_b) come permuted for
llama.cpp's interleaved rope, as its base weights do: undone here. Anything else is refused by name."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from agent.lora.peft import Adapter, module_shape
from common.lora import AdapterError
from agent.model_config import ModelConfig
from agent.weights.gguf import read_tensor, unpermute_rows
from common.gguf_file import GgufFile
from common.model_files import GGUF_ARCHITECTURES

_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
            "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
_ADAPTER_KEYS = {"adapter.type", "adapter.lora.alpha"}  # any other adapter.* key is a variant (aLoRA, ...)
# the GGUF architecture a base family's adapters are written as (llama.cpp converts Mistral as llama)
_ARCH = {family: arch for arch, family in GGUF_ARCHITECTURES.items()} | {"mistral": "llama"}


def read_gguf_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> Adapter:
    """Adapter `name` from a llama.cpp LoRA GGUF, for base model `cfg`; ranks above `max_rank` refused."""
    reader = GgufFile(path)
    meta, arch = reader.meta, reader.meta.get("general.architecture")
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"LoRA adapter {name}: {Path(path).name} is not a LoRA adapter GGUF (general.type "
                           f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r})")
    if arch != _ARCH.get(cfg.family.name):
        raise AdapterError(f"LoRA adapter {name}: general.architecture {arch!r}; the base model is "
                           f"{cfg.family.name}, whose adapters are {_ARCH.get(cfg.family.name)!r}")
    for key in meta:
        if key.startswith("adapter.") and key not in _ADAPTER_KEYS:
            raise AdapterError(f"LoRA adapter {name}: GGUF {key} is not served")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        m = _TENSOR.match(t.name)
        if m is None or m.group(2) not in _MODULES:
            raise AdapterError(f"LoRA adapter {name}: tensor {t.name} is not served (lora_a/lora_b of the decoder "
                               f"layers' {', '.join(_MODULES)} are)")
        layer, module = int(m.group(1)), _MODULES[m.group(2)]
        if layer >= cfg.num_layers:
            raise AdapterError(f"LoRA adapter {name}: tensor {t.name} is for layer {layer}; the base has {cfg.num_layers}")
        pairs.setdefault((layer, module), {})[m.group(3)] = read_tensor(t)
    out = Adapter(name, 0, 0.0)
    for (layer, module), ab in sorted(pairs.items()):
        out.mats[(layer, module)] = _pair(name, cfg, layer, module, ab, alpha, max_rank, arch == "llama")
        out.rank = max(out.rank, out.mats[(layer, module)][0].shape[0])
    if not out.mats:
        raise AdapterError(f"LoRA adapter {name}: no LoRA tensors in {path}")
    out.scaling = alpha / out.rank if alpha else 1.0
    return out


def _pair(name: str, cfg: ModelConfig, layer: int, module: str, ab: dict[str, np.ndarray], alpha: float,
          max_rank: int, permuted: bool) -> tuple[np.ndarray, np.ndarray]:
    """(A [r, in], B [out, r] scaled) of one module, checked against the base's shape."""
    if set(ab) != {"a", "b"}:
        raise AdapterError(f"LoRA adapter {name}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
    a, b = ab["a"], ab["b"]
    r = a.shape[0]
    n_out, n_in = module_shape(cfg, module)
    if a.shape != (r, n_in) or b.shape != (n_out, r):
        raise AdapterError(f"LoRA adapter {name}: layer {layer} {module} has lora_a {a.shape} and lora_b {b.shape}; the "
                           f"base takes ({r}, {n_in}) and ({n_out}, {r}) (another base model?)")
    if r > max_rank:
        raise AdapterError(f"LoRA adapter {name}: rank {r} is over max_lora_rank {max_rank}")
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(module) if permuted else None
    if heads:
        b = b[unpermute_rows(n_out, heads)]
    return a, b * np.float32(alpha / r if alpha else 1.0)
