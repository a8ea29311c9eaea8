"""A request as the engine tracks it, and the events it sends back to the HTTP side."""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.detok import IncrementalDetokenizer
from server.sampling_params import SamplingParams

if TYPE_CHECKING:  # a type only: the scheduler's room sits above the shared nouns
    from server.sched.sequence import Sequence


class Status(enum.Enum):
    QUEUED = "queued"  # submitted, never scheduled: counts against max_queue
    RUNNING = "running"  # scheduled at least once (may be waiting again after preemption or failover)
    DONE = "done"  # finished, failed or cancelled: its last event is sent


# A prompt token, its logprob (None for the first: nothing predicts it) and its top alternatives.
PromptToken = tuple[int, float | None, list[tuple[int, float]]]


@dataclass
class Delta:
    """One event for a request: a token (with its text), and/or the end."""
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # eos (end of sequence) | stop (a client's stop string or id) | length | cancelled | error; each
    # dialect names them its own way (server/http/{original,tgi,openai}.py)
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500  # of an error: 503 when no agent can serve it (nothing was wrong with the request)
    prompt_logprobs: list[PromptToken] | None = None  # with the first token, where asked
    cached_tokens: int | None = None  # with the first token: its prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Sink:
    """Where a request's events go: an asyncio queue owned by `loop` (the HTTP side)."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.QUEUED
    seq: Sequence | None = None
    detok: IncrementalDetokenizer | None = None
    lane: int = -1  # index of the agent lane that holds its sequence
    cancelled: bool = False  # the client went away while a step computed it: ends when that step returns
    # Life cycle (time.monotonic; None until reached): first in a planned step, that step sent to an
    # agent, first token, the reply to its last step, its end.
    first_scheduled_at: float | None = None
    inference_begin_at: float | None = None
    first_token_at: float | None = None
    inference_end_at: float | None = None
    finished_at: float | None = None
