"""Where a new request goes among the lanes that take prompts (serving_config.routing): a registry
row per policy, one `Router` the supervisor asks.

Each agent has its own prefix cache, and the server keeps every agent's block keys (the scheduler's
BlockManager), so it knows exactly where a prompt's prefix lives: `prefix` sends a request to the
agent holding the longest part of its prompt (a conversation's next turn, a shared system prompt or
document), unless that agent is overloaded next to the least loaded one; then, and without a
cached prefix anywhere, to the least loaded. Least-load alone lands a conversation's next turn on
an agent without its prefix about (N-1)/N of the time with N agents, and computes the prompt again."""
from __future__ import annotations

from typing import Callable, Protocol

from common.config import ServingConfig
from server.engine.lane import AgentLane
from server.engine.metrics import Metrics
from server.sched.sequence import Sequence

# Sequences an agent holding the prefix may have beyond the least loaded's whatever the ratio: with 4,
# a multi-turn workload on two agents recomputed 9% more prompt than one agent (turns sent elsewhere
# while their agent was a few sequences busier); with 16, none more (docs/benchmarks.md).
SLACK = 16


class Router(Protocol):
    def choose(self, seq: Sequence, lanes: list[AgentLane]) -> AgentLane:
        """The lane (of `lanes`, live or coming back, none draining or decode-only) that takes `seq`."""


def least_loaded(lanes: list[AgentLane]) -> AgentLane:
    return min(lanes, key=lambda lane: lane.sched.load)


class LeastLoad:
    def __init__(self, cfg: ServingConfig, metrics: Metrics):
        pass

    def choose(self, seq: Sequence, lanes: list[AgentLane]) -> AgentLane:
        return least_loaded(lanes)


class PrefixAffinity:
    def __init__(self, cfg: ServingConfig, metrics: Metrics):
        self.ratio, self.block_size, self.metrics = cfg.routing_max_load_ratio, cfg.block_size, metrics
        self.on = cfg.enable_prefix_caching

    def choose(self, seq: Sequence, lanes: list[AgentLane]) -> AgentLane:
        least = least_loaded(lanes)
        if len(lanes) < 2 or not self.on:
            return least
        tokens = seq.tokens[:len(seq.tokens) - 1]  # as match_prefix: one token is always computed
        hashes = least.sched.blocks.chain_hashes(tokens, adapter=seq.params.adapter_key)  # one root for every lane
        hits = {lane.index: lane.sched.blocks.cached(hashes) for lane in lanes}
        best = max(lanes, key=lambda lane: (hits[lane.index], -lane.sched.load))
        gain = hits[best.index] - hits[least.index]
        if gain <= 0:
            return least
        if not self._room(best, least, len(seq.tokens) - hits[best.index] * self.block_size):
            # what copying the prefix's KV to the least loaded agent would save (docs/benchmarks.md)
            self.metrics.routed_past_prefix.inc()
            self.metrics.routed_past_prefix_tokens.inc(gain * self.block_size)
            return least
        self.metrics.routed_by_prefix.inc()
        self.metrics.routed_prefix_tokens.inc(gain * self.block_size)
        return best

    def _room(self, lane: AgentLane, least: AgentLane, rest: int) -> bool:
        """`lane` may take one more: its load within the ratio of the least loaded's (or SLACK more),
        and free blocks for the rest of the prompt."""
        return (lane.sched.load <= max(self.ratio * least.sched.load, least.sched.load + SLACK)
                and lane.sched.blocks.num_free * self.block_size >= rest)


ROUTERS: dict[str, Callable[[ServingConfig, Metrics], Router]] = {"prefix": PrefixAffinity, "least_load": LeastLoad}
