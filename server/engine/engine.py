"""Engine thread: agent lanes, their schedulers and supervision, off the HTTP event loop.

Every request ends exactly once: finished (stop/length), failed with a reason, or cancelled. A step
error fails only that step's requests; a dead or stuck agent is killed and restarted (with backoff,
up to `max_agent_restarts` in a row) and its requests are recomputed from their tokens so far, on a
live agent or on the restarted one; a request that waits past `recovery_deadline_s` fails.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from typing import Any

from common.config import ServingConfig
from server.detok import IncrementalDetokenizer
from server.engine.lane import AgentLane
from server.engine.metrics import Metrics
from server.engine.output import OutputProcessor
from server.request import Delta, Request, Sink, Status
from server.scheduler import Sequence
from server.engine.stepper import Stepper
from server.engine.supervisor import Restart, Supervisor
from common.tokenizer import TextTokenizer
from shm.transport import AgentClient

__all__ = ["Engine", "QueueFull"]
log = logging.getLogger("llm_serving.engine")
IDLE_WAIT_S = 0.2  # an engine with nothing in flight sleeps on its inbox this long per turn
RETRY_AFTER_MAX_S = 600
# What each agent reports of its memory at attach (agent/main.py), shown by /stats and /info.
MEMORY_KEYS = ("weight_bytes", "streamed_bytes", "kv_cache_bytes", "kv_cache_dtype", "activation_bytes", "kernels")


def drain_eta_s(queued: int, finished_at: list[float]) -> int:
    """Seconds for `queued` requests to drain at the rate requests recently finished (monotonic end
    times, oldest first): what a refused client should wait. 1 s while the rate is unknown."""
    if len(finished_at) < 2 or finished_at[-1] <= finished_at[0]:
        return 1
    rate = (len(finished_at) - 1) / (finished_at[-1] - finished_at[0])
    return int(min(RETRY_AFTER_MAX_S, max(1, math.ceil(queued / rate))))


class QueueFull(RuntimeError):
    """Backpressure: the waiting queue is at its bound (HTTP 503 + Retry-After)."""


class Engine:
    def __init__(self, cfg: ServingConfig, tokenizer: TextTokenizer, clients: list[AgentClient],
                 metrics: Metrics | None = None, restart: Restart | None = None):
        self.cfg, self.tok, self.restart = cfg, tokenizer, restart
        self.metrics = metrics or Metrics()
        self.lanes = [AgentLane(i, c, cfg) for i, c in enumerate(clients)]
        for lane in self.lanes:
            self.metrics.graph_compiles.inc(lane.new_compiles(lane.client.info))
        eos = set(tokenizer.eos_token_ids) | set(cfg.end_token)
        for c in clients:
            eos |= set(c.info.get("eos_token_ids", []))
        log_file = open(cfg.request_log, "a", buffering=1) if cfg.request_log else None  # line-buffered JSONL
        self.out = OutputProcessor(tokenizer, eos, cfg.max_model_len, self.metrics, log_file)
        self.requests: dict[str, Request] = {}
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._queued = 0  # submitted, not yet scheduled (for backpressure); guarded by _lock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.fatal: str | None = None
        self._finished_at: deque[float] = deque(maxlen=256)  # recent ends: the drain rate behind Retry-After
        self.supervisor = Supervisor(cfg, self.lanes, restart, self.inbox, self._stop, self.metrics)
        self.stepper = Stepper(cfg, self.lanes, self.out, self.metrics, self.supervisor, self._end, self._unqueue)

    # ------------------------------------------------------------ API (any thread)
    def start(self) -> None:
        self.thread.start()

    def submit(self, req: Request) -> None:
        with self._lock:
            if self._queued >= self.cfg.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(f"{self._queued} requests waiting (max_queue={self.cfg.max_queue})")
            self._queued += 1
        self.inbox.put(("add", req))

    def retry_after_s(self) -> int:
        """For a 503 when the queue is full (see `drain_eta_s`)."""
        with self._lock:
            queued = self._queued
        return drain_eta_s(queued, list(self._finished_at))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))
        self.thread.join(timeout=10)
        for lane in self.lanes:
            lane.client.close(detach=True)
        if self.out.request_log is not None:
            self.out.request_log.close()

    def health(self) -> tuple[str, str]:
        """("ok" | "recovering" | "unhealthy", reason)."""
        if self.fatal:
            return "unhealthy", self.fatal
        if not self.thread.is_alive():
            return "unhealthy", "engine thread stopped"
        return self.supervisor.health(time.monotonic())

    def device_type(self) -> str:
        """The device the agents run on, as they reported at attach."""
        return str(self.lanes[0].client.info.get("device", "CPU"))

    def model_dtype(self) -> str:
        """The dtype the agents run the model in (float32, bfloat16, int8), as they reported at attach."""
        return str(self.lanes[0].client.info.get("model_dtype", "float32"))

    def memory(self) -> list[dict[str, Any]]:
        """Per agent: weight, streamed, KV and activation bytes, the KV dtype and the kernel path."""
        return [{k: lane.client.info.get(k) for k in MEMORY_KEYS} for lane in self.lanes]

    def stats(self) -> dict[str, Any]:
        running = sum(len(lane.sched.running) for lane in self.lanes)
        waiting = sum(len(lane.sched.waiting) for lane in self.lanes) + self.inbox.qsize()
        return {"running": running, "waiting": waiting, "agents_alive": sum(lane.live for lane in self.lanes),
                "kv_usage": [round(lane.sched.blocks.usage(), 4) for lane in self.lanes], "steps": self.stepper.step_count,
                "devices": [f"{lane.client.info.get('device', '?')}:{lane.client.info.get('device_id', '?')}"
                            for lane in self.lanes],
                "memory": self.memory(),
                "step_wall_s": self.stepper.step_wall_s, "server_cpu_s": time.process_time()}

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # Sleep on the inbox only when nothing is in flight and no live agent has work (no
                # busy-spin while all agents recover). A live lane with sequences always gets a
                # non-empty plan (scheduler liveness). Sleeping after every step's reply cost
                # IDLE_WAIT_S between steps: 200 ms gaps, a third of an all-at-once run.
                self._drain_inbox(self._idle_wait(time.monotonic()))
                now = time.monotonic()
                for lane in self.lanes:  # with overlap: steps N and N+1 back to back
                    while lane.can_send and self.stepper.launch(lane, now):
                        pass
                busy = [lane for lane in self.lanes if lane.busy]
                for lane in busy:
                    self.stepper.poll(lane, 0.005 if len(busy) > 1 else 0.05)
                self.stepper.expire_recovering(time.monotonic())
                self.out.flush()
                self._update_gauges()
        except Exception as exc:  # a bug: fail everything rather than leave requests hanging
            log.exception("engine loop crashed")
            self.fatal = f"engine crashed: {exc}"
            for req in list(self.requests.values()):
                self._end(req, "error", self.fatal)
            self.out.flush()

    def _idle_wait(self, now: float) -> float:
        """How long the engine may sleep on its inbox: 0 while a live lane has work to launch or a
        command in flight; else until the next batch window closes, at most IDLE_WAIT_S."""
        wait = IDLE_WAIT_S
        for lane in self.lanes:
            if lane.busy:
                return 0.0
            if lane.live and lane.sched.load:
                wait = min(wait, lane.sched.batch_hold(now))
        return wait

    def _drain_inbox(self, wait_s: float) -> None:
        try:
            item = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
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
            elif kind == "agent_back":
                self.stepper.agent_back(*payload)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: Request) -> None:
        req.detok = IncrementalDetokenizer(self.tok, req.params.stop)
        req.seq = Sequence(req.prompt, req.params, req.arrival, request=req)
        self.requests[req.request_id] = req
        lanes = self.stepper.open_lanes()
        if not lanes:
            self._end(req, "error", f"no live agent: {self.supervisor.health(time.monotonic())[1]}", 503)
            return
        if not lanes[0].sched.fits(req.seq):  # the API caps lengths; this guards the liveness invariant
            self._end(req, "error", "request does not fit the KV cache")
            return
        self.metrics.prompt_tokens.inc(len(req.prompt))
        self.stepper.assign(req, lanes)

    def _cancel(self, req: Request) -> None:
        lane = self.lanes[req.lane]
        if lane.in_flight(req.seq):
            req.seq.aborted = True  # ends when its step returns
        else:
            self._end(req, "cancelled")

    def _unqueue(self) -> None:
        with self._lock:
            self._queued -= 1

    def _end(self, req: Request, reason: str, error: str | None = None, status: int = 500) -> None:
        """End a request once; an error's `status` is the HTTP status it gets (503: no agent to serve it)."""
        if req.status is Status.DONE:
            return
        if req.status is Status.QUEUED:
            self._unqueue()
        req.status = Status.DONE
        if req.lane >= 0:
            lane = self.lanes[req.lane]
            lane.sched.remove(req.seq)
            if lane.live:
                lane.pending_free.append(req.seq.seq_id)
        self.requests.pop(req.request_id, None)
        self._finished_at.append(time.monotonic())
        self.out.finish(req, reason, error, status)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(sum(len(lane.sched.running) for lane in self.lanes))
        m.waiting.set(sum(len(lane.sched.waiting) for lane in self.lanes))
        m.agents_alive.set(sum(lane.live for lane in self.lanes))
        for lane in self.lanes:
            m.kv_usage.labels(str(lane.index)).set(lane.sched.blocks.usage())

    def chrome_trace(self) -> dict[str, Any]:
        """Recent steps as a Chrome trace (chrome://tracing, Perfetto)."""
        return self.stepper.trace.chrome()
