"""Agent life cycles: a lane whose agent died or got stuck is restarted from a background thread
(backoff 0, 1, 2, 4... s; at most `max_agent_restarts` in a row without a successful step), and the
engine thread learns each outcome through its inbox. The engine re-homes the requests."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from common.config import ServingConfig
from server.engine.lane import AgentLane, LaneState
from server.engine.metrics import Metrics
from server.scheduler import Planned, Sequence
from shm.endpoint import holder
from shm.transport import AgentClient

log = logging.getLogger("llm_serving.supervisor")
LAUNCHER_POLL_S = 0.5  # an orphaned lane looks this often for a new agent on its port
# Start (or wait for) agent i again and attach to it; with `reattach`, attach to the running agent as
# it is (it was taken from us by `r`, not broken: restarting it would cost a model load, or kill the
# agent of the server that took it).
Restart = Callable[[int, bool], AgentClient]


class Supervisor:
    def __init__(self, cfg: ServingConfig, lanes: list[AgentLane], restart: Restart | None,
                 inbox: queue.Queue[tuple[str, Any]], stop: threading.Event, metrics: Metrics):
        self.cfg, self.lanes, self.restart = cfg, lanes, restart
        self.inbox, self.stop, self.metrics = inbox, stop, metrics

    def down(self, lane: AgentLane, why: str, kill: bool = True) -> tuple[list[Planned], list[Sequence]]:
        """Take a lane down (restarting it if allowed); returns its step in flight and its sequences."""
        log.error("agent %d: %s", lane.index, why)
        launcher = lane.orphaned()
        plan, seqs = lane.go_down(why, time.monotonic(), kill)
        lane.reattach = not kill
        if launcher is not None and self.restart is not None:  # launch_agents is gone: no agent will come back until it is started again
            lane.state = LaneState.ORPHANED
            lane.why = f"its launcher (pid {launcher}) is gone; start launch_agents again"
            log.error("agent %d: %s", lane.index, lane.why)
            self._await_launcher(lane)
        elif self.restart is not None and lane.restarts < self.cfg.max_agent_restarts:
            self._start(lane)
        else:
            lane.state = LaneState.FAILED
        return plan, seqs

    def _await_launcher(self, lane: AgentLane) -> None:
        """Re-attach an orphaned lane once a new agent holds its port (launch_agents started again)."""
        port, old = self.cfg.agent_ports[lane.index], lane.client.pid

        def work() -> None:
            while holder(port) in (None, old):  # the orphan itself may hold the port a moment longer
                if self.stop.wait(LAUNCHER_POLL_S):
                    return
            self._attach_again(lane.index)

        threading.Thread(target=work, name=f"await-launcher{lane.index}", daemon=True).start()

    def _start(self, lane: AgentLane) -> None:
        delay = 0.0 if lane.restarts == 0 else min(30.0, 2.0 ** (lane.restarts - 1))
        lane.restarts += 1
        log.warning("agent %d: restart %d/%d in %.0fs", lane.index, lane.restarts, self.cfg.max_agent_restarts, delay)

        def work() -> None:
            if not self.stop.wait(delay):
                self._attach_again(lane.index)

        threading.Thread(target=work, name=f"restart-agent{lane.index}", daemon=True).start()

    def _attach_again(self, index: int) -> None:
        """In a helper thread: restart (or wait for) agent `index` and tell the engine thread."""
        try:
            client, error = self.restart(index, self.lanes[index].reattach), None
        except Exception as exc:  # reported to the engine thread, which retries or gives up
            client, error = None, f"{type(exc).__name__}: {exc}"
        self.inbox.put(("agent_back", (index, client, error)))

    def back(self, index: int, client: AgentClient | None, error: str | None) -> list[Sequence]:
        """A restart's outcome; returns the sequences left without an agent when the lane gives up."""
        lane = self.lanes[index]
        if client is not None:
            if self.stop.is_set():
                client.close(detach=True)
            else:
                log.warning("agent %d is back after %.1fs", index, time.monotonic() - lane.down_since)
                self.metrics.agent_restarts.inc()
                lane.attach(client)
                self.metrics.graph_compiles.inc(lane.new_compiles(client.info))
            return []
        log.error("agent %d: restart failed: %s", index, error)
        lane.why = f"restart failed: {error}"
        if lane.restarts < self.cfg.max_agent_restarts:
            self._start(lane)
            return []
        lane.state = LaneState.FAILED
        return lane.sched.drain()

    def overdue(self, now: float) -> list[tuple[Sequence, str]]:
        """Sequences that have waited past the recovery deadline for their agent, with the reason."""
        out = []
        for lane in self.lanes:
            if lane.state is LaneState.RECOVERING:
                why = f"agent {lane.index} still recovering after {self.cfg.recovery_deadline_s:.0f}s ({lane.why})"
                out += [(seq, why) for seq in lane.sched.waiting
                        if now - max(seq.arrival, lane.down_since) > self.cfg.recovery_deadline_s]
        return out

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
        return "ok", "ok"
