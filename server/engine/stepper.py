"""Steps on the agent lanes, in the engine thread: plan and send (two in flight with overlap), turn
replies into tokens, and handle a lane's failures (a step error fails that step's requests; a dead
or stuck agent's sequences are recomputed on a live lane or on the restarted agent)."""
from __future__ import annotations

import logging
import time
from typing import Callable

from common.config import ServingConfig
from server.engine.lane import AgentLane, InFlight, LaneState
from server.engine.metrics import Metrics
from server.engine.output import OutputProcessor
from server.request import Request, Status
from server.engine.supervisor import Supervisor
from server.engine.trace import StepRecord, StepTrace
from shm import protocol as P
from shm.step import read_row
from shm.transport import AgentClient, AgentDead, AgentError

log = logging.getLogger("llm_serving.engine")


class Stepper:
    def __init__(self, cfg: ServingConfig, lanes: list[AgentLane], out: OutputProcessor, metrics: Metrics,
                 supervisor: Supervisor, end: Callable[..., None], unqueue: Callable[[], None]):
        """`end(req, reason, error=None)` ends a request (the engine's); `unqueue()` takes one off
        the bounded waiting queue when it is first scheduled."""
        self.cfg, self.lanes, self.out, self.metrics, self.supervisor = cfg, lanes, out, metrics, supervisor
        self.end, self.unqueue = end, unqueue
        self.trace = StepTrace()  # recent steps, both sides (/debug/trace)
        self.step_count = 0
        self.step_wall_s = 0.0  # summed agent step wall time, to relate server CPU time to steps

    def open_lanes(self) -> list[AgentLane]:
        """Lanes that take requests: live ones, else those whose agent is coming back."""
        live = [lane for lane in self.lanes if lane.live]
        return live or [lane for lane in self.lanes if lane.state is LaneState.RECOVERING]

    def assign(self, req: Request, lanes: list[AgentLane]) -> None:
        target = min(lanes, key=lambda lane: lane.sched.load)
        req.lane = target.index
        target.sched.add(req.seq)

    def launch(self, lane: AgentLane, now: float) -> bool:
        """Plan and send a step; False if there was nothing to send."""
        if lane.sched.batch_hold(now) > 0:  # an idle lane collecting a prefill batch (short)
            return False
        planned_at = time.monotonic()
        preempted = lane.sched.preempted
        plan = lane.sched.schedule()
        if lane.sched.preempted > preempted:
            self.metrics.preemptions.inc(lane.sched.preempted - preempted)
        try:
            if not plan:
                if not lane.busy:
                    lane.ping_if_due(now)
                return False
            self.metrics.prefill_tokens.inc(sum(p.n_tokens for p in plan if p.start < len(p.seq.prompt)))
            for p in plan:
                req = p.seq.request
                if req.status is Status.QUEUED:  # first scheduled: leaves the bounded waiting queue
                    self.unqueue()
                    req.status = Status.RUNNING
                    req.first_scheduled_at = now
            lane.send_plan(plan, planned_at)
            for p in plan:
                if p.seq.request.inference_begin_at is None:
                    p.seq.request.inference_begin_at = lane.sent_at
            return True
        except AgentDead:
            self.lane_down(lane, "agent died")
            return False

    def poll(self, lane: AgentLane, timeout_s: float) -> None:
        head = lane.inflight[0] if lane.inflight else None
        try:
            body = lane.poll(timeout_s)
        except AgentDead:
            self.lane_down(lane, "agent died")
            return
        except AgentError as exc:
            if exc.code == P.E_NOT_ATTACHED:  # another server took the agent over (`r`): recompute elsewhere
                self.lane_down(lane, f"agent was taken over: {exc}", kill=False)
                return
            if head is not None:  # this step's requests fail with its reason; the others go on
                lane.inflight.popleft()
                lane.replied_at = time.monotonic()
                for p in head.plan:
                    self.end(p.seq.request, "error", f"step failed: {exc}")
            if exc.fatal:
                self.lane_down(lane, f"agent runtime failed: {exc}")
            return
        now = time.monotonic()
        if body is None:
            if lane.stuck(now):
                self.lane_down(lane, f"no reply for {self.cfg.step_timeout_s:.0f}s (stuck)")
            return
        lane.inflight.popleft()
        lane.restarts = 0
        self._step_done(lane, head, body, now)

    def _step_done(self, lane: AgentLane, step: InFlight, body: dict, now: float) -> None:
        plan = step.plan
        start = max(step.sent_at, lane.replied_at)  # the agent ran the step before this one until then
        lane.replied_at = now
        kind = "prefill" if not all(p.feed for p in plan) else "decode"
        self.metrics.step_time.labels(kind).observe(now - start)
        self.step_count += 1
        self.step_wall_s += now - start
        self.metrics.graph_compiles.inc(lane.new_compiles(body))
        lane.sched.step_done(plan)
        outputs = lane.client.arenas[step.slot].full.outputs
        for i, p in enumerate(plan):
            req = p.seq.request
            if req.status is Status.DONE:  # it ended while this step ran: its row is discarded
                continue
            req.inference_end_at = now
            if p.seq.aborted:
                self.end(req, "cancelled")
            elif p.sample:
                row = read_row(outputs, i, p.seq.params.logprobs)
                if row.token < 0:  # this row's sampling failed on the agent; its neighbours went on
                    # Validated parameters cannot cause it (server/sampling_params.py): a server error.
                    why = f"request {req.request_id}: sampling failed: the model's probabilities were not finite"
                    log.error("%s", why)
                    self.end(req, "error", why)
                    continue
                reason = self.out.token(req, row.token, row.logprob, row.top, now)
                if reason:
                    self.end(req, reason)
        self.trace.record(StepRecord(lane.index, kind, len(plan), sum(p.n_tokens for p in plan), step.sent_at, start,
                                     now, step.prepare_s, time.monotonic() - now, body.get("model_s", 0.0),
                                     body.get("agent_s", 0.0), body.get("graph_tokens", 0)))

    def lane_down(self, lane: AgentLane, why: str, kill: bool = True) -> None:
        plan, seqs = self.supervisor.down(lane, why, kill)
        for p in plan:
            if p.seq.aborted:
                self.end(p.seq.request, "cancelled")
        open_lanes = self.open_lanes()
        for seq in seqs:  # recompute from prompt + tokens so far: elsewhere, or here once the agent is back
            req = seq.request
            if req.status is Status.DONE:
                continue
            if open_lanes:
                self.assign(req, open_lanes)
            else:
                self.end(req, "error", f"agent {lane.index} failed ({why}) and no live agent is left"
                         + (f": {lane.why}" if lane.why != why else ""), 503)

    def agent_back(self, index: int, client: AgentClient | None, error: str | None) -> None:
        for seq in self.supervisor.back(index, client, error):
            self.end(seq.request, "error", f"agent {index} could not be restarted: {error}", 503)

    def expire_recovering(self, now: float) -> None:
        """Requests that have waited past the deadline for a recovering agent fail instead of hanging."""
        for seq, why in self.supervisor.overdue(now):
            self.end(seq.request, "error", why, 503)
