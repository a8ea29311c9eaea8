"""Per-request generation parameters, validated once at the API edge."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shm.step import MAX_TOP_LOGPROBS, check_params


INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4e38
MAX_STOP_CHARS = 1024


class InvalidRequest(ValueError):
    """Bad client input: becomes an HTTP 4xx with a JSON body."""


@dataclass(frozen=True)
class LoraRef:
    """A request's LoRA adapter (server/engine/lora.py): its name, its agents' slot, and its
    load's key (where its prefix-cache chains start)."""
    name: str
    slot: int
    key: int
    error: str = ""  # why it can have no slot now (its swap-in failed); "" with slot -1: unloaded


@check_params
@dataclass
class SamplingParams:
    max_new_tokens: int | None = 256  # None: as many as fit the context, up to the server's default
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
    prompt_logprobs: int | None = None  # the prompt's tokens' logprobs with top-n alternatives (None: off)
    priority: int = 0
    grammar: str | None = None  # llguidance grammar text the output must match (common/grammar.py)
    lora: LoraRef | None = None  # its LoRA adapter (None: the base model), from the request's model name

    @property
    def adapter_slot(self) -> int:
        """The step's `adapter` column: the agents' slot + 1 (0: the base model)."""
        return self.lora.slot + 1 if self.lora is not None else 0

    @property
    def penalized(self) -> bool:
        """Its sampling reads the sequence's tokens so far (agent.sampling.needs_penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adapter_key(self) -> int:
        return self.lora.key if self.lora is not None else 0

    def validate(self) -> "SamplingParams":
        floats = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty}
        for name, value in floats.items():  # they travel as float32: inf, nan and 1e39 are refused here
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise InvalidRequest(f"{name} must be a finite number")
        # Ranges hold for the float32 values the sampler gets: top_p 1e-300 is 0 there (masks every token).
        temperature, top_p, min_p, rep, pres, freq = (float(np.float32(v)) for v in floats.values())
        checks = [
            (self.max_new_tokens is None or 1 <= self.max_new_tokens <= INT32_MAX,
             f"max_new_tokens must be in [1, {INT32_MAX}]"),
            (temperature >= 0, "temperature must be >= 0"),
            (0 <= self.top_k <= INT32_MAX, f"top_k must be in [0, {INT32_MAX}] (or -1 for off)"),
            (0 < top_p <= 1, "top_p must be in (0, 1] (and > 0 as a float32: at least 1.4e-45)"),
            (0 <= min_p <= 1, "min_p must be in [0, 1]"),
            (rep > 0, "repetition_penalty must be > 0 (at least 1.4e-45, a float32)"),
            (-2 <= pres <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= freq <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.logprobs <= MAX_TOP_LOGPROBS, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"prompt logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be a non-negative 63-bit integer"),
            (-INT32_MAX <= self.priority <= INT32_MAX, f"priority must be in [-{INT32_MAX}, {INT32_MAX}]"),
            (len(self.stop) <= 16 and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"stop must be at most 16 non-empty strings of at most {MAX_STOP_CHARS} characters"),
            (len(self.stop_token_ids) <= 64 and all(0 <= t <= INT32_MAX for t in self.stop_token_ids),
             "stop_token_ids must be at most 64 non-negative token ids"),
            (not (self.grammar and self.ignore_eos), "ignore_eos cannot be combined with a grammar or "
             "response_format: a finished grammar allows only the end of the sequence"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequest(msg)
        return self
