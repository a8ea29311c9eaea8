"""The live requests: the one owner of a request's state (queued, running, done) and of its end.

Every request ends exactly once, here: finished (eos / stop / length), failed with a reason, or
cancelled. The end leaves the lane's scheduler (the agent frees the sequence with the next step),
records the metrics and the request log, and builds the final event: the last token's, carrying the
reason (TGI and OpenAI streams end on that token), or an empty one.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque

from server.engine.lane import AgentLane
from server.engine.output import OutputProcessor
from server.request import Delta, Request, Status

RETRY_AFTER_MAX_S = 600


def drain_eta_s(queued: int, finished_at: list[float]) -> int:
    """Seconds for `queued` requests to drain at the rate requests recently finished (monotonic end
    times, oldest first): what a refused client should wait. 1 s while the rate is unknown."""
    if len(finished_at) < 2 or finished_at[-1] <= finished_at[0]:
        return 1
    rate = (len(finished_at) - 1) / (finished_at[-1] - finished_at[0])
    return int(min(RETRY_AFTER_MAX_S, max(1, math.ceil(queued / rate))))


class QueueFull(RuntimeError):
    """Backpressure: the waiting queue is at its bound (HTTP 503 + Retry-After)."""


class Requests:
    def __init__(self, max_queue: int, out: OutputProcessor, lanes: list[AgentLane]):
        self.max_queue, self.out, self.lanes = max_queue, out, lanes
        self.live: dict[str, Request] = {}  # engine thread only
        self._queued = 0  # submitted, never scheduled (any thread: guarded by _lock)
        self._lock = threading.Lock()
        self._finished_at: deque[float] = deque(maxlen=256)  # recent ends: the drain rate behind Retry-After

    # ------------------------------------------------------------ any thread
    def admit(self) -> None:
        """Count a new request against max_queue (raises QueueFull)."""
        with self._lock:
            if self._queued >= self.max_queue:
                self.out.metrics.rejected.inc()
                raise QueueFull(f"{self._queued} requests waiting (max_queue={self.max_queue})")
            self._queued += 1

    def retry_after_s(self) -> int:
        """For a 503 when the queue is full (see `drain_eta_s`)."""
        with self._lock:
            queued = self._queued
        return drain_eta_s(queued, list(self._finished_at))

    # ------------------------------------------------------------ engine thread
    def add(self, req: Request) -> None:
        self.live[req.request_id] = req

    def scheduled(self, req: Request, now: float) -> None:
        """Its first planned step: it leaves the bounded waiting queue."""
        if req.status is Status.QUEUED:
            self._unqueue()
            req.status, req.first_scheduled_at = Status.RUNNING, now

    def _unqueue(self) -> None:
        with self._lock:
            self._queued -= 1

    def cancel(self, request_id: str) -> None:
        """The client went away: end it now, or when the step computing it returns."""
        req = self.live.get(request_id)
        if req is None:
            return
        if req.lane >= 0 and self.lanes[req.lane].in_flight(req.seq):
            req.cancelled = True
        else:
            self.end(req, "cancelled")

    def end(self, req: Request, reason: str, error: str | None = None, status: int = 500,
            last: Delta | None = None) -> None:
        """End a request once. `status`: an error's HTTP status (503: no agent could serve it);
        `last`: its last token's event, which then carries the end."""
        if req.status is Status.DONE:
            return
        if req.status is Status.QUEUED:
            self._unqueue()
        req.status = Status.DONE
        if req.lane >= 0:
            self.lanes[req.lane].sched.remove(req.seq)
        self.live.pop(req.request_id, None)
        self._finished_at.append(time.monotonic())
        self.out.record_end(req, reason)
        if last is None:
            last = Delta(None, "", error=error, status=status)
        last.finish_reason = reason
        self.out.emit(req, last)
