"""LoRA adapters on the agent: the PEFT folders (peft.py) or llama.cpp GGUFs (gguf_lora.py) of
serving_config.lora_modules read and checked, each in its slot of the model (agent/model/lora.py)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from agent.lora.gguf_lora import read_gguf_adapter
from agent.lora.peft import Adapter, read_peft_adapter
from agent.model_config import ModelConfig
from common.config import ServingConfig
from common.lora import AdapterError

if TYPE_CHECKING:
    from agent.model.lora import LoraSlots
    from agent.runner import ModelRunner

log = logging.getLogger("llm_serving.agent")
__all__ = ["load_into_slot", "lora_slots", "read_adapter"]


def read_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> Adapter:
    """Adapter `name` for base `cfg` from a llama.cpp LoRA GGUF (a .gguf file) or a PEFT folder; one
    holding NaN or infinities is refused (it loaded, and every request on it then failed)."""
    read = read_gguf_adapter if Path(path).suffix == ".gguf" else read_peft_adapter
    adapter = read(name, path, cfg, max_rank)
    for (layer, module), mats in adapter.mats.items():
        for part, m in zip("AB", mats):
            if not np.isfinite(m).all():
                raise AdapterError(f"LoRA adapter {name}: layer {layer} {module} lora_{part} holds NaN or infinite values")
    return adapter


def lora_slots(cfg: ServingConfig, model_cfg: ModelConfig) -> LoraSlots | None:
    """serving_config.lora_modules in config order, the first max_loras in the slots (slot i holding
    adapter i + 1), the others read and checked only (the server swaps them in when a request wants
    one); the other slots empty (agent.model.lora.LoraSlots; None: no LoRA slots)."""
    from agent.model.lora import LoraSlots  # MindSpore: only once the agent is pinned (agent/main.py)

    if not cfg.lora_enabled:
        return None
    adapters = [read_adapter(name, path, model_cfg, cfg.max_lora_rank) for name, path in cfg.lora_modules.items()]
    return LoraSlots(adapters[:cfg.max_loras], cfg.max_loras, cfg.max_lora_rank)


def load_into_slot(runner: ModelRunner, slot: int, name: str, path: str | None) -> dict[str, int]:
    """The agent's `l` command: adapter `name` from `path` (None: nothing) into LoRA slot `slot` of
    `runner` (agent.runner.ModelRunner), from its next step on; the reply's body."""
    lora = runner.lora
    adapter = None if path is None else read_adapter(name, path, runner.cfg, lora.rank if lora else 0)
    runner.load_adapter(slot, adapter)
    log.info("LoRA slot %d: %s", slot, f"{name} ({path})" if adapter else "empty")
    return {"bytes": adapter.nbytes if adapter else 0}
