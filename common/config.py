"""Serving configuration: the original llm-serving YAML keys, read into one typed object by the table
in common/config_keys.py (which says what each key means here).

Pure Python (no mindspore): both the server and the agents read it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config_checks import ConfigError, check_all, check_spec_method
from common.config_files import ge_graphs, read_yaml, section
from common.config_keys import KEYS, SECTIONS
from common.config_text import notices
from common.config_values import WHAT, Role

BUCKET_RATIO = 4  # consecutive token buckets are at most this far apart (a step pads at most 4x)
# At most this many inputs per int8 scale (agent.model.quant.group_for): 576-input rows (SmolLM2's hidden
# size) get one block of 8 groups of 72, not two of 36: the int8 tile scales its sums half as often, at
# the same accuracy (docs/perf-notes.md). Rows of 1536 to 8192 inputs keep groups of 64 (72 would pad them).
QUANT_GROUP_SIZE = 72
CHANNEL_GROUP = -1  # quant_group_size for one scale per output channel and token (agent/kernels/int8_channel.cpp)


def int8_group(value: int | str, flags: set[str]) -> int:
    """quant_group_size as the agent runs it on a CPU with `flags`: `auto` takes per-channel int8
    (oneDNN's int8 matmul, our stream for few tokens) where the CPU has AVX512-VNNI or AMX-INT8, and
    groups of QUANT_GROUP_SIZE elsewhere (without VNNI oneDNN's int8 sums saturate; AVX-VNNI alone is
    unmeasured). Per channel is the faster and the more accurate of the two where it runs, on AMX
    tiles where the CPU has them (docs/benchmarks.md, "Accuracy by dtype")."""
    if value != "auto":
        return int(value)
    return CHANNEL_GROUP if flags & {"avx512_vnni", "amx_int8"} else QUANT_GROUP_SIZE


@dataclass
class ServingConfig:
    model_name: str = "smollm2"
    model_aliases: list[str] = field(default_factory=list)  # other names a request's `model` may use
    model_path: str | None = None  # ours: a .gguf, a HF folder, a .ckpt; None = model_cfg_path's checkpoint, else smollm2
    model_cfg_path: str | None = None  # a MindFormers model yaml (its load_checkpoint names the weights)
    vocab_size: int | None = None  # when set, the model's must equal it (checked at attach)
    max_generate_length: int = 2048  # the original's cap on prompt + output tokens
    end_token: list[int] = field(default_factory=list)  # extra stop ids besides the model's EOS
    # a packed step's token buckets: the union of these two (capped by the step's most tokens)
    prefill_buckets: list[int] = field(default_factory=lambda: [32, 64, 128, 256])  # seq_length
    decode_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])  # decode_batch_size; last = most running
    max_prefill_rows: int = 4  # prefill_batch_size
    model_dtype: str = "float32"  # "bfloat16"/"float16": 16-bit projection weights; "int8": W8A8 (agent/model/linear.py)
    kv_cache_dtype: str = "auto"  # ours (vLLM's): auto (common.memory.kv_dtype_for), float32, bfloat16, float16
    quant_group_size: int | str = "auto"  # ours: inputs per int8 scale (>= 4); 0 = 8 per row; -1 = per channel; auto: int8_group
    # serving_config
    agent_ports: list[int] = field(default_factory=lambda: [61166])
    tensor_parallel_size: int = 1  # ours: consecutive agent_ports form groups of this many ranks of one model
    agent_ip: str = "127.0.0.1"
    agent_hosts: list[str] = field(default_factory=list)  # ours: one host per agent (else agent_ip for all)
    agent_roles: list[str] = field(default_factory=list)  # ours: per agent both | prefill | decode (empty: all both)
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
    routing: str = "prefix"  # ours: where a new request goes among agents (server/engine/routing.py)
    routing_max_load_ratio: float = 1.5  # ours: prefix routing gives way to the least loaded agent past this
    step_timeout_s: float = 120.0  # a step longer than this: the agent is stuck, killed and restarted
    heartbeat_s: float = 5.0  # idle agents are pinged this often (remote agents exit after ~30 s of silence)
    max_agent_restarts: int = 5  # restarts in a row (no successful step between) before giving up
    recovery_deadline_s: float = 300.0  # a request waiting this long for a recovering agent fails
    memory_margin: float = 0.1  # an agent resident over its memory plan by this fraction: /health degraded
    web_ui: bool = True  # ours: the chat page at `/`
    responses_store_size: int = 1024  # ours: /v1/responses kept in memory (previous_response_id, GET)
    responses_ttl_s: float = 3600.0  # ours: how long each is kept
    max_body_bytes: int = 8 << 20  # larger HTTP bodies get 413
    max_header_bytes: int = 64 << 10  # larger request headers get 431
    http_header_timeout_s: float = 10.0  # a connection must send a request's headers within this
    http_keepalive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    warmup: bool = True
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix computed before
    overlap_steps: bool = True  # send step N+1 while step N runs (decodes fed by the agent's own samples)
    deterministic: bool = False  # ours: batch-invariant kernels (a request's tokens and logprobs whatever else runs)
    request_log: str | None = None  # a JSON-lines file: every request's life-cycle timestamps
    agent_cores: list[list[int]] = field(default_factory=list)  # per agent; empty = spread over CPUs
    curve_keys: str | None = None  # CURVE key folder for tcp agents (shm/curve.py)
    device_memory: int = 0  # ours: bytes of each device (Ascend, GPU) for the memory plan; 0 = its runtime's figure
    kv_cache_memory: int = 0  # ours: KV pool bytes per agent with num_blocks auto (vLLM's KV space); 0 = what is left
    runtime_memory: int = 720 << 20  # ours: the memory plan's runtime per agent (MindSpore, graphs, oneDNN: docs/perf-notes.md)
    # pa_config
    num_blocks: int = 1024  # 0 = auto (common/memory.py sizes it before the agents load)
    block_size: int = 16
    max_model_len: int = 2048  # decode_seq_length
    # tokenizer
    tokenizer_path: str | None = None
    chat_template: str | None = None  # a Jinja chat template or a file holding one; None: the model's own
    compile_cache_dir: str = ".cache/mindspore"
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapters: name -> PEFT folder
    enable_lora: bool = False  # LoRA slots even without lora_modules (adapters loaded at run time)
    max_loras: int = 4
    max_lora_rank: int = 16
    # speculative_config (vLLM's names): None = off
    spec_method: str | None = None
    spec_tokens: int = 8
    spec_lookup_min: int = 2
    spec_lookup_max: int = 4
    spec_max_batch: int = 16
    spec_draft_model: str | None = None  # `draft`'s model (agent/speculative/draft_load.py)
    source: Path | None = None
    notices: list[str] = field(default_factory=list)  # ignored keys and values: warnings at start (config_keys)

    @property
    def lora_enabled(self) -> bool:  # the agents hold LoRA slots (max_loras of rank max_lora_rank)
        return self.enable_lora or bool(self.lora_modules)

    def role(self, index: int) -> Role:  # what agent `index` runs: prompts and decodes (`both`), or one of them
        return Role(self.agent_roles[index]) if self.agent_roles else Role.BOTH

    @property
    def disaggregated(self) -> bool:  # some agent only prefills or only decodes: finished prompts' KV moves between agents
        return any(r != Role.BOTH for r in self.agent_roles)

    def agent_host(self, index: int) -> str:  # the address servers reach agent `index` at
        return self.agent_hosts[index] if self.agent_hosts else self.agent_ip

    def bind_host(self, index: int) -> str:  # the address agent `index` listens on
        return self.agent_bind or self.agent_host(index)

    @property
    def groups(self) -> list[list[int]]:
        """Agent indexes by replica: consecutive runs of tensor_parallel_size (rank 0 first)."""
        n = self.tensor_parallel_size
        return [list(range(i, i + n)) for i in range(0, len(self.agent_ports), n)]

    @property
    def token_budget(self) -> int:  # tokens per step: max_num_batched_tokens, else the last seq_length
        return self.max_num_batched_tokens or self.prefill_buckets[-1]

    @property
    def max_running(self) -> int:  # sequences in flight per agent: the rows of a step
        return self.decode_buckets[-1]

    @property
    def prefill_budget(self) -> int:  # token budget of a step while no sequence is decoding
        return max(self.prefill_only_tokens, self.token_budget)

    @property
    def mixed_step_tokens(self) -> int:
        """Most tokens in a step with decodes: the budget, or one per running sequence if that is more."""
        return max(self.token_budget, self.max_running)

    @property
    def token_buckets(self) -> list[int]:
        """Padded token counts of a packed step: its graphs are all built before ready."""
        return bucket_ladder(self.listed_buckets)

    @property
    def listed_buckets(self) -> list[int]:
        """The YAML's sizes below the step budget, the budget, and the prefill-only budget."""
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
    def max_blocks_per_seq(self) -> int:  # a sequence's block table at decode_seq_length
        return -(-self.max_model_len // self.block_size)

    def validate(self) -> "ServingConfig":
        """Every key's range, then the checks across keys (common/config_checks.py)."""
        return check_all(self)


def bucket_notice(c: ServingConfig) -> str:
    """What seq_length and decode_batch_size mean here, with the graph set they give."""
    return (f"model_config.seq_length {c.prefill_buckets} and decode_batch_size {c.decode_buckets} are "
            f"step sizes here (token-packed steps): the graphs are {c.token_buckets} tokens (small steps "
            f"always get small ones); a step holds at most {c.mixed_step_tokens} tokens "
            f"(serving_config.max_num_batched_tokens, else the last seq_length), at most {c.max_running} "
            "sequences run per agent (the last decode_batch_size); longer prompts are chunked")


def bucket_ladder(sizes: list[int]) -> list[int]:
    """The YAML's sizes, and powers of two from 1 wherever two sizes are more than BUCKET_RATIO apart:
    the contest's [128] / [4096] alone ran a lone decode as a 128-token step, many times slower than
    the 1-token step the ladder gives it."""
    out, below = [], 1
    for size in sizes:
        while size > below * BUCKET_RATIO:
            below = 1 << (below * BUCKET_RATIO).bit_length() - 1  # the largest power of two <= 4x below
            out.append(below)
        out.append(size)
        below = size
    return sorted(set(out) | {1})


def speculative_overrides(text: str) -> dict[str, Any]:
    """`--speculative-config` (vLLM's JSON: {"method": "ngram", "num_speculative_tokens": 4, ...}) as
    ServingConfig overrides, read as the YAML's speculative_config section is."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError("--speculative-config: a JSON object of speculative_config keys")
    rows = {k.key: k for k in KEYS if k.section == "speculative_config"}
    unknown = sorted(set(doc) - set(rows))
    if unknown:
        raise ConfigError(f"--speculative-config: unknown keys {unknown} (known: {sorted(rows)})")
    try:
        return {rows[key].attr: rows[key].read(value) for key, value in doc.items() if value is not None}
    except (TypeError, ValueError):
        raise ConfigError(f"--speculative-config {text}: a value is not of its key's type") from None


def load_config(path: str | Path | None = None, **overrides: Any) -> ServingConfig:
    """The serving config of a YAML file (None: the defaults), with `overrides` by attribute.
    Raises ConfigError with one line naming the key, its value and what is allowed."""
    doc = read_yaml(path) if path else {}
    sections = {name: section(doc, name) for name in SECTIONS}
    c = ServingConfig()
    c.source = Path(path) if path else None
    c.notices = notices(doc)
    for k in KEYS:  # in table order: a later row for the same attribute wins
        value = sections[k.section].get(k.key)
        if k.attr is None or k.read is None or value is None:
            continue
        try:
            setattr(c, k.attr, k.read(value))
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{k.name} = {value!r}: must be {WHAT.get(k.read, 'a list of integers')}") from None
    if c.kv_cache_memory and "num_blocks" not in sections["pa_config"]:  # it sizes the pool: num_blocks auto
        c.num_blocks = 0
    if "model_path" in doc:
        ge_graphs(doc["model_path"], c, sections)
    c.device = os.environ.get("LLM_SERVING_DEVICE") or c.device
    for key, value in overrides.items():
        if value is not None:
            setattr(c, key, value)
    check_spec_method(c, sections["speculative_config"], overrides)
    c.validate()
    if c.token_buckets != c.listed_buckets:  # the ladder added sizes between the YAML's
        c.notices.append(bucket_notice(c))
    return c
