"""Output processing: sampled tokens -> text, stop/length checks, the end of a request, metrics and
the fan-out to the HTTP event loops (one thread-safe wake-up per loop per engine turn, not per token)."""
from __future__ import annotations

import asyncio
import math
import time

from server.metrics import Metrics
from server.request import Delta, Request, Sink
from server.tokenizer import TextTokenizer

MIN_LOGPROB = -9999.0  # what a -inf log-probability is reported as (JSON has no infinity; vLLM does the same)


def _deliver(batch: list[tuple[asyncio.Queue, Delta]]) -> None:
    for queue, delta in batch:
        queue.put_nowait(delta)


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else MIN_LOGPROB


class OutputProcessor:
    def __init__(self, tok: TextTokenizer, eos: set[int], max_model_len: int, metrics: Metrics):
        self.tok, self.eos, self.max_model_len, self.metrics = tok, eos, max_model_len, metrics
        self._outbox: list[tuple[Sink, Delta]] = []

    def token(self, req: Request, token: int, logprob: float, top: list[tuple[int, float]], now: float) -> str | None:
        """Append one sampled token and emit its text; returns the finish reason if it ends the request."""
        seq, p = req.seq, req.params
        seq.output.append(token)
        self.metrics.generation_tokens.inc()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.arrival)
        reason = None
        is_eos = token in self.eos and not p.ignore_eos
        text = "" if is_eos else req.detok.add(token)
        if is_eos or token in p.stop_token_ids or req.detok.stop_hit():
            reason = "stop"
        elif len(seq.output) >= p.max_new_tokens or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        if reason:
            text += req.detok.finish()
        self.emit(req, Delta(token, text, _finite(logprob), [(i, _finite(lp)) for i, lp in top], finish_reason=reason))
        return reason

    def finish(self, req: Request, reason: str, error: str | None) -> None:
        now = time.monotonic()
        req.trace.append(("finished", now))
        self.metrics.finished.labels(reason).inc()
        self.metrics.e2e.observe(now - req.arrival)
        n_out = len(req.seq.output) if req.seq else 0
        if req.first_token_at is not None and n_out > 1:
            self.metrics.tpot.observe((now - req.first_token_at) / (n_out - 1))
        last = self._outbox[-1] if self._outbox else None
        if last and last[0] is req.sink and last[1].token_id is not None and last[1].finish_reason == reason:
            return  # its last token carried the end (TGI and OpenAI streams end on that token, not an empty event)
        self.emit(req, Delta(None, "", finish_reason=reason, error=error))

    def emit(self, req: Request, delta: Delta) -> None:
        self._outbox.append((req.sink, delta))

    def flush(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delta]]] = {}
        for sink, delta in self._outbox:
            by_loop.setdefault(sink.loop, []).append((sink.queue, delta))
        self._outbox = []
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass
