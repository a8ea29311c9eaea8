"""Engine thread: agent lanes, their schedulers and supervision, off the HTTP event loop.

Every request ends exactly once (`Requests.end`): finished (stop/length), failed with a reason, or
cancelled. A step error fails only that step's requests; a dead or stuck agent is killed and
restarted (with backoff, up to `max_agent_restarts` in a row) and its requests are recomputed from
their tokens so far, on a live agent or on the restarted one (`Supervisor`); a request that waits
past `recovery_deadline_s` fails.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from common.config import ServingConfig
from common.tokenizer import TextTokenizer
from server.engine.lora import AdapterSlots
from server.engine.admission import Admission
from server.engine.handover import Handover, HandoverError
from server.engine.lane import AgentLane, lanes_stats
from server.engine.drain import Drains
from server.engine.hooks import BetweenSteps
from server.engine.lora_turns import LoraTurns
from server.engine.messages import Abort, Add, AgentBack, Drain, Message, Wake
from server.engine.metrics import Metrics
from server.engine.output import OutputProcessor
from server.engine.requests import QueueFull, Requests
from server.engine.stepper import Stepper
from server.engine.supervisor import Restart, Supervisor
from server.request import Request
from shm.messages import AgentInfo
from shm.link import AgentLink
from shm.protocol import KV_LAYOUT_KEYS

__all__ = ["Engine", "QueueFull"]
log = logging.getLogger("llm_serving.engine")
IDLE_WAIT_S = 0.2  # an engine with nothing in flight sleeps on its inbox this long per turn


class Engine:
    def __init__(self, cfg: ServingConfig, tokenizer: TextTokenizer, clients: list[AgentLink],
                 metrics: Metrics | None = None, restart: Restart | None = None):
        self.cfg, self.tok = cfg, tokenizer
        self.metrics = metrics or Metrics()
        self.adapters = AdapterSlots(cfg)
        why_not = _why_kv_cannot_move(cfg, clients)
        if why_not and cfg.disaggregated:
            raise HandoverError(f"serving_config.agent_roles: {why_not}")
        self.handover = Handover(cfg, clients, self.metrics) if why_not is None else None
        self.lanes = [AgentLane(i, c, cfg, self.handover.slots if self.handover else None) for i, c in enumerate(clients)]
        for lane in self.lanes:
            self.metrics.graph_compiles.inc(lane.new_compiles(lane.client.info.graph_compiles))
        eos = set(tokenizer.eos_token_ids).union(cfg.end_token, *(c.info.eos_token_ids for c in clients))
        log_file = open(cfg.request_log, "a", buffering=1) if cfg.request_log else None  # line-buffered JSONL
        self.out = OutputProcessor(tokenizer, eos, cfg.max_model_len, self.metrics, log_file)
        self.requests = Requests(cfg.max_queue, self.out, self.lanes)
        self.inbox: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.fatal: str | None = None
        self.supervisor = Supervisor(cfg, self.lanes, self.requests, restart, self.inbox, self._stop, self.metrics)
        self.stepper = Stepper(cfg, self.requests, self.out, self.metrics, self.supervisor, self.handover)
        self.drains = Drains(cfg, self.lanes, self.supervisor, why_not, self.inbox)
        self.admission = Admission(tokenizer, self.requests, self.supervisor, self.metrics)
        self.lora = self.admission.lora = LoraTurns(self.adapters, self.lanes, self.requests, self.admission.assign, self.inbox)
        # features that act between steps (server/engine/hooks.py); LoRA's only where it is on
        self.hooks: list[BetweenSteps] = [self.drains, *([self.lora] if cfg.lora_enabled else [])]

    # ------------------------------------------------------------ API (any thread)
    def start(self) -> None:
        self.thread.start()

    def submit(self, req: Request) -> None:
        """Queue a request (raises QueueFull at max_queue)."""
        self.requests.admit()
        self.inbox.put(Add(req))

    def abort(self, request_id: str) -> None:
        self.inbox.put(Abort(request_id))

    def stopping(self) -> None:
        """The server got its stop signal. A signal to the whole process group (Ctrl-C in a
        terminal, `timeout`) reaches the agents too, and they exit while the HTTP server finishes
        its requests: they are not restarted then."""
        self.supervisor.stopping = True

    def shutdown(self) -> None:
        self._stop.set()
        self.inbox.put(Wake())
        self.thread.join(timeout=10)
        for lane in self.lanes:
            lane.client.close(detach=True)
        if self.out.request_log is not None:
            self.out.request_log.close()
        if self.handover is not None:
            self.handover.close()

    def health(self) -> tuple[str, str]:
        """("ok" | "degraded" | "recovering" | "unhealthy", reason); degraded still serves (an agent
        holds more memory than its plan allows)."""
        if self.fatal:
            return "unhealthy", self.fatal
        if not self.thread.is_alive():
            return "unhealthy", "engine thread stopped"
        return self.supervisor.health(time.monotonic())

    def agent_info(self) -> AgentInfo:
        """What the first agent reported at attach (device, model_dtype, kernels, ...)."""
        return self.lanes[0].client.info

    def memory(self) -> list[dict[str, Any]]:
        """Per agent: weight, streamed, KV and activation bytes, the KV dtype and the kernel path."""
        return [lane.client.info.memory() for lane in self.lanes]

    def stats(self) -> dict[str, Any]:
        """/stats: the lanes' (lanes_stats), with requests still in the inbox or waiting for their
        LoRA adapter's slot counted as waiting, and the drain requests not answered yet."""
        s = lanes_stats(self.lanes)
        return {**s, "waiting": s["waiting"] + self.inbox.qsize() + len(self.adapters.parked), "steps": self.stepper.step_count,
                "step_wall_s": self.stepper.step_wall_s, "server_cpu_s": time.process_time(),
                "drains_waiting": self.drains.waiting()}

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # Sleep on the inbox only when nothing is in flight and no live agent has work (no
                # busy-spin while all agents recover). A live lane with sequences always gets a
                # non-empty plan (scheduler liveness). Sleeping after every step's reply cost
                # IDLE_WAIT_S between steps.
                self._drain_inbox(self._idle_wait(time.monotonic()))
                now = time.monotonic()
                held = any(h.armed and h.holds_steps() for h in self.hooks)
                for lane in self.lanes:  # with overlap: step N+1 goes shortly before step N ends
                    while not held and lane.can_send and lane.send_wait(now) <= 0 and self.stepper.launch(lane, now):
                        pass
                for hook in self.hooks:
                    if hook.armed:
                        hook.turn()
                busy = [lane for lane in self.lanes if lane.busy]
                for lane in busy:
                    wait = lane.send_wait(now) if lane.can_send else 0.0
                    limit = 0.005 if len(busy) > 1 else 0.05
                    self.stepper.poll(lane, min(limit, wait) if wait > 0 else limit)
                self.supervisor.expire_overdue(time.monotonic())
                self.out.flush()
                self.metrics.observe_lanes(self.lanes)
        except Exception as exc:  # a bug: fail everything rather than leave requests hanging
            log.exception("engine loop crashed")
            self.fatal = f"engine crashed: {exc}"
            for req in list(self.requests.live.values()):
                self.requests.end(req, "error", self.fatal)
            self.out.flush()

    def _idle_wait(self, now: float) -> float:
        """How long the engine may sleep on its inbox: 0 while a live lane has work to launch or a
        command in flight; else until the next batch window closes, at most IDLE_WAIT_S."""
        wait = 0.0 if any(h.armed for h in self.hooks) else IDLE_WAIT_S
        for lane in self.lanes:
            if lane.busy:
                return 0.0
            if lane.live and lane.sched.load:
                wait = min(wait, lane.sched.batch_hold(now))
        return wait

    def _drain_inbox(self, wait_s: float) -> None:
        try:
            msg = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(msg, Add):
                self.admission.add(msg.request)
            elif isinstance(msg, Abort):
                self.requests.cancel(msg.request_id)
            elif isinstance(msg, Drain):
                self.drains.start(msg)
            elif isinstance(msg, AgentBack):
                for hook in self.hooks:
                    hook.agent_back(msg)
                self.supervisor.agent_back(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return


def _why_kv_cannot_move(cfg: ServingConfig, clients: list[AgentLink]) -> str | None:
    """None where sequences can move between these agents with their KV (shared memory on this host,
    frames over tcp), else why not."""
    if len(clients) < 2:
        return "one agent: there is no other to move its sequences to"
    if cfg.tensor_parallel_size > 1:
        return "tensor-parallel agents: a sequence's KV is split over a group's ranks"
    layouts = [c.info.kv_layout for c in clients]
    if not all(layouts):
        return "an agent did not report its KV layout (an agent of an older version): its blocks cannot be checked"
    for key in KV_LAYOUT_KEYS:
        values = [layout.get(key) for layout in layouts]
        if len(set(values)) > 1:
            each = ", ".join(f"port {p}: {v}" for p, v in zip(cfg.agent_ports, values))
            return (f"the agents' KV caches differ in {key} ({each}): one agent's blocks would be read wrong by "
                    "another; start every agent from the same YAML (model, kv_cache_dtype, model_dtype, block_size)")
    return None
