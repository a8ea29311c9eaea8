"""What an agent replies, typed: its handshake (`#`) and status reply (`AgentInfo`) and a step's
reply (`StepReply`). The wire carries them as msgpack maps (docs/protocol.md); `from_wire` keeps
the fields it knows, so an agent of a newer minor version may add others."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

# What /stats and /info show of each agent's memory and kernels.
MEMORY_FIELDS = ("weight_bytes", "streamed_bytes", "kv_cache_bytes", "kv_cache_dtype", "activation_bytes",
                 "planned_bytes", "kernels")


class Wire:
    """A reply as a msgpack map; fields it does not know are dropped."""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Any:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in names})

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AgentInfo(Wire):
    vocab_size: int
    eos_token_ids: list[int]
    geometry: dict[str, int]  # GEOMETRY_KEYS: what a server must match (num_blocks 0: it takes ours)
    model: dict[str, str]  # MODEL_KEYS: name, digest
    device: str = "CPU"  # as MindSpore reports it
    device_id: int = 0
    model_dtype: str = "float32"
    weight_bytes: int = 0
    streamed_bytes: int = 0  # weight bytes every decode step reads (all but the embedding and rope tables)
    kv_cache_bytes: int = 0
    kv_cache_dtype: str = "float32"
    activation_bytes: int = 0
    kernels: str = ""  # the path the projections take on this CPU
    launcher_pid: int | None = None  # whoever restarts this agent (None: nobody)
    tp_rank: int = 0  # its rank in its model's tensor-parallel group
    tp_size: int = 1
    pads_cost: bool = True  # a step computes its padding up to its token bucket (False: skipped, free)
    planned_bytes: int = 0  # its memory plan's bytes per agent (common/memory.py; 0: not planned, off CPU)
    speculative: str = ""  # the method its proposer drafts with (speculative_config.method; "": none)
    adapters: tuple[str, ...] = ()  # its LoRA adapters by slot (serving_config.lora_modules' names)
    kv_layout: dict[str, Any] = field(default_factory=dict)  # KV_LAYOUT_KEYS: what a hand-over must match
    # Filled per reply:
    pid: int = 0
    rss_bytes: int = 0  # the process's resident memory now
    attached: bool = False
    server_pid: int | None = None
    graph_compiles: int = 0  # graphs this process has built
    protocol: int = 0

    def memory(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in MEMORY_FIELDS}


@dataclass(frozen=True)
class StepReply(Wire):
    model_s: float = 0.0  # the model's graph call
    agent_s: float = 0.0  # the whole command on the agent, sampling included
    graph_tokens: int = 0  # the token bucket that ran it
    graph_compiles: int = 0
    rss_bytes: int = 0  # the agent's resident memory after the step
    handover_s: float = 0.0  # its KV hand-over copies (`import`, `export`)
    # not on the wire: the slots it exported as frames, and its outputs (shm.step.StepView: the arena
    # slot it answers for, read there by the one who sent the step)
    kv_frames: list[bytes] = field(default_factory=list)
    views: Any = None

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("kv_frames", "views")}
