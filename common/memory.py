"""How much memory a config needs, known before anything loads: weights in their dtype, the KV
pool, a step's activations and the runtime, per agent, against what the host has. `pa_config.
num_blocks: auto` sizes the pool from `serving_config.kv_cache_memory` (vLLM's KV-space idea) or
from the memory left. Pure Python (the server uses it; it never imports MindSpore).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.config import ConfigError, ServingConfig
from common.model_files import ModelFiles, mindformers_yaml, resolve_model, unsupported_family
from common.speculative import draft_method

GiB = 1 << 30
AUTO_KV_SHARE = 0.9  # of the memory left after weights, activations and runtime, with num_blocks: auto


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_position: int = 4096
    stored_bytes: int = 0  # a GGUF file's tensors as stored (model_dtype gguf holds them so)

    def rank(self, tp: int) -> "ModelShape":
        """One tensor-parallel rank's share (agent/tensor_parallel.py): its heads, KV heads (at least
        one), FFN columns; the vocabulary stays whole here (the embedding is), `weight_bytes` splits
        the LM head."""
        return replace(self, heads=self.heads // tp, kv_heads=max(1, self.kv_heads // tp), inter=self.inter // tp)


def model_shape(files: ModelFiles) -> ModelShape:
    """The model's dimensions from its config alone (config.json, GGUF metadata, MindFormers yaml)."""
    if files.kind == "hf":
        c = json.loads((files.path / "config.json").read_text())
        if why := unsupported_family(c.get("model_type", "llama")):
            raise ConfigError(why)
        heads = c["num_attention_heads"]
        return ModelShape(c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], heads,
                          c.get("num_key_value_heads", heads), c.get("head_dim") or c["hidden_size"] // heads,
                          c.get("max_position_embeddings", 4096))
    if files.kind == "gguf":
        return _gguf_shape(files.path)
    mc = mindformers_yaml(Path(files.cfg_path)) if files.cfg_path else {}
    mc = mc.get("model", {}).get("model_config", mc.get("model_config", mc))
    hidden, heads = mc["hidden_size"], mc["num_heads"]
    inter = mc.get("intermediate_size") or _llama_ffn(hidden, mc.get("multiple_of", 256), mc.get("ffn_dim_multiplier"))
    return ModelShape(mc["vocab_size"], hidden, inter, mc["num_layers"], heads, mc.get("n_kv_heads") or heads,
                      hidden // heads, mc.get("seq_length", 4096))


def _llama_ffn(hidden: int, multiple_of: int, multiplier: float | None) -> int:
    """Llama's FFN width when a MindFormers yaml does not state it (4096 -> 11008)."""
    inner = int(2 * 4 * hidden / 3)
    if multiplier:
        inner = int(multiplier * inner)
    return multiple_of * -(-inner // multiple_of)


def _gguf_shape(path: Path) -> ModelShape:
    from common.gguf_file import GgufFile

    file = GgufFile(path)
    f = file.meta
    arch = f["general.architecture"]
    if why := unsupported_family(arch, gguf=True):
        raise ConfigError(why)

    def get(key: str, default: Any = None) -> Any:
        return f.get(f"{arch}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    vocab = get("vocab_size") or len(f["tokenizer.ggml.tokens"])
    return ModelShape(vocab, hidden, get("feed_forward_length"), get("block_count"), heads,
                      get("attention.head_count_kv", heads), get("attention.key_length") or hidden // heads,
                      get("context_length", 4096), sum(t.n_bytes for t in file.tensors))


def kv_dtype_for(kv_cache_dtype: str, model_dtype: str, native: bool = True) -> str:
    """The KV cache's dtype: `auto` is the weights' 16-bit dtype (bfloat16, float16); int8 with int8
    weights; else float32. bfloat16 and int8 caches need the native kernels (the plain path keeps
    float32, or float16 beside float16 weights; asked for otherwise, agent.model.backend refuses them).

    int8 weights: a many-row decode step reads the whole cache (at a few hundred keys of context,
    several times the weights' bytes), and paged attention's time follows its bytes: the smallest
    cache is the fastest, at a perplexity cost within the int8 weights' own (docs/benchmarks.md,
    "Accuracy by dtype")."""
    if not native and kv_cache_dtype == "auto":  # the plain path: float16 weights keep a float16 cache
        return "float16" if model_dtype == "float16" else "float32"
    if kv_cache_dtype == "auto":
        return {"bfloat16": "bfloat16", "float16": "float16", "int8": "int8", "gguf": "bfloat16"}.get(model_dtype, "float32")
    return kv_cache_dtype


def weight_bytes(s: ModelShape, dtype: str, tp: int = 1) -> int:
    """The weights as agent.model.norms stores them (one copy each, on every path): projections and LM
    head in `dtype` (int8: plus a float32 scale per 64 inputs; float formats: each width padded to
    the kernels' 64-column blocks), the embedding and rope tables in float32; gguf: the file's tensors
    as stored, a float32 factor per output row, and the rope tables."""
    rope = 2 * s.max_position * s.head_dim * 4
    if dtype == "gguf":
        rows = s.layers * (s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim + 2 * s.inter + 2 * s.hidden) + s.vocab
        return s.stored_bytes + 4 * rows + rope
    per = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0 + 4 / 64}[dtype]
    pad = (lambda n: n) if dtype == "int8" else (lambda n: -(-n // 64) * 64)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = s.hidden * (pad(q + 2 * kv) + pad(2 * s.inter)) + (q + s.inter) * pad(s.hidden)
    head = s.hidden * pad(-(-s.vocab // tp))  # a rank's vocabulary shard
    return int((s.layers * layer + head) * per + s.vocab * s.hidden * 4 + rope)


def lora_bytes(s: ModelShape, slots: int, rank: int, dtype: str) -> int:
    """LoRA's share of the weights (agent/model/lora.py): per projection kind, every slot's A rows
    in the projection's `dtype` (padded to 64-row blocks; int8: float32 beside it, unpadded), and
    its `rank` B rows in float32."""
    per = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    pad = (lambda n: n) if dtype == "int8" else (lambda n: -(-n // 64) * 64)
    q, kv, h, i = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.inter
    total = 0
    for modules, n_in, n_out in ((3, h, q + 2 * kv), (1, q, h), (2, h, 2 * i), (1, i, h)):
        total += pad(slots * rank * modules) * n_in * per + slots * rank * n_out * 4
    return s.layers * total


def kv_head_bytes(head_dim: int, dtype: str) -> int:
    """One head's key (or value) of one token in the cache: int8 values carry a float32 scale."""
    return {"float32": 4 * head_dim, "int8": head_dim + 4}.get(dtype, 2 * head_dim)


def kv_block_bytes(s: ModelShape, block_size: int, dtype: str = "float32") -> int:
    """One KV block over all layers: K and V in the cache's dtype."""
    return 2 * s.layers * s.kv_heads * kv_head_bytes(s.head_dim, dtype) * block_size


def activation_bytes(s: ModelShape, tokens: int, logit_rows: int) -> int:
    """A step's live tensors at its largest token bucket: residual, norm, Q|K|V, attention output
    and gate|up of one layer at a time (MindSpore frees each layer's as the next runs), and the
    logits; doubled for the buffers MindSpore keeps between ops."""
    per_token = 3 * s.hidden + (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim + 3 * s.inter
    return 2 * 4 * (tokens * per_token + 2 * logit_rows * s.vocab)


def available_bytes() -> int | None:
    """Memory the host can still give (MemAvailable), or None where it cannot be read."""
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass
class MemoryPlan:
    """Bytes per agent, and what `agents` of them on this host need against what it has."""

    weights: int
    kv: int
    activations: int
    runtime: int
    agents: int
    available: int | None
    num_blocks: int
    device: str = "CPU"
    kv_dtype: str = "float32"
    dtype: str = "float32"  # the weights'
    draft: int = 0  # speculative self_int8 / draft: the draft model's weights and its KV cache

    @property
    def per_agent(self) -> int:
        return self.weights + self.kv + self.activations + self.runtime + self.draft

    @property
    def total(self) -> int:
        return self.per_agent * self.agents

    def refusal(self) -> str | None:
        """Why this cannot fit, in one line, or None (also None where the memory is unknown). On a
        device (Ascend, GPU) each agent has its own: one agent's need against one device's memory."""
        if self.available is None:
            return None
        if self.device != "CPU":
            return None if self.per_agent <= self.available else (
                f"one agent needs {gib(self.per_agent)} of {self.device} memory (weights {gib(self.weights)} in "
                f"{self.dtype}, KV cache {gib(self.kv)} ({self.num_blocks} {self.kv_dtype} blocks), activations "
                f"{gib(self.activations)}, runtime {gib(self.runtime)}) and a device has {gib(self.available)}: "
                f"{gib(self.per_agent - self.available)} short; use model_dtype float16, fewer pa_config.num_blocks "
                "(or num_blocks: auto), or tensor_parallel_size > 1")
        if self.total <= self.available:
            return None
        return (f"the config needs {gib(self.total)} ({self.agents} agent(s) x {gib(self.per_agent)}: weights "
                f"{gib(self.weights)}, KV cache {gib(self.kv)} ({self.num_blocks} {self.kv_dtype} blocks), activations "
                f"{gib(self.activations)}, runtime {gib(self.runtime)}) and this host has {gib(self.available)} "
                "available: use model_dtype bfloat16 or int8, kv_cache_dtype int8, fewer pa_config.num_blocks (or "
                "num_blocks: auto), or fewer agents")

    def describe(self) -> str:
        if self.device != "CPU":
            where = (f"{self.device} memory: {gib(self.available)} a device" if self.available is not None else
                     f"{self.device} memory: unknown here (serving_config.device_memory); each agent checks its device's")
        else:
            where = "available: unknown" if self.available is None else f"available: {gib(self.available)}"
        return "\n".join([
            f"per agent: {gib(self.per_agent)}",
            f"  weights      {gib(self.weights)} ({self.dtype})",
            f"  KV cache     {gib(self.kv)} ({self.num_blocks} {self.kv_dtype} blocks)",
            f"  activations  {gib(self.activations)} (largest step)",
            f"  runtime      {gib(self.runtime)}",
            *([f"  draft model  {gib(self.draft)} (weights and KV cache)"] if self.draft else []),
            (f"agents on this host: {self.agents}; total {gib(self.total)}; {where}" if self.device == "CPU" else
             f"agents: {self.agents}, one a device; {where}"),
            "fits" if self.refusal() is None else f"does not fit: {self.refusal()}"])


def auto_blocks(cfg: ServingConfig, shape: ModelShape, agents: int, fixed: int, available: int | None,
                draft_block: int = 0) -> int:
    """`num_blocks: auto`: `kv_cache_memory` bytes of blocks when set; else AUTO_KV_SHARE of what is
    left per agent after `fixed` (weights, activations, runtime) on the host, or on each device
    (serving_config.device_memory), capped at every running sequence at full length; where the
    memory is unknown, that cap. A block costs the draft model's too (`draft_block`)."""
    per_block = kv_block_bytes(shape, cfg.block_size, kv_dtype_for(cfg.kv_cache_dtype, cfg.model_dtype, cfg.device == "CPU"))
    per_block += draft_block
    want = cfg.max_running * cfg.max_blocks_per_seq + 1
    if cfg.kv_cache_memory:
        budget = cfg.kv_cache_memory
    elif available is None:
        budget = want * per_block
    else:  # a device is each agent's own; the host's memory is shared by its agents
        share = available if cfg.device != "CPU" else available / max(agents, 1)
        budget = min(want * per_block, int(AUTO_KV_SHARE * (share - fixed)))
    blocks = int(max(budget, 0) // per_block)
    need = cfg.max_blocks_per_seq + 1
    if blocks < need:
        raise ConfigError(f"pa_config.num_blocks auto: {gib(max(budget, 0))} of KV space holds {blocks} blocks of "
                          f"{per_block >> 10} KiB; one sequence of decode_seq_length {cfg.max_model_len} needs {need} "
                          f"({gib(need * per_block)}): set serving_config.kv_cache_memory, or use less memory elsewhere")
    return blocks


def draft_files(cfg: ServingConfig, files: ModelFiles) -> tuple[ModelFiles, ModelShape]:
    """The draft model's files and shape (`files`: the target's, for a method drafting with the served
    weights); a draft_model_path that is missing or not a model served here is a ConfigError naming the key."""
    if draft_method(cfg).own_weights:
        return files, model_shape(files)
    try:
        draft = resolve_model(cfg.spec_draft_model, None)
        return draft, model_shape(draft)
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"speculative_config.draft_model_path {cfg.spec_draft_model}: {exc}") from None


def draft_costs(cfg: ServingConfig, files: ModelFiles) -> tuple[int, int]:
    """The draft model's weight bytes and KV bytes per target block (0, 0 without one): its cache has
    the target's num_blocks (agent/speculative/draft_model.py)."""
    m = draft_method(cfg)
    if m is None:
        return 0, 0
    shape = draft_files(cfg, files)[1]
    dtype = m.draft_dtype(cfg)
    kv = kv_block_bytes(shape, cfg.block_size, kv_dtype_for(cfg.kv_cache_dtype, dtype, cfg.device == "CPU"))
    return weight_bytes(shape, dtype), kv


def plan(cfg: ServingConfig, files: ModelFiles, agents: int, device_free: int | None = None) -> MemoryPlan:
    """The memory plan of `cfg` with `agents` agents on this host (or on a device each: against
    serving_config.device_memory, or `device_free` as an agent's runtime reports it); resolves
    `num_blocks: auto` (0) into cfg.num_blocks."""
    tp = getattr(cfg, "tensor_parallel_size", 1)
    shape = model_shape(files).rank(tp)  # per agent: one rank's share
    weights = weight_bytes(shape, cfg.model_dtype, tp)
    if cfg.lora_enabled:  # every slot, filled or not: the graphs' shapes
        weights += lora_bytes(shape, cfg.max_loras, cfg.max_lora_rank, cfg.model_dtype)
    activations = activation_bytes(shape, cfg.token_buckets[-1], cfg.max_rows)
    available = available_bytes() if cfg.device == "CPU" else cfg.device_memory or device_free
    draft_weights, draft_block = draft_costs(cfg, files)
    if not cfg.num_blocks:
        cfg.num_blocks = auto_blocks(cfg, shape, agents, weights + activations + cfg.runtime_memory + draft_weights,
                                     available, draft_block)
    kv_dtype = kv_dtype_for(cfg.kv_cache_dtype, cfg.model_dtype, cfg.device == "CPU")
    return MemoryPlan(weights, cfg.num_blocks * kv_block_bytes(shape, cfg.block_size, kv_dtype), activations, cfg.runtime_memory,
                      agents, available, cfg.num_blocks, cfg.device, kv_dtype, cfg.model_dtype,
                      draft_weights + cfg.num_blocks * draft_block)
