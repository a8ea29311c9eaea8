"""Serving configuration: the original llm-serving YAML keys, read into one typed object.

Pure Python (no mindspore): both the server and the agents read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.config_keys import INT8, notices


def model_dtype(value: Any) -> str:
    """The dtype the model runs in for a `model_dtype` value: "int8" for int8 spellings, else
    float32 (other values are warned about by config_keys)."""
    return "int8" if str(value).lower() in INT8 else "float32"


def _as_list(v: Any, default: list[int]) -> list[int]:
    if v is None:
        return default
    return sorted(int(x) for x in (v if isinstance(v, (list, tuple)) else [v]))


@dataclass
class ServingConfig:
    model_name: str = "smollm2"
    model_path: str | None = None  # ours: a .gguf, a HF folder, a .ckpt; None = model_cfg_path's checkpoint, else smollm2
    model_cfg_path: str | None = None  # a MindFormers model yaml (its load_checkpoint names the weights)
    vocab_size: int | None = None  # when set, the model's must equal it (checked at attach)
    max_generate_length: int = 2048  # the original's cap on prompt + output tokens
    end_token: list[int] = field(default_factory=list)  # extra stop ids besides the model's EOS
    # Token buckets of a packed step are the union of these two lists (capped by the step's most tokens).
    prefill_buckets: list[int] = field(default_factory=lambda: [32, 64, 128, 256])  # seq_length
    decode_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])  # decode_batch_size; last = most running
    max_prefill_rows: int = 4  # prefill_batch_size
    model_dtype: str = "float32"  # or "int8": W8A8 projections and LM head (agent/kernels/linear_int8.cpp)
    quant_group_size: int = 64  # ours: at most this many inputs per int8 scale (>= 4); 0 = 8 scales per row
    # serving_config
    agent_ports: list[int] = field(default_factory=lambda: [61166])
    agent_ip: str = "127.0.0.1"
    start_device_id: int = 0
    server_ip: str = "127.0.0.1"
    server_port: int = 8835
    prefill_batch_waiting_time: float = 0.0  # an idle agent holds a lone prompt this long for companions
    max_queue: int = 512  # waiting requests before 503
    max_num_batched_tokens: int = 0  # token budget per step; 0 = largest prefill bucket
    prefill_only_tokens: int = 0  # budget of a step while nothing decodes (prefill is faster in larger steps); 0 = the same
    schedule_policy: str = "fcfs"  # fcfs | sjf (shortest max_new_tokens first) | priority
    step_timeout_s: float = 120.0  # a step longer than this: the agent is stuck, killed and restarted
    heartbeat_s: float = 5.0  # idle agents are pinged this often (remote agents exit after ~30 s of silence)
    max_agent_restarts: int = 5  # restarts in a row (no successful step between) before giving up
    recovery_deadline_s: float = 300.0  # a request waiting this long for a recovering agent fails
    max_body_bytes: int = 8 << 20  # larger HTTP bodies get 413
    warmup: bool = True
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix computed before
    overlap_steps: bool = True  # send step N+1 while step N runs (decodes fed by the agent's own samples)
    request_log: str | None = None  # a JSON-lines file: every request's life-cycle timestamps
    agent_cores: list[list[int]] = field(default_factory=list)  # per agent; empty = spread over CPUs
    # pa_config
    num_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 2048  # decode_seq_length
    # tokenizer
    tokenizer_path: str | None = None
    compile_cache_dir: str = ".cache/mindspore"
    source: Path | None = None
    notices: list[str] = field(default_factory=list)  # ignored keys and values: warnings at start (config_keys)

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or self.prefill_buckets[-1]

    @property
    def max_running(self) -> int:
        """Sequences in flight per agent: the rows of a step."""
        return self.decode_buckets[-1]

    @property
    def prefill_budget(self) -> int:
        """Token budget of a step while no sequence is decoding."""
        return max(self.prefill_only_tokens, self.token_budget)

    @property
    def mixed_step_tokens(self) -> int:
        """Most tokens in a step with decodes: the budget, or one per running sequence if that is more."""
        return max(self.token_budget, self.max_running)

    @property
    def token_buckets(self) -> list[int]:
        """Padded token counts of a packed step: its graphs are all built before ready."""
        top = self.mixed_step_tokens
        return sorted({b for b in self.decode_buckets + self.prefill_buckets if b < top} | {top, self.prefill_budget})

    @property
    def max_rows(self) -> int:
        return self.decode_buckets[-1] + self.max_prefill_rows

    @property
    def max_total_tokens(self) -> int:
        """Most tokens of a sequence (prompt + output): the KV context, capped by the original's
        `max_generate_length`."""
        return min(self.max_model_len, self.max_generate_length)

    @property
    def geometry(self) -> dict[str, int]:
        """The KV cache layout a server and its agents must share (checked at attach)."""
        return {"block_size": self.block_size, "num_blocks": self.num_blocks, "max_model_len": self.max_model_len}

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def validate(self) -> "ServingConfig":
        if self.block_size < 1 or self.num_blocks < 2:
            raise ValueError("pa_config: block_size >= 1 and num_blocks >= 2 (block 0 is reserved)")
        if not self.agent_ports:
            raise ValueError("serving_config.agent_ports must list at least one port")
        if (self.num_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError(f"pa_config: {self.num_blocks - 1} usable blocks x block_size {self.block_size} hold "
                             f"{(self.num_blocks - 1) * self.block_size} tokens, less than one sequence of "
                             f"decode_seq_length {self.max_model_len} (block 0 is reserved)")
        if self.quant_group_size < 0 or 0 < self.quant_group_size < 4:
            raise ValueError(f"model_config.quant_group_size {self.quant_group_size}: at least 4 inputs per int8 "
                             "scale, or 0 (8 scales per row)")
        if self.schedule_policy not in ("fcfs", "sjf", "priority"):
            raise ValueError(f"unknown schedule_policy {self.schedule_policy!r}")
        return self


def load_config(path: str | Path | None = None, **overrides: Any) -> ServingConfig:
    doc: dict[str, Any] = {}
    if path:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    mc = doc.get("model_config", {}) or {}
    sc = doc.get("serving_config", {}) or {}
    pa = doc.get("pa_config", {}) or {}
    tk = doc.get("tokenizer", {}) or {}
    c = ServingConfig()
    c.source = Path(path) if path else None
    c.notices = notices(doc)
    c.model_name = mc.get("model_name", c.model_name)
    c.model_path = mc.get("model_path", c.model_path)
    c.model_cfg_path = mc.get("model_cfg_path", c.model_cfg_path)
    c.max_generate_length = int(mc.get("max_generate_length", c.max_generate_length))
    c.end_token = _as_list(mc.get("end_token"), [])
    c.prefill_buckets = _as_list(mc.get("seq_length"), c.prefill_buckets)
    c.decode_buckets = _as_list(mc.get("decode_batch_size"), c.decode_buckets)
    c.max_prefill_rows = max(_as_list(mc.get("prefill_batch_size"), [c.max_prefill_rows]))
    c.vocab_size = int(mc["vocab_size"]) if mc.get("vocab_size") is not None else None
    c.model_dtype = model_dtype(mc.get("model_dtype"))
    c.quant_group_size = int(mc.get("quant_group_size", c.quant_group_size))
    # The original ignored model_config.batch_waiting_time; we honour both places.
    c.prefill_batch_waiting_time = float(sc.get("prefill_batch_waiting_time", mc.get("batch_waiting_time", 0.0)))
    for key in ("agent_ip", "server_ip", "schedule_policy", "compile_cache_dir", "request_log"):
        setattr(c, key, sc.get(key, getattr(c, key)))
    for key in ("start_device_id", "server_port", "max_queue", "max_num_batched_tokens", "prefill_only_tokens",
                "max_agent_restarts",
                "max_body_bytes"):
        setattr(c, key, int(sc.get(key, getattr(c, key))))
    for key in ("step_timeout_s", "heartbeat_s", "recovery_deadline_s"):
        setattr(c, key, float(sc.get(key, getattr(c, key))))
    c.agent_ports = [int(p) for p in sc.get("agent_ports", c.agent_ports)]
    c.warmup = bool(sc.get("warmup", c.warmup))
    c.enable_prefix_caching = bool(sc.get("enable_prefix_caching", c.enable_prefix_caching))
    c.overlap_steps = bool(sc.get("overlap_steps", c.overlap_steps))
    c.agent_cores = [list(map(int, x)) for x in sc.get("agent_cores", [])]
    c.num_blocks = int(pa.get("num_blocks", c.num_blocks))
    c.block_size = int(pa.get("block_size", c.block_size))
    c.max_model_len = int(pa.get("decode_seq_length", c.max_model_len))
    c.tokenizer_path = tk.get("vocab_file") or tk.get("path")
    for key, value in overrides.items():
        if value is not None:
            setattr(c, key, value)
    return c.validate()
