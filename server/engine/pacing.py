"""When to send step N+1 while step N runs (overlap): shortly before N is due to end, not at once.

Sent at once, step N+1 is fixed a whole step before it starts, so a prompt that arrives during
step N waits for the rest of N and all of N+1: ~1.5 steps on average. Sent just before N is due,
N+1 takes the prompts that arrived meanwhile (~0.5 steps of waiting) and still reaches the agent
before N's reply, so the agent never waits on the server. When a step runs longer than its bucket
usually takes, N+1 has simply gone early; when shorter, the agent waits at most LEAD_S plus the
server's plan-and-send time.
"""
from __future__ import annotations

LEAD_S = 0.010  # the send leads the due time by this: planning, arena write and send take a few ms
EARLY = 0.15  # and by this share of the step: its time varies run to run on a shared 2-core host
WEIGHT = 0.25  # of the newest step in a bucket's running mean (follows a drifting host in a few steps)


class StepPacer:
    """Running mean wall time of the steps of each token bucket (the agent's graph sizes), and from
    it how long the next step may wait."""

    def __init__(self, buckets: list[int]):
        self.buckets = sorted(buckets)
        self.took: dict[int, float] = {}

    def _bucket(self, tokens: int) -> int:
        return next((b for b in self.buckets if b >= tokens), tokens)

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens took `seconds`, from when the agent could start it to its reply."""
        b = self._bucket(tokens)
        prev = self.took.get(b)
        self.took[b] = seconds if prev is None else prev + WEIGHT * (seconds - prev)

    def wait_s(self, tokens: int, started: float, now: float) -> float:
        """Seconds the next step should wait, given the one in flight (its tokens, when the agent
        could start it): 0 to send now, as for a bucket not yet timed."""
        took = self.took.get(self._bucket(tokens))
        if took is None:
            return 0.0
        return max(0.0, started + took * (1 - EARLY) - LEAD_S - now)
