"""Output processing: sampled tokens -> text and stop/length checks, a request's end metrics and log
line, and the fan-out to the HTTP event loops (one thread-safe wake-up per loop per engine turn, not
per token). `Requests.end` decides the end; this only renders it."""
from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TextIO

from server.engine.metrics import Metrics
from server.request import Delta, PromptToken, Request, Sink
from common.tokenizer import TextTokenizer

MIN_LOGPROB = -9999.0  # what a -inf log-probability is reported as (JSON has no infinity; vLLM does the same)


_EPOCH = time.time() - time.monotonic()  # monotonic -> wall clock, for the request log


def request_record(req: Request, reason: str, n_out: int) -> str:
    """One JSON line: every life-cycle timestamp (Unix seconds) and the derived durations."""
    t = {"arrival": req.arrival, "first_scheduled": req.first_scheduled_at, "inference_begin": req.inference_begin_at,
         "first_token": req.first_token_at, "inference_end": req.inference_end_at, "finished": req.finished_at}

    def span(a: str, b: str) -> float | None:
        return None if t[a] is None or t[b] is None else round(t[b] - t[a], 6)

    rec = {"request_id": req.request_id, "finish_reason": reason, "prompt_tokens": len(req.prompt),
           "output_tokens": n_out, **{k: None if v is None else round(v + _EPOCH, 6) for k, v in t.items()},
           "waiting_s": span("arrival", "first_scheduled"),
           "scheduling_to_inference_s": span("first_scheduled", "inference_begin"),
           "inference_s": span("inference_begin", "inference_end"), "ttft_s": span("arrival", "first_token"),
           "latency_s": span("arrival", "finished")}
    return json.dumps(rec) + "\n"


def _deliver(batch: list[tuple[asyncio.Queue, Delta]]) -> None:
    for queue, delta in batch:
        queue.put_nowait(delta)


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else MIN_LOGPROB


def prompt_logprobs(req: Request) -> list[PromptToken]:
    """The prompt's tokens with their scores (None for the first token: nothing predicts it)."""
    out: list[PromptToken] = []
    for pos, tok in enumerate(req.prompt):
        sc = req.seq.scores.get(pos)
        out.append((tok, None, []) if sc is None else (tok, _finite(sc.logprob), [(i, _finite(lp)) for i, lp in sc.top]))
    return out


class OutputProcessor:
    def __init__(self, tok: TextTokenizer, eos: set[int], max_model_len: int, metrics: Metrics,
                 request_log: TextIO | None = None):
        self.tok, self.eos, self.max_model_len, self.metrics = tok, eos, max_model_len, metrics
        self.request_log = request_log  # JSON lines, one per ended request (serving_config.request_log)
        self._outbox: list[tuple[Sink, Delta]] = []

    def token(self, req: Request, token: int, logprob: float, top: list[tuple[int, float]],
              now: float, n_out: int) -> tuple[Delta, str | None]:
        """A sampled token (already appended to its sequence, as the `n_out`-th output: a step may
        append several, a drafting row's) as an event with its text, and the finish reason if it
        ends the request."""
        seq, p = req.seq, req.params
        self.metrics.generation_tokens.inc()
        if p.lora is not None:
            self.metrics.lora_tokens.labels(p.lora.name).inc()
        first = req.first_token_at is None
        if first:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.arrival)
        reason = None
        is_eos = token in self.eos and not p.ignore_eos
        text = "" if is_eos else req.detok.add(token)
        if is_eos:  # the model's EOS or a configured end_token: the original's "eos"
            reason = "eos"
        elif token in p.stop_token_ids or req.detok.stop_hit():  # the client's own stops
            reason = "stop"
        elif n_out >= p.max_new_tokens or len(seq.prompt) + n_out >= self.max_model_len:
            reason = "length"
        if reason:
            text += req.detok.finish()
        delta = Delta(token, text, _finite(logprob), [(i, _finite(lp)) for i, lp in top])
        if first:
            delta.cached_tokens = seq.cached_tokens or 0
        if first and p.prompt_logprobs is not None:
            delta.prompt_logprobs = prompt_logprobs(req)
        return delta, reason

    def record_end(self, req: Request, reason: str) -> None:
        """Metrics and the request-log line of a request that ends now."""
        now = req.finished_at = time.monotonic()
        m = self.metrics
        m.finished.labels(reason).inc()
        if req.params.lora is not None:
            m.lora_finished.labels(req.params.lora.name, reason).inc()
        m.e2e.observe(now - req.arrival)
        n_out = len(req.seq.output) if req.seq else 0
        if req.first_token_at is not None and n_out > 1:
            m.tpot.observe((now - req.first_token_at) / (n_out - 1))
        if req.first_scheduled_at is not None:
            m.waiting_time.observe(req.first_scheduled_at - req.arrival)
            if req.inference_begin_at is not None:
                m.sched_to_inference.observe(req.inference_begin_at - req.first_scheduled_at)
                if req.inference_end_at is not None:
                    m.inference_time.observe(req.inference_end_at - req.inference_begin_at)
        if self.request_log is not None:
            self.request_log.write(request_record(req, reason, n_out))

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
