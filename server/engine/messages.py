"""What the engine thread's inbox carries, one type per message (the HTTP side and the
supervisor's restart threads post them; only the engine thread reads them)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from server.request import Request
from shm.link import AgentLink


@dataclass(frozen=True)
class Add:
    """A new request (already counted against max_queue by `Requests.admit`)."""
    request: Request


@dataclass(frozen=True)
class Abort:
    """The client went away: cancel the request if it is still live."""
    request_id: str


@dataclass(frozen=True)
class AgentBack:
    """A restart's outcome for lane `index`: its new client, or why it failed."""
    index: int
    client: AgentLink | None
    error: str | None


@dataclass(frozen=True)
class Drain:
    """Move every sequence off the agent on `port` with its KV, and schedule nothing more there
    (`resume`: schedule there again); `done` gets what moved, or a DrainError."""
    port: int
    resume: bool
    done: Future


@dataclass(frozen=True)
class Wake:
    """Nothing to do but look at the stop flag (shutdown)."""


Message = Add | Abort | AgentBack | Drain | Wake
