"""PEFT LoRA adapters (a folder with adapter_config.json and adapter_model.safetensors), read and
checked against the base model: every tensor is used or the load is refused by name, and every
config field that changes the math is honoured or refused."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.model_config import ModelConfig
from agent.weights.load import read_safetensors
from common.lora import AdapterError

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields that do not change a trained adapter's forward (training, initialisation,
# where it came from; which modules and layers it targets its tensors say). Any other field must be
# unset (null, false, empty): each names a LoRA variant (DoRA, biases, patterns, ...) not served.
_INERT = {"peft_type", "r", "lora_alpha", "use_rslora", "bias", "target_modules", "exclude_modules",
          "layers_to_transform", "layers_pattern", "task_type", "inference_mode", "init_lora_weights", "lora_dropout",
          "base_model_name_or_path", "revision", "auto_mapping", "peft_version", "loftq_config", "eva_config",
          "corda_config", "lora_ga_config", "megatron_config", "megatron_core", "qalora_group_size",
          "ensure_weight_tying"}

@dataclass
class Adapter:
    """One adapter's matrices: (layer, module) -> (A [r, in], B [out, r] with the scaling folded in)."""
    name: str
    rank: int
    scaling: float
    mats: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.mats.values())


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a base projection."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}[module]


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterError(f"LoRA adapter {folder}: no adapter_config.json (a PEFT LoRA folder is served)")
    c = json.loads(path.read_text())
    if c.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {folder}: peft_type {c['peft_type']!r} is not served (LORA is)")
    for key, value in c.items():
        if key not in _INERT and value:
            raise AdapterError(f"LoRA adapter {folder}: adapter_config.json {key}={value!r} is not served")
    if c.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {folder}: bias={c['bias']!r} is not served (none is)")
    return c


def _tensors(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise AdapterError(f"LoRA adapter {folder}: no adapter_model.safetensors")
    return dict(read_safetensors(path))  # bfloat16 too (numpy has no bfloat16 type)


def read_peft_adapter(name: str, folder: str | Path, cfg: ModelConfig, max_rank: int) -> Adapter:
    """Adapter `name` from a PEFT folder, for base model `cfg`; ranks above `max_rank` refused."""
    folder = Path(folder)
    c = _config(folder)
    r, alpha = int(c.get("r", 8)), float(c.get("lora_alpha", 8))
    if r > max_rank:
        raise AdapterError(f"LoRA adapter {name}: rank {r} is over max_lora_rank {max_rank}")
    scaling = alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, t in _tensors(folder).items():
        m = _TENSOR.match(key)
        if m is None or m.group(3) not in MODULES:
            raise AdapterError(f"LoRA adapter {name}: tensor {key} is not served (LoRA on the decoder layers' "
                               f"{', '.join(MODULES)} is)")
        layer, module = int(m.group(1)), m.group(3)
        if layer >= cfg.num_layers:
            raise AdapterError(f"LoRA adapter {name}: tensor {key} is for layer {layer}; the base has {cfg.num_layers}")
        pairs.setdefault((layer, module), {})[m.group(4)] = np.asarray(t, np.float32)
    out = Adapter(name, r, scaling)
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        n_out, n_in = module_shape(cfg, module)
        a, b = ab["A"], ab["B"]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise AdapterError(f"LoRA adapter {name}: layer {layer} {module} has A {a.shape} and B {b.shape}; the base "
                               f"takes A ({r}, {n_in}) and B ({n_out}, {r}) (another base model?)")
        out.mats[(layer, module)] = (a, b * np.float32(scaling))
    if not out.mats:
        raise AdapterError(f"LoRA adapter {name}: no LoRA tensors in {folder}")
    return out
