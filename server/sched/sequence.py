"""A sequence as the server tracks it: its tokens, how many are in the KV cache, its blocks, and what
is in flight. The scheduler (server/sched/scheduler.py) alone mutates one."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.sampling_params import SamplingParams
from server.sched.speculative import SpecState
from shm.step import RowOutput

if TYPE_CHECKING:  # server.request imports this module
    from server.request import Request

_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    arrival: float
    request: "Request | None" = None  # the engine's request record
    seq_id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the cache
    table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain keys of full blocks, grown as computed
    preemptions: int = 0
    pending: int = 0  # sampled in steps in flight, not yet back
    agent_has_next: bool = False  # its last planned row sampled: the agent holds its next input token
    scores: dict[int, RowOutput] = field(default_factory=dict)  # prompt logprobs: position -> its token's score
    spec: SpecState | None = None  # its drafting state (server/sched/speculative.py), from its first decode
    handover: list[int] = field(default_factory=list)  # hand-over slots holding its KV while it moves between agents
    moved_at: float = 0.0  # when its KV last left an agent (the hand-over's time)
    cached_tokens: int | None = None  # prompt tokens its first admission found in the prefix cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def scoring(self) -> bool:
        """Its prompt's logprobs are asked and not all back yet: its rows score, and it is computed in
        full (no prefix-cache hit: a cached block has no logits)."""
        return self.params.prompt_logprobs is not None and len(self.scores) < len(self.prompt) - 1

    def targets(self, start: int, n: int) -> list[int]:
        """The next prompt token of each token of a row from position `start` while scoring (the
        prompt's last token has none: what follows it is sampled)."""
        return self.prompt[start + 1:min(start + n, len(self.prompt) - 1) + 1] if self.scoring else []

    @property
    def remaining(self) -> int:
        return len(self.prompt) + len(self.output) + self.pending - self.computed

    def at_limit(self, max_model_len: int) -> bool:
        """Its tokens in flight already end it by length (max_new_tokens or the context): no more rows."""
        n_out = len(self.output) + self.pending
        return self.pending > 0 and (n_out >= self.params.max_new_tokens
                                     or len(self.prompt) + n_out >= max_model_len)
