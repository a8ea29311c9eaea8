"""Slots of the server's KV hand-over segment (prefill/decode disaggregation): each holds one KV
block on its way from the agent that computed it to the agent that decodes it. The server hands
them out; the agents copy blocks into and out of them (agent/kv_handover.py, docs/protocol.md)."""
from __future__ import annotations


class HandoverSlots:
    def __init__(self, n: int):
        self.n = n
        self.free: list[int] = list(range(n - 1, -1, -1))  # low slots first: the pages in use stay few

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, k: int) -> list[int] | None:
        """`k` slots, or None (and none taken) when fewer are free."""
        if k > len(self.free):
            return None
        return [self.free.pop() for _ in range(k)]

    def give(self, slots: list[int]) -> None:
        self.free.extend(reversed(slots))
        slots.clear()
