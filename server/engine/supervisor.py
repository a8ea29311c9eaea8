"""Routing and agent failures, in one place: which lanes take requests, where a request goes, and
what happens when an agent dies, gets stuck, is taken over or comes back.

A lane whose agent died or got stuck is restarted from a background thread (`Backoff`: at once, then
1, 2, 4 ... s; at most `max_agent_restarts` in a row without a successful step); the engine thread
learns each outcome through its inbox (`AgentBack`). The lane's sequences are recomputed from their
tokens so far: on a live lane, else on the restarted agent; one that waits past
`recovery_deadline_s` fails, as does every one when no agent is left.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from common.config import ServingConfig
from common.config_values import Role
from server.engine.handover import successor
from server.engine.lane import AgentLane, LaneState
from server.engine.messages import AgentBack, Message
from server.engine.metrics import Metrics
from server.engine.requests import Requests
from server.engine.routing import ROUTERS
from server.request import Request, Status
from shm.endpoint import holder
from shm.link import AgentLink

log = logging.getLogger("llm_serving.supervisor")
LAUNCHER_POLL_S = 0.5  # an orphaned lane looks this often for a new agent on its port
# Start (or wait for) agent i again and attach to it; with `reattach`, attach to the running agent as
# it is (it was taken from us by `r`, not broken: restarting it would cost a model load, or kill the
# agent of the server that took it).
Restart = Callable[[int, bool], AgentLink]


class Supervisor:
    def __init__(self, cfg: ServingConfig, lanes: list[AgentLane], requests: Requests, restart: Restart | None,
                 inbox: queue.Queue[Message], stop: threading.Event, metrics: Metrics):
        self.cfg, self.lanes, self.requests, self.restart = cfg, lanes, requests, restart
        self.inbox, self.stop, self.metrics = inbox, stop, metrics
        self.stopping = False  # the server is shutting down: an agent that dies now stays down
        self.router = ROUTERS[cfg.routing](cfg, metrics)  # where a new request goes (server/engine/routing.py)

    # ------------------------------------------------------------ routing
    def open_lanes(self) -> list[AgentLane]:
        """Lanes that take prompts (any role but `decode`): live ones, else those whose agent is coming back."""
        lanes = [lane for lane in self.lanes if lane.sched.role != Role.DECODE and not lane.sched.moves.draining]
        return [lane for lane in lanes if lane.live] or [lane for lane in lanes if lane.state is LaneState.RECOVERING]

    def recompute(self, req: Request) -> None:
        """A request whose KV a decode agent gave up (preempted): computed again where prompts run."""
        lanes = self.open_lanes()
        if lanes:
            self.assign(req, lanes)
        else:
            self.requests.end(req, "error", "no agent that takes prompts is live", 503)

    def assign(self, req: Request, lanes: list[AgentLane]) -> None:
        target = self.router.choose(req.seq, lanes)
        self.metrics.agent_requests.labels(str(self.cfg.agent_ports[self.cfg.groups[target.index][0]])).inc()
        req.lane = target.index
        target.sched.add(req.seq)

    # ------------------------------------------------------------ failures (engine thread)
    def lane_down(self, lane: AgentLane, why: str, kill: bool = True) -> None:
        """Take a lane down (restarting it if allowed) and re-home its requests."""
        if self.stopping:
            log.info("agent %d: %s while the server stops", lane.index, why)
        else:
            log.error("agent %d: %s", lane.index, why)
        launcher = lane.orphaned()
        moving, lane.sched.moves.incoming = lane.sched.moves.incoming, []  # their KV is in hand-over slots, not on the agent
        self.metrics.recomputed.inc(lane.sched.kv_tokens)
        seqs = lane.go_down(why, time.monotonic(), kill)
        if launcher is not None and self.restart is not None:  # launch_agents is gone: nothing comes back until it is started again
            lane.orphan(launcher)
            log.error("agent %d: %s", lane.index, lane.why)
            self._await_launcher(lane)
        elif self.restart is not None and not lane.backoff.exhausted and not self.stopping:
            self._restart(lane)
        else:
            lane.fail()
        for seq in moving:  # to another agent, or this one once it is back; else computed again
            if (target := successor(seq, self.lanes)) is not None and seq.request.status is not Status.DONE:
                target.sched.moves.incoming.append(seq)
                seq.request.lane = target.index
            else:
                lane.handover.give(seq.handover)
                self.metrics.recomputed.inc(seq.computed)
                seq.computed, seq.pending = 0, 0
                seqs.append(seq)
        open_lanes = self.open_lanes()
        for seq in seqs:  # recompute from prompt + tokens so far: elsewhere, or here once the agent is back
            req = seq.request
            if req.status is Status.DONE:
                continue
            if req.cancelled:
                self.requests.end(req, "cancelled")
            elif open_lanes:
                self.assign(req, open_lanes)
            else:
                req.lane = -1
                self.requests.end(req, "error", f"agent {lane.index} failed ({why}) and no live agent is left"
                                  + (f": {lane.why}" if lane.why != why else ""), 503)

    def agent_back(self, msg: AgentBack) -> None:
        """A restart's outcome: attach the new agent, retry, or fail the lane's requests."""
        lane = self.lanes[msg.index]
        if msg.client is not None:
            if self.stop.is_set():
                msg.client.close(detach=True)
                return
            log.warning("agent %d is back after %.1fs", lane.index, time.monotonic() - lane.down_since)
            self.metrics.agent_restarts.inc()
            lane.attach(msg.client)
            lane.sched.moves.draining = False  # a restarted agent takes work again (a drain's purpose was its restart)
            self.metrics.graph_compiles.inc(lane.new_compiles(msg.client.info.graph_compiles))
            return
        log.error("agent %d: restart failed: %s", lane.index, msg.error)
        lane.why = f"restart failed: {msg.error}"
        if not lane.backoff.exhausted:
            self._restart(lane)
            return
        lane.fail()
        for seq in lane.sched.waiting + lane.sched.moves.incoming:
            self.requests.end(seq.request, "error", f"agent {lane.index} could not be restarted: {msg.error}", 503)

    def expire_overdue(self, now: float) -> None:
        """Requests that have waited past the deadline for a recovering agent fail instead of hanging."""
        for lane in self.lanes:
            if lane.state is LaneState.RECOVERING:
                why = f"agent {lane.index} still recovering after {self.cfg.recovery_deadline_s:.0f}s ({lane.why})"
                for seq in [s for s in lane.sched.waiting + lane.sched.moves.incoming
                            if now - max(s.arrival, lane.down_since) > self.cfg.recovery_deadline_s]:
                    self.requests.end(seq.request, "error", why, 503)

    def health(self, now: float) -> tuple[str, str]:
        for lane in self.lanes:
            if lane.state is LaneState.FAILED:
                return "unhealthy", f"agent {lane.index} is dead ({lane.why}); not restarted"
            if lane.state is LaneState.ORPHANED:
                return "unhealthy", f"agent {lane.index} is gone: {lane.why}"
            if lane.state is LaneState.RECOVERING:
                return "recovering", f"agent {lane.index} restarting for {now - lane.down_since:.0f}s ({lane.why})"
            if lane.stuck(now):
                return "unhealthy", f"agent {lane.index} step stuck for {now - lane.sent_at:.0f}s"
        over = [why for lane in self.lanes if lane.live and (why := lane.memory.over_plan())]
        return ("degraded", "; ".join(over)) if over else ("ok", "ok")

    # ------------------------------------------------------------ restart threads
    def _restart(self, lane: AgentLane) -> None:
        delay = lane.backoff.next_delay()
        log.warning("agent %d: restart %d/%d in %.0fs", lane.index, lane.backoff.count, lane.backoff.limit, delay)
        self._in_thread(f"restart-agent{lane.index}", lambda: self.stop.wait(delay), lane.index)

    def _await_launcher(self, lane: AgentLane) -> None:
        """Re-attach an orphaned lane once a new agent holds its port (launch_agents started again)."""
        port, old = self.cfg.agent_ports[self.cfg.groups[lane.index][0]], lane.client.pid  # its rank 0's

        def stopped_first() -> bool:
            while holder(port) in (None, old):  # the orphan itself may hold the port a moment longer
                if self.stop.wait(LAUNCHER_POLL_S):
                    return True
            return False

        self._in_thread(f"await-launcher{lane.index}", stopped_first, lane.index)

    def _in_thread(self, name: str, wait: Callable[[], bool], index: int) -> None:
        """After `wait()` (True: the engine stops, give up), restart (or wait for) agent `index` and
        post the outcome to the engine thread."""
        def work() -> None:
            if wait():
                return
            try:
                client, error = self.restart(index, self.lanes[index].reattach), None
            except Exception as exc:  # reported to the engine thread, which retries or gives up
                client, error = None, f"{type(exc).__name__}: {exc}"
            self.inbox.put(AgentBack(index, client, error))

        threading.Thread(target=work, name=name, daemon=True).start()
