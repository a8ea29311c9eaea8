"""Engine thread: schedulers + agent dispatch, off the HTTP event loop.

Every request ends exactly once: finished (stop/length), failed with a reason, or cancelled. A step
error fails only that step's requests; a dead or stuck agent's requests move to a live agent
(recomputed from their tokens so far) or fail when none is left.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.config import ServingConfig
from server.detok import IncrementalDetokenizer
from server.metrics import Metrics
from server.sampling_params import SamplingParams
from server.scheduler import Planned, Scheduler, Sequence
from server.step_writer import RowInput, write_step
from server.tokenizer import TextTokenizer
from shm.transport import AgentClient, AgentDead, AgentError

log = logging.getLogger("llm_serving.engine")
IDLE_WAIT_S = 0.2


class QueueFull(RuntimeError):
    """Backpressure: the waiting queue is at its bound (HTTP 503 + Retry-After)."""


@dataclass
class Delta:
    """One event for a request: a token (with its text), and/or the end."""
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None


@dataclass(frozen=True)
class Sink:
    """Where a request's events go: an asyncio queue owned by `loop` (the HTTP side)."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _deliver(batch: list[tuple[asyncio.Queue, Delta]]) -> None:
    for queue, delta in batch:
        queue.put_nowait(delta)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    arrival: float = field(default_factory=time.monotonic)
    seq: Sequence | None = None
    detok: IncrementalDetokenizer | None = None
    first_token_at: float | None = None
    agent: int = -1
    trace: list[tuple[str, float]] = field(default_factory=list)
    done: bool = False


@dataclass
class AgentSlot:
    index: int
    client: AgentClient
    sched: Scheduler
    alive: bool = True
    inflight: list[Planned] | None = None
    step_started: float = 0.0
    pending_free: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, cfg: ServingConfig, tokenizer: TextTokenizer, clients: list[AgentClient],
                 metrics: Metrics | None = None):
        self.cfg, self.tok = cfg, tokenizer
        self.metrics = metrics or Metrics()
        self.agents = [AgentSlot(i, c, Scheduler(cfg)) for i, c in enumerate(clients)]
        self.eos = set(tokenizer.eos_token_ids) | set(cfg.end_token)
        for c in clients:
            self.eos |= set(c.info.get("eos_token_ids", []))
        self.requests: dict[str, Request] = {}
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._waiting = 0  # submitted, not yet admitted (for backpressure); guarded by _lock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps: list[dict[str, Any]] = []  # recent step timeline (Chrome trace)
        self.step_count = 0
        self.step_wall_s = 0.0  # summed agent step wall time, to relate server CPU time to steps
        self.fatal: str | None = None
        self._outbox: list[tuple[Sink, Delta]] = []  # flushed once per loop turn, not per token

    # ------------------------------------------------------------ API (any thread)
    def start(self) -> None:
        self.thread.start()

    def submit(self, req: Request) -> None:
        with self._lock:
            if self._waiting >= self.cfg.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(f"{self._waiting} requests waiting (max_queue={self.cfg.max_queue})")
            self._waiting += 1
        self.inbox.put(("add", req))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))
        self.thread.join(timeout=10)
        for a in self.agents:
            a.client.close(send_exit=True)

    def health(self) -> tuple[bool, str]:
        if self.fatal:
            return False, self.fatal
        if not self.thread.is_alive():
            return False, "engine thread stopped"
        now = time.monotonic()
        for a in self.agents:
            if not a.alive:
                return False, f"agent {a.index} is dead"
            if a.inflight is not None and now - a.step_started > self.cfg.step_timeout_s:
                return False, f"agent {a.index} step stuck for {now - a.step_started:.0f}s"
        return True, "ok"

    def stats(self) -> dict[str, Any]:
        running = sum(len(a.sched.running) for a in self.agents)
        waiting = sum(len(a.sched.waiting) for a in self.agents) + self.inbox.qsize()
        return {"running": running, "waiting": waiting, "agents_alive": sum(a.alive for a in self.agents),
                "kv_usage": [round(a.sched.blocks.usage(), 4) for a in self.agents], "steps": self.step_count,
                "step_wall_s": self.step_wall_s, "server_cpu_s": time.process_time()}

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not any(a.inflight or a.sched.load for a in self.agents))
                for a in self.agents:
                    if a.alive and a.inflight is None:
                        self._launch(a)
                busy = [a for a in self.agents if a.inflight is not None]
                for a in busy:
                    self._poll(a, 0.005 if len(busy) > 1 else 0.05)
                self._flush()
                self._update_gauges()
        except Exception as exc:  # a bug: fail everything rather than leave requests hanging
            log.exception("engine loop crashed")
            self.fatal = f"engine crashed: {exc}"
            for req in list(self.requests.values()):
                self._end(req, "error", self.fatal)
            self._flush()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                req = self.requests.get(payload)
                if req is not None:
                    self._cancel(req)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: Request) -> None:
        live = [a for a in self.agents if a.alive]
        if not live:
            self._unqueue()
            self._emit(req, Delta(None, "", finish_reason="error", error="no live agent"))
            return
        req.detok = IncrementalDetokenizer(self.tok, req.params.stop)
        req.seq = Sequence(req.prompt, req.params, req.arrival, request=req)
        self.requests[req.request_id] = req
        self.metrics.prompt_tokens.inc(len(req.prompt))
        self._assign(req, live)

    def _assign(self, req: Request, live: list[AgentSlot]) -> None:
        target = min(live, key=lambda a: a.sched.load)
        req.agent = target.index
        target.sched.add(req.seq)

    def _unqueue(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _launch(self, a: AgentSlot) -> None:
        preempted = a.sched.preempted
        plan = a.sched.schedule()
        if a.sched.preempted > preempted:
            self.metrics.preemptions.inc(a.sched.preempted - preempted)
        if not plan:
            return
        now = time.monotonic()
        for p in plan:
            if not p.seq.request.trace:  # first admission: leaves the bounded waiting queue
                self._unqueue()
                p.seq.request.trace.append(("scheduled", now))
        rows = [RowInput(p.seq.seq_id, np.asarray(p.seq.tokens[p.seq.computed:p.seq.computed + p.n_tokens], np.int32),
                         p.seq.computed, p.seq.table, p.sample, p.seq.params, len(p.seq.prompt), len(p.seq.output))
                for p in plan]
        has_prefill = any(p.n_tokens > 1 or p.seq.computed < len(p.seq.prompt) for p in plan)
        try:
            dims = write_step(a.client.arena, rows, self.cfg.block_size)
            a.client.send_step(*dims, free=a.pending_free, has_prefill=has_prefill)
        except AgentDead:
            a.inflight = plan
            self._agent_died(a, "agent died")
            return
        a.pending_free = []
        a.inflight = plan
        a.step_started = time.monotonic()

    def _poll(self, a: AgentSlot, timeout_s: float) -> None:
        plan = a.inflight
        try:
            body = a.client.poll_step(timeout_s)
        except AgentDead:
            self._agent_died(a, "agent died")
            return
        except AgentError as exc:  # the agent is fine; this step's requests fail with its reason
            a.inflight = None
            a.sched.step_done(plan)
            for p in plan:
                self._end(p.seq.request, "error", f"step failed: {exc}")
            return
        now = time.monotonic()
        if body is None:
            if now - a.step_started > self.cfg.step_timeout_s:
                self._agent_died(a, f"step timed out after {self.cfg.step_timeout_s:.0f}s")
            return
        a.inflight = None
        kind = "prefill" if any(p.n_tokens > 1 for p in plan) else "decode"
        self.metrics.step_time.labels(kind).observe(now - a.step_started)
        self.step_count += 1
        self.step_wall_s += now - a.step_started
        self._record_step(a, plan, kind, now, body)
        a.sched.step_done(plan)
        f = a.client.arena.fields
        for i, p in enumerate(plan):
            req = p.seq.request
            if p.seq.aborted:
                self._end(req, "cancelled")
            elif p.sample:
                n_top = p.seq.params.logprobs
                top = list(zip(f["out_top_ids"][i, :n_top].tolist(), f["out_top_logprobs"][i, :n_top].tolist()))
                self._on_token(req, int(f["out_ids"][i]), float(f["out_logprobs"][i]), top, now)

    def _record_step(self, a: AgentSlot, plan: list[Planned], kind: str, now: float, body: dict) -> None:
        self.steps.append({"agent": a.index, "kind": kind, "start": a.step_started, "end": now,
                           "rows": len(plan), "tokens": sum(p.n_tokens for p in plan),
                           "model_s": body.get("model_s", 0.0)})
        del self.steps[:-2000]

    def _on_token(self, req: Request, token: int, logprob: float, top: list[tuple[int, float]], now: float) -> None:
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
        elif len(seq.output) >= p.max_new_tokens or len(seq.tokens) >= self.cfg.max_model_len:
            reason = "length"
        if reason:
            text += req.detok.finish()
        self._emit(req, Delta(token, text, logprob, top))
        if reason:
            self._end(req, reason)

    def _emit(self, req: Request, delta: Delta) -> None:
        self._outbox.append((req.sink, delta))

    def _flush(self) -> None:
        """One thread-safe wake-up per event loop for everything this turn produced."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delta]]] = {}
        for sink, delta in self._outbox:
            by_loop.setdefault(sink.loop, []).append((sink.queue, delta))
        self._outbox = []
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _cancel(self, req: Request) -> None:
        a = self.agents[req.agent]
        if a.inflight is not None and any(p.seq is req.seq for p in a.inflight):
            req.seq.aborted = True  # ends when its step returns
        else:
            self._end(req, "cancelled")

    def _end(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.done:
            return
        req.done = True
        if not req.trace:  # never admitted: it still counted as waiting
            self._unqueue()
        a = self.agents[req.agent]
        if req.seq is not None:
            a.sched.remove(req.seq)
            if a.alive:
                a.pending_free.append(req.seq.seq_id)
        self.requests.pop(req.request_id, None)
        now = time.monotonic()
        req.trace.append(("finished", now))
        self.metrics.finished.labels(reason).inc()
        self.metrics.e2e.observe(now - req.arrival)
        n_out = len(req.seq.output) if req.seq else 0
        if req.first_token_at is not None and n_out > 1:
            self.metrics.tpot.observe((now - req.first_token_at) / (n_out - 1))
        self._emit(req, Delta(None, "", finish_reason=reason, error=error))

    def _agent_died(self, a: AgentSlot, why: str) -> None:
        log.error("agent %d: %s", a.index, why)
        a.alive = False
        plan, a.inflight = a.inflight or [], None
        for p in plan:
            if p.seq.aborted:
                self._end(p.seq.request, "cancelled")
        seqs = a.sched.drain()
        a.client.close(send_exit=False)
        live = [x for x in self.agents if x.alive]
        for seq in seqs:
            req = seq.request
            if req.done:
                continue
            if live:  # recompute elsewhere from prompt + tokens generated so far
                self._assign(req, live)
            else:
                self._end(req, "error", f"agent {a.index} failed ({why}) and no live agent is left")

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(sum(len(a.sched.running) for a in self.agents))
        m.waiting.set(sum(len(a.sched.waiting) for a in self.agents))
        m.agents_alive.set(sum(a.alive for a in self.agents))
        for a in self.agents:
            m.kv_usage.labels(str(a.index)).set(a.sched.blocks.usage())

    def chrome_trace(self) -> dict[str, Any]:
        """Recent steps as a Chrome trace (chrome://tracing, Perfetto)."""
        t0 = self.steps[0]["start"] if self.steps else 0.0
        events = [{"name": f"{s['kind']} r={s['rows']} t={s['tokens']}", "ph": "X", "pid": 1, "tid": s["agent"],
                   "ts": (s["start"] - t0) * 1e6, "dur": (s["end"] - s["start"]) * 1e6,
                   "args": {"model_ms": round(s["model_s"] * 1e3, 3)}} for s in self.steps]
        return {"traceEvents": events}
