"""One agent's model, loaded: its weights, its runner (this rank's share), every graph built, and the
AgentInfo it attaches with. Imported once the process is pinned and its ISA capped: it loads MindSpore."""
from __future__ import annotations

import logging
import time
from typing import Any

from agent.graph_call import device_free_memory, setup_mindspore
from agent.lora import lora_slots
from agent.model.calibrate import CALIBRATION_TEXT
from agent.model_config import ModelConfig
from agent.runner import ModelRunner
from agent.runner_config import RunnerConfig, compile_cache_key
from agent.speculative import load_proposer
from agent.speculative.draft_load import draft_key
from agent.tensor_parallel import Group
from agent.weights.load import load_model
from common.config import ConfigError, ServingConfig
from common.cpu import describe
from common.grammar import ll_tokenizer
from common.lora import AdapterError
from common.memory import ModelShape, activation_bytes, kv_head_bytes, plan as memory_plan
from common.model_files import ModelFiles, model_identity, resolve_model
from common.tokenizer import load_tokenizer
from shm.messages import AgentInfo

# quant_group_size's special values, as the load line names them
GROUP_WORDS = {0: "8th of a row and token", -1: "output channel and token (down projection: groups)"}

log = logging.getLogger("llm_serving.agent")


def load_runner(cfg: ServingConfig, index: int, owner_pid: int | None,
                tp_link: str | None) -> tuple[ModelRunner, AgentInfo]:
    """Agent `index`'s runner, loaded and warmed up, and what it tells an attaching server; refuses
    (ConfigError) a model its device cannot hold, before the model takes any of its memory."""
    t0 = time.monotonic()
    files = resolve_model(cfg.model_path, cfg.model_cfg_path)
    if not cfg.num_blocks:  # num_blocks: auto and no launcher sized it (an agent started by itself)
        log.info("memory plan:\n%s", memory_plan(cfg, files, 1).describe())
    int8 = cfg.model_dtype == "int8"
    model_cfg, weights = load_model(files, cfg.max_model_len, int8=int8, blocks=cfg.model_dtype == "gguf")
    log.info("weights loaded in %.1fs from %s (%d layers, hidden %d, vocab %d)", time.monotonic() - t0, files.path,
             model_cfg.num_layers, model_cfg.hidden_size, model_cfg.vocab_size)
    tp = cfg.tensor_parallel_size
    rc = RunnerConfig.from_serving(cfg, Group.from_link(tp_link, index, tp, model_cfg.hidden_size, model_cfg.vocab_size,
                                                        cfg.token_buckets[-1], cfg.max_rows))
    # The on-disk cache is only sound for warm-up's fixed compile order (see freeze_compile_cache).
    key = compile_cache_key(model_cfg, rc, draft_key(cfg))
    device = setup_mindspore(cfg.compile_cache_dir if cfg.warmup else None, key=key, device_id=cfg.start_device_id + index)
    free = device_free_memory(device[1])
    refusal = memory_plan(cfg, files, 1, device_free=free).refusal() if free is not None else None
    if refusal:
        raise ConfigError(refusal)
    tok = load_tokenizer(files, cfg.tokenizer_path)
    try:
        lora = lora_slots(cfg, model_cfg)
    except AdapterError as exc:
        raise ConfigError(str(exc)) from None
    # The ranks of a group sample alike: one seed per replica.
    runner = ModelRunner(model_cfg, weights, rc, seed=index // tp,
                         calibration=tok.encode(CALIBRATION_TEXT) if int8 else None,
                         grammar_tokenizer=ll_tokenizer(tok, model_cfg.vocab_size),
                         proposer=load_proposer(cfg, rc, model_cfg.vocab_size, tok), lora=lora)
    del weights
    log.info("model weights in memory: %.0f MiB (%s%s) on %s:%d (as MindSpore reports it)",
             runner.model.weight_bytes / 2**20, cfg.model_dtype,
             f", int8 scale per {GROUP_WORDS.get(rc.int8_group, rc.int8_group)}" if int8 else "", *device)
    log.info("CPU: %s; kernels: %s", describe(), runner.kernel_paths)
    if lora is not None:
        held = [f"{a.name} (rank {a.rank}, {a.nbytes / 2**20:.1f} MiB)" for a in lora.adapters if a is not None]
        log.info("LoRA: %d slots of rank %d; at start: %s", lora.slots, lora.rank, ", ".join(held) or "none")
    if cfg.warmup:
        runner.warmup()
    log.info("model loaded and compiled in %.1fs (%d graphs)", time.monotonic() - t0, runner.graph_compiles)
    return runner, _agent_info(cfg, files, model_cfg, runner, device, owner_pid)


def _agent_info(cfg: ServingConfig, files: ModelFiles, model_cfg: ModelConfig, runner: ModelRunner,
                device: tuple[str, int], owner_pid: int | None) -> AgentInfo:
    m = runner.model
    return AgentInfo(model_cfg.vocab_size, list(model_cfg.eos_token_ids), cfg.geometry,
                     model_identity(cfg.model_name, files, cfg.lora_modules), *device, cfg.model_dtype,
                     m.weight_bytes, m.streamed_bytes, m.kv_cache_bytes, runner.kv_dtype,
                     activation_estimate(model_cfg, cfg), runner.kernel_paths,
                     launcher_pid=owner_pid,  # a server attached to us sees whether anyone will restart us
                     tp_rank=runner.rc.tp.rank, tp_size=runner.rc.tp.size, pads_cost=not m.one_op_stack,
                     planned_bytes=memory_plan(cfg, files, 1).per_agent if cfg.device == "CPU" else 0,
                     speculative=runner.speculator.method if runner.speculator is not None else "",
                     adapters=tuple(cfg.lora_modules)[:cfg.max_loras], kv_layout=kv_layout(cfg, model_cfg, runner.kv_dtype))


def kv_layout(cfg: ServingConfig, m: ModelConfig, kv_dtype: str) -> dict[str, Any]:
    """This agent's KV cache as a hand-over moves it (shm.protocol.KV_LAYOUT_KEYS)."""
    return {"dtype": kv_dtype, "block_size": cfg.block_size, "layers": m.num_layers, "kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "head_bytes": kv_head_bytes(m.head_dim, kv_dtype)}


def activation_estimate(model_cfg: ModelConfig, cfg: ServingConfig) -> int:
    """The memory plan's activation bytes for this model and the largest step (common/memory.py)."""
    m = model_cfg
    shape = ModelShape(m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads,
                       m.head_dim)
    return activation_bytes(shape, cfg.token_buckets[-1], cfg.max_rows)
