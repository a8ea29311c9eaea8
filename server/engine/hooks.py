"""The engine's one seam for features that act between steps (LoRA swaps: server/engine/lora_turns.py;
drains: server/engine/drain.py). The engine gives each a turn every loop after sending steps; with a
feature off its hook is not there and the loop runs no code of it."""
from __future__ import annotations

from typing import Protocol

from server.engine.messages import AgentBack


class BetweenSteps(Protocol):
    armed: bool  # work waits: the engine gives it turns (and asks holds_steps) only then, and does not sleep

    def holds_steps(self) -> bool:
        """No step may be sent until a turn has run (e.g. a load waits for the steps in flight)."""

    def turn(self) -> None:
        """Its work, between steps (the engine thread)."""

    def agent_back(self, msg: AgentBack) -> None:
        """A restarted agent is back (before it serves)."""
