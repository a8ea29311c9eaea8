"""AgentLink: what the engine needs of an agent, met by one agent (shm.transport.AgentClient) and by
the ranks of a tensor-parallel model together (shm.group.GroupClient)."""
from __future__ import annotations

from typing import Any, Protocol

from shm.arena import Arena
from shm.messages import AgentInfo, StepReply
from shm.step import StepDims


class AgentLink(Protocol):
    address: str
    local: bool  # an ipc agent on this host (its arena shared, its pid known)
    info: AgentInfo | None  # from the handshake
    pid: int | None

    @property
    def arenas(self) -> list[Arena]: ...

    @property
    def in_flight(self) -> int: ...

    def steps(self) -> list[Any]: ...

    def next_slot(self) -> int: ...

    def check_alive(self) -> None: ...

    def send_step(self, dims: StepDims, free: list[int], has_prefill: bool, slot: int = 0,
                  tag: Any = None, grammars: list[list[Any]] | None = None, extra: dict[str, Any] | None = None,
                  kv_frames: list[Any] | None = None) -> None: ...

    def poll_step(self, timeout_s: float) -> StepReply | None: ...

    def send_heartbeat(self) -> None: ...

    def poll(self, timeout_s: float) -> tuple[dict[str, Any], list[bytes]] | None: ...

    def call(self, cmd: bytes, header: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]: ...

    def kill(self) -> None: ...

    def close(self, detach: bool = True, timeout_s: float = 2.0) -> None: ...
