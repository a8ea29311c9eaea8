"""An agent's resident memory against its memory plan, as its replies say it (/health: degraded past
serving_config.memory_margin; /stats and /metrics: the bytes)."""
from __future__ import annotations

import logging

from common.memory import gib
from shm.messages import AgentInfo

log = logging.getLogger("llm_serving.supervisor")


class MemoryWatch:
    def __init__(self, index: int, margin: float, info: AgentInfo):
        self.index, self.margin = index, margin
        self.attached(info)

    def attached(self, info: AgentInfo) -> None:
        """A new agent process: what it said at attach."""
        self.planned, self.rss_bytes, self.warned = info.planned_bytes, info.rss_bytes, False

    def note(self, rss: int) -> None:
        """The agent's resident memory from a reply; the first time it passes its plan, a warning."""
        self.rss_bytes = rss or self.rss_bytes
        if not self.warned and (why := self.over_plan()):
            self.warned = True
            log.warning("%s; /health says degraded", why)

    def over_plan(self) -> str | None:
        """Why this agent holds more than its memory plan by the margin, or None (also None where
        nothing was planned: off CPU, or an agent of an older version)."""
        if not self.planned or self.rss_bytes <= self.planned * (1 + self.margin):
            return None
        return (f"agent {self.index} holds {gib(self.rss_bytes)} resident, over its memory plan's {gib(self.planned)} "
                f"by more than {self.margin:.0%} (serving_config.memory_margin)")
