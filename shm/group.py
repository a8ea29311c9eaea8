"""The ranks of one tensor-parallel model as one agent client (the original's
`agent_multi_post_method`): every command goes to every rank, the ranks > 0 read rank 0's arena,
and rank 0's reply is the command's. A reply is awaited from every rank, so the group moves in
lock step and a rank that fails or dies fails the group's command."""
from __future__ import annotations

import time
from typing import Any, Callable

from shm.messages import StepReply
from shm.step import StepDims
from shm.transport import POLL_MS, AgentClient, AgentDead, AgentError


def _of_lead(name: str) -> property:
    return property(lambda self: getattr(self.lead, name))


class GroupClient:
    """An AgentLink (shm/link.py) over all ranks, used where one agent's client would be. Not thread-safe."""

    def __init__(self, ranks: list[AgentClient]):
        self.ranks = ranks
        self.lead = ranks[0]

    # what callers read of rank 0
    address = _of_lead("address")
    local = _of_lead("local")
    info = _of_lead("info")
    pid = _of_lead("pid")
    arenas = _of_lead("arenas")
    in_flight = _of_lead("in_flight")

    def steps(self) -> list[Any]:
        return self.lead.steps()

    def next_slot(self) -> int:
        return self.lead.next_slot()

    # every rank
    def check_alive(self) -> None:
        for r in self.ranks:
            r.check_alive()

    def send_step(self, dims: StepDims, free: list[int], has_prefill: bool, slot: int = 0, tag: Any = None,
                  grammars: list[list[Any]] | None = None, extra: dict[str, Any] | None = None,
                  kv_frames: list[Any] | None = None) -> None:
        for r in self.ranks:
            r.send_step(dims, free, has_prefill, slot, tag, grammars, extra, kv_frames)

    def send_heartbeat(self) -> None:
        for r in self.ranks:
            r.send_heartbeat()

    def poll_step(self, timeout_s: float) -> StepReply | None:
        return self._all(lambda r, t: r.poll_step(t), timeout_s)

    def poll(self, timeout_s: float) -> tuple[dict[str, Any], list[bytes]] | None:
        return self._all(lambda r, t: r.poll(t), timeout_s)

    def _all(self, poll: Callable[[AgentClient, float], Any], timeout_s: float) -> Any:
        """Rank 0's reply once every rank has answered the same command (an error of rank 0's after
        the others' replies are taken too, so the ranks stay in step)."""
        deadline = time.monotonic() + timeout_s
        try:
            while True:  # rank 0 waits in a collective for a dead peer (up to 120 s): watch every rank
                self.check_alive()
                reply = poll(self.lead, max(0.0, min(POLL_MS / 1000, deadline - time.monotonic())))
                if reply is not None or time.monotonic() >= deadline:
                    break
        except AgentError:
            self._rest(poll)
            raise
        if reply is not None:
            self._rest(poll)
        return reply

    def _rest(self, poll: Callable[[AgentClient, float], Any], timeout_s: float = 60.0) -> None:
        """The other ranks' replies to the command rank 0 answered: they finish it within moments
        (its collectives held rank 0 until they had run it); one that never answers is stuck."""
        deadline = time.monotonic() + timeout_s
        failed = None
        for r in self.ranks[1:]:
            try:
                while poll(r, max(0.0, deadline - time.monotonic())) is None:
                    if time.monotonic() >= deadline:
                        raise AgentDead(f"rank at {r.address} did not answer with its group")
            except AgentError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def call(self, cmd: bytes, header: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        return [r.call(cmd, header, timeout_s) for r in self.ranks][0]

    def kill(self) -> None:
        for r in self.ranks:
            r.kill()

    def close(self, detach: bool = True, timeout_s: float = 2.0) -> None:
        for r in reversed(self.ranks):  # rank 0 owns the arena: last
            r.close(detach, timeout_s)
