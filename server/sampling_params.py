"""Per-request generation parameters, validated once at the API edge."""
from __future__ import annotations

from dataclasses import dataclass, field

from shm.arena import MAX_TOP_LOGPROBS


class InvalidRequest(ValueError):
    """Bad client input: becomes an HTTP 4xx with a JSON body."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = 0  # top-n alternatives per token
    priority: int = 0

    def validate(self) -> "SamplingParams":
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.logprobs <= MAX_TOP_LOGPROBS, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be a non-negative 63-bit integer"),
            (len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
             "stop must be at most 16 non-empty strings"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequest(msg)
        return self
