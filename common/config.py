"""Serving configuration: the original llm-serving YAML keys, read into one typed object.

Pure Python (no mindspore): both the server and the agents read it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from common.config_keys import BFLOAT16, FLOAT16, INT8, notices
from common.memory import parse_bytes


def model_dtype(value: Any) -> str:
    """The dtype the model runs in for a `model_dtype` value: "int8", "bfloat16" or "float16" for
    their spellings, else float32 (other values are warned about by config_keys)."""
    v = str(value).lower()
    return "int8" if v in INT8 else "bfloat16" if v in BFLOAT16 else "float16" if v in FLOAT16 else "float32"


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _as_list(v: Any) -> list[int]:
    items = v if isinstance(v, (list, tuple)) else [v]
    if any(isinstance(x, bool) or (isinstance(x, float) and not x.is_integer()) for x in items):
        raise ValueError(v)
    return sorted(int(x) for x in items)


BUCKET_RATIO = 4  # consecutive token buckets are at most this far apart (a step pads at most 4x)


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
    model_dtype: str = "float32"  # "bfloat16"/"float16": 16-bit projection weights; "int8": W8A8 (agent/layers.py)
    kv_cache_dtype: str = "auto"  # ours (vLLM's): auto (the model's compute dtype), float32, bfloat16, float16
    quant_group_size: int = 64  # ours: at most this many inputs per int8 scale (>= 4); 0 = 8 scales per row
    # serving_config
    agent_ports: list[int] = field(default_factory=lambda: [61166])
    agent_ip: str = "127.0.0.1"
    agent_hosts: list[str] = field(default_factory=list)  # ours: one host per agent (else agent_ip for all)
    agent_bind: str | None = None  # ours: where agents listen (launch_agents --bind), else their host
    start_device_id: int = 0
    device: str = "CPU"  # ours: CPU, Ascend or GPU; agent i runs on device start_device_id + i
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
    max_header_bytes: int = 64 << 10  # larger request headers get 431
    http_header_timeout_s: float = 10.0  # a connection must send a request's headers within this
    http_keepalive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    warmup: bool = True
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix computed before
    overlap_steps: bool = True  # send step N+1 while step N runs (decodes fed by the agent's own samples)
    request_log: str | None = None  # a JSON-lines file: every request's life-cycle timestamps
    agent_cores: list[list[int]] = field(default_factory=list)  # per agent; empty = spread over CPUs
    curve_keys: str | None = None  # CURVE key folder for tcp agents (shm/curve.py)
    kv_cache_memory: int = 0  # ours: KV pool bytes per agent with num_blocks auto (vLLM's KV space); 0 = what is left
    # pa_config
    num_blocks: int = 1024  # 0 = auto (common/memory.py sizes it before the agents load)
    block_size: int = 16
    max_model_len: int = 2048  # decode_seq_length
    # tokenizer
    tokenizer_path: str | None = None
    compile_cache_dir: str = ".cache/mindspore"
    source: Path | None = None
    notices: list[str] = field(default_factory=list)  # ignored keys and values: warnings at start (config_keys)

    def agent_host(self, index: int) -> str:
        """The address servers reach agent `index` at."""
        return self.agent_hosts[index] if self.agent_hosts else self.agent_ip

    def bind_host(self, index: int) -> str:
        """The address agent `index` listens on."""
        return self.agent_bind or self.agent_host(index)

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
        """Padded token counts of a packed step: its graphs are all built before ready. The YAML's
        sizes up to the step's budget, and powers of two from 1 wherever two sizes are more than
        BUCKET_RATIO apart: the contest's [128] / [4096] alone ran a lone decode as a 128-token step
        (1.13 s for 8 tokens vs 0.25 s); with the ladder it runs as 1 token."""
        out, below = [], 1
        for size in self.listed_buckets:
            while size > below * BUCKET_RATIO:
                below = 1 << (below * BUCKET_RATIO).bit_length() - 1  # the largest power of two <= 4x below
                out.append(below)
            out.append(size)
            below = size
        return sorted(set(out) | {1})

    @property
    def listed_buckets(self) -> list[int]:
        """The YAML's sizes below the step budget, the budget, and the prefill-only budget."""
        top = self.mixed_step_tokens
        return sorted({b for b in self.decode_buckets + self.prefill_buckets if b < top} | {top, self.prefill_budget})

    def bucket_notice(self) -> str:
        """What seq_length and decode_batch_size mean here, with the graph set they give."""
        return (f"model_config.seq_length {self.prefill_buckets} and decode_batch_size {self.decode_buckets} are "
                f"step sizes here (token-packed steps): the graphs are {self.token_buckets} tokens (small steps "
                f"always get small ones); a step holds at most {self.mixed_step_tokens} tokens "
                f"(serving_config.max_num_batched_tokens, else the last seq_length), at most {self.max_running} "
                "sequences run per agent (the last decode_batch_size); longer prompts are chunked")

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
        for attr, key, ok, allowed in RANGES:
            value = getattr(self, attr)
            items = value if isinstance(value, list) else [value]
            if not items or not all(ok(v) for v in items):
                raise ConfigError(f"{key} = {value!r}: must be {allowed}")
        if self.agent_hosts and len(self.agent_hosts) != len(self.agent_ports):
            raise ConfigError(f"serving_config.agent_hosts = {self.agent_hosts}: one host per agent_ports entry "
                              f"({len(self.agent_ports)})")
        if len(set(zip(self.agent_hosts or [self.agent_ip] * len(self.agent_ports), self.agent_ports))) != len(
                self.agent_ports):
            raise ConfigError(f"serving_config.agent_ports = {self.agent_ports}: each port once")
        if self.num_blocks and (self.num_blocks - 1) * self.block_size < self.max_model_len:
            raise ConfigError(f"pa_config: {self.num_blocks - 1} usable blocks x block_size {self.block_size} hold "
                              f"{(self.num_blocks - 1) * self.block_size} tokens, less than one sequence of "
                              f"decode_seq_length {self.max_model_len} (block 0 is reserved); need num_blocks >= "
                              f"{-(-self.max_model_len // self.block_size) + 1}")
        if self.quant_group_size < 0 or 0 < self.quant_group_size < 4:
            raise ConfigError(f"model_config.quant_group_size = {self.quant_group_size}: at least 4 inputs per int8 "
                              "scale, or 0 (8 scales per row)")
        return self


class ConfigError(ValueError):
    """A config that cannot be served: one line naming the key, its value and what is allowed."""


def _port(v: int) -> bool:
    return 1 <= v <= 65535


# (attribute, YAML key, check of the value (of each item of a list), what is allowed)
RANGES: list[tuple[str, str, Callable[[Any], bool], str]] = [
    ("max_generate_length", "model_config.max_generate_length", lambda v: v >= 2, ">= 2"),
    ("prefill_buckets", "model_config.seq_length", lambda v: v >= 1, "a list of sizes >= 1"),
    ("decode_buckets", "model_config.decode_batch_size", lambda v: v >= 1, "a list of sizes >= 1"),
    ("max_prefill_rows", "model_config.prefill_batch_size", lambda v: v >= 1, ">= 1"),
    ("agent_ports", "serving_config.agent_ports", _port, "a non-empty list of ports in [1, 65535]"),
    ("server_port", "serving_config.server_port", _port, "a port in [1, 65535]"),
    ("start_device_id", "serving_config.start_device_id", lambda v: v >= 0, ">= 0"),
    ("device", "serving_config.device", lambda v: v in ("CPU", "Ascend", "GPU"), "one of CPU, Ascend, GPU"),
    ("prefill_batch_waiting_time", "serving_config.prefill_batch_waiting_time", lambda v: 0 <= v <= 10,
     "in [0, 10] seconds"),
    ("max_queue", "serving_config.max_queue", lambda v: v >= 1, ">= 1 (0 would refuse every request)"),
    ("max_num_batched_tokens", "serving_config.max_num_batched_tokens", lambda v: v >= 0, ">= 0 (0 = largest seq_length)"),
    ("prefill_only_tokens", "serving_config.prefill_only_tokens", lambda v: v >= 0, ">= 0 (0 = max_num_batched_tokens)"),
    ("schedule_policy", "serving_config.schedule_policy", lambda v: v in ("fcfs", "sjf", "priority"),
     "one of fcfs, sjf, priority"),
    ("step_timeout_s", "serving_config.step_timeout_s", lambda v: v >= 1, ">= 1 second (a shorter one kills "
     "agents in the middle of healthy steps)"),
    ("heartbeat_s", "serving_config.heartbeat_s", lambda v: 0.1 <= v <= 25, "in [0.1, 25] seconds (a remote "
     "agent detaches a server after 30 s of silence)"),
    ("max_agent_restarts", "serving_config.max_agent_restarts", lambda v: v >= 0, ">= 0"),
    ("recovery_deadline_s", "serving_config.recovery_deadline_s", lambda v: v > 0, "> 0 seconds"),
    ("max_body_bytes", "serving_config.max_body_bytes", lambda v: v >= 1024, ">= 1024"),
    ("max_header_bytes", "serving_config.max_header_bytes", lambda v: v >= 1024, ">= 1024"),
    ("http_header_timeout_s", "serving_config.http_header_timeout_s", lambda v: v > 0, "> 0 seconds"),
    ("http_keepalive_timeout_s", "serving_config.http_keepalive_timeout_s", lambda v: v >= 1, ">= 1 second"),
    ("kv_cache_dtype", "model_config.kv_cache_dtype", lambda v: v in KV_CACHE_DTYPES, "one of " + ", ".join(KV_CACHE_DTYPES)),
    ("num_blocks", "pa_config.num_blocks", lambda v: v == 0 or v >= 2, ">= 2 (block 0 is reserved) or auto"),
    ("kv_cache_memory", "serving_config.kv_cache_memory", lambda v: v >= 0, "a byte count such as 8GiB"),
    ("block_size", "pa_config.block_size", lambda v: v >= 1, ">= 1"),
    ("max_model_len", "pa_config.decode_seq_length", lambda v: v >= 2, ">= 2"),
]


def _convert(section: dict[str, Any], name: str, key: str, kind: Callable[[Any], Any], default: Any) -> Any:
    """`section[key]` as `kind`, or `default` when absent; a value of the wrong type is a ConfigError."""
    value = section.get(key)
    if value is None:
        return default
    try:
        if kind is bool:
            return _bool(value)
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        what = {int: "an integer", float: "a number", bool: "true or false"}.get(kind, "a list of integers")
        raise ConfigError(f"{name}.{key} = {value!r}: must be {what}") from None


def _bool(value: Any) -> bool:
    """YAML booleans, and the original clients' "True"/"False" strings (bool("False") is True)."""
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("true", "false"):
        return str(value).strip().lower() == "true"
    raise ValueError(value)


def _section(doc: dict[str, Any], name: str) -> dict[str, Any]:
    body = doc.get(name) or {}
    if not isinstance(body, dict):
        raise ConfigError(f"{name}: must be a mapping of keys, not {type(body).__name__}")
    return body


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The YAML document at `path`; a missing file or a syntax error is a ConfigError naming it."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    if doc is not None and not isinstance(doc, dict):
        raise ConfigError(f"config file {path}: expected sections (model_config, serving_config, ...), "
                          f"not {type(doc).__name__}")
    return doc or {}


def load_config(path: str | Path | None = None, **overrides: Any) -> ServingConfig:
    """The serving config of a YAML file (None: the defaults), with `overrides` by attribute.
    Raises ConfigError with one line naming the key, its value and what is allowed."""
    doc = read_yaml(path) if path else {}
    mc, sc = _section(doc, "model_config"), _section(doc, "serving_config")
    pa, tk = _section(doc, "pa_config"), _section(doc, "tokenizer")
    c = ServingConfig()
    c.source = Path(path) if path else None
    c.notices = notices(doc)
    c.model_name = str(mc.get("model_name", c.model_name))
    c.model_path = mc.get("model_path", c.model_path)
    c.model_cfg_path = mc.get("model_cfg_path", c.model_cfg_path)
    c.max_generate_length = _convert(mc, "model_config", "max_generate_length", int, c.max_generate_length)
    c.end_token = _convert(mc, "model_config", "end_token", _as_list, [])
    c.prefill_buckets = _convert(mc, "model_config", "seq_length", _as_list, c.prefill_buckets)
    c.decode_buckets = _convert(mc, "model_config", "decode_batch_size", _as_list, c.decode_buckets)
    c.max_prefill_rows = max(_convert(mc, "model_config", "prefill_batch_size", _as_list, [c.max_prefill_rows]) or [0])
    c.vocab_size = _convert(mc, "model_config", "vocab_size", int, None)
    c.model_dtype = model_dtype(mc.get("model_dtype"))
    c.quant_group_size = _convert(mc, "model_config", "quant_group_size", int, c.quant_group_size)
    c.kv_cache_dtype = str(mc.get("kv_cache_dtype", c.kv_cache_dtype)).lower()
    # The original ignored model_config.batch_waiting_time; we honour both places.
    c.prefill_batch_waiting_time = _convert(sc, "serving_config", "prefill_batch_waiting_time", float,
                                            _convert(mc, "model_config", "batch_waiting_time", float, 0.0))
    for key in ("agent_ip", "server_ip", "schedule_policy", "compile_cache_dir", "request_log", "curve_keys",
                "device"):
        setattr(c, key, sc.get(key, getattr(c, key)))
    for key in ("start_device_id", "server_port", "max_queue", "max_num_batched_tokens", "prefill_only_tokens",
                "max_agent_restarts", "max_body_bytes", "max_header_bytes"):
        setattr(c, key, _convert(sc, "serving_config", key, int, getattr(c, key)))
    for key in ("step_timeout_s", "heartbeat_s", "recovery_deadline_s", "http_header_timeout_s",
                "http_keepalive_timeout_s"):
        setattr(c, key, _convert(sc, "serving_config", key, float, getattr(c, key)))
    for key in ("warmup", "enable_prefix_caching", "overlap_steps"):
        setattr(c, key, _convert(sc, "serving_config", key, bool, getattr(c, key)))
    c.agent_ports = [int(p) for p in _convert(sc, "serving_config", "agent_ports", _ports, c.agent_ports)]
    c.agent_cores = [list(map(int, x)) for x in _convert(sc, "serving_config", "agent_cores", _cores, [])]
    c.agent_hosts = [str(h) for h in sc.get("agent_hosts") or []]
    c.kv_cache_memory = _convert(sc, "serving_config", "kv_cache_memory", parse_bytes, 0)
    # kv_cache_memory sizes the pool: it implies num_blocks auto unless the YAML sets num_blocks too
    c.num_blocks = _convert(pa, "pa_config", "num_blocks", _blocks, 0 if c.kv_cache_memory else c.num_blocks)
    c.block_size = _convert(pa, "pa_config", "block_size", int, c.block_size)
    c.max_model_len = _convert(pa, "pa_config", "decode_seq_length", int, c.max_model_len)
    c.tokenizer_path = tk.get("vocab_file") or tk.get("path")
    c.device = os.environ.get("LLM_SERVING_DEVICE") or c.device
    for key, value in overrides.items():
        if value is not None:
            setattr(c, key, value)
    c.validate()
    if c.token_buckets != c.listed_buckets:  # the ladder added sizes between the YAML's
        c.notices.append(c.bucket_notice())
    return c


def _blocks(v: Any) -> int:
    """pa_config.num_blocks: a count, or "auto" (0)."""
    if str(v).strip().lower() == "auto":
        return 0
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(v)
    return int(v)


def _ports(v: Any) -> list[int]:
    """agent_ports in the YAML's order (agent i serves agent_ports[i]), never sorted."""
    items = v if isinstance(v, (list, tuple)) else [v]
    if not items or any(isinstance(x, bool) for x in items):
        raise ValueError(v)
    return [int(x) for x in items]


def _cores(v: Any) -> list[list[int]]:
    if not isinstance(v, list) or not all(isinstance(x, list) for x in v):
        raise ValueError(v)
    return [[int(c) for c in x] for x in v]
