"""Step I/O on the agent lanes, in the engine thread: plan and send (two in flight with overlap),
and turn replies into tokens. A step error fails that step's requests; anything that takes an agent
down goes to the supervisor."""
from __future__ import annotations

import logging
import time

from common.config import ServingConfig
from server.engine.handover import Handover, HandoverError
from server.engine.lane import AgentLane, InFlight
from server.engine.metrics import Metrics
from server.engine.output import OutputProcessor
from server.engine.requests import Requests
from server.engine.supervisor import Supervisor
from server.engine.trace import StepRecord, StepTrace
from server.request import Status
from server.sched.step_plan import Planned, RowResult
from shm import protocol as P
from shm.step import DraftOutputs, RowOutput, ScoreOutputs, StepOutputs, read_drafts, read_row, read_scores
from shm.messages import StepReply
from shm.transport import AgentDead, AgentError

log = logging.getLogger("llm_serving.engine")


class Stepper:
    def __init__(self, cfg: ServingConfig, requests: Requests, out: OutputProcessor, metrics: Metrics,
                 supervisor: Supervisor, handover: Handover | None = None):
        """`handover`: KV moves between prefill and decode agents (serving_config.agent_roles)."""
        self.cfg, self.requests, self.out, self.metrics = cfg, requests, out, metrics
        self.supervisor, self.handover = supervisor, handover
        self.trace = StepTrace()  # recent steps, both sides (/debug/trace)
        self.step_count, self.step_wall_s = 0, 0.0  # steps; their summed agent wall time (to relate server CPU time)

    def launch(self, lane: AgentLane, now: float) -> bool:
        """Plan and send a step; False if there was nothing to send."""
        if lane.sched.batch_hold(now) > 0:  # an idle lane collecting a prefill batch (short)
            return False
        planned_at = time.monotonic()
        plan = lane.sched.schedule()
        self.metrics.preemptions.inc(plan.preempted)
        self.metrics.recomputed.inc(plan.discarded)
        try:
            if not plan:
                if not lane.busy:
                    lane.ping_if_due(now)
                return False
            self.metrics.prefill_tokens.inc(plan.prefill_tokens)
            for p in plan.rows:
                self.requests.scheduled(p.seq.request, now)
            extra, frames = self.handover.entries(plan, lane.client.local) if self.handover else (None, None)
            lane.send_plan(plan, planned_at, extra, frames)
            for p in plan.rows:
                if p.seq.request.inference_begin_at is None:
                    p.seq.request.inference_begin_at = lane.sent_at
            return True
        except AgentDead:
            self.supervisor.lane_down(lane, "agent died")
            return False

    def poll(self, lane: AgentLane, timeout_s: float) -> None:
        head = lane.inflight[0] if lane.inflight else None
        try:
            body = lane.poll(timeout_s)
        except AgentDead:
            self.supervisor.lane_down(lane, "agent died")
            return
        except AgentError as exc:
            if exc.code == P.E_NOT_ATTACHED:  # another server took the agent over (`r`): recompute elsewhere
                self.supervisor.lane_down(lane, f"agent was taken over: {exc}", kill=False)
                return
            if head is not None:  # this step's requests fail with its reason; the others go on
                lane.replied(time.monotonic())
                for p in head.plan.rows:
                    self.requests.end(p.seq.request, "error", f"step failed: {exc}")
            if exc.fatal:
                self.supervisor.lane_down(lane, f"agent runtime failed: {exc}")
            return
        now = time.monotonic()
        if body is None:
            if lane.stuck(now):
                self.supervisor.lane_down(lane, f"no reply for {self.cfg.step_timeout_s:.0f}s (stuck)")
            return
        lane.backoff.reset()
        if self.handover is not None:
            try:
                self.handover.received(head.plan, body.kv_frames)
            except HandoverError as exc:  # its exported KV is not what it was asked for
                self.supervisor.lane_down(lane, f"agent broke the hand-over: {exc}")
                return
        self._step_done(lane, head, body, now)

    def _emitted(self, rows: list[Planned], outputs: StepOutputs, drafts: DraftOutputs) -> list[list[RowOutput]]:
        """Each row's tokens in order: its accepted drafts, then its sample (none for a row that
        does not sample); the drafting counters."""
        out, first = [], 0
        for i, p in enumerate(rows):
            n_top = p.seq.params.logprobs
            kept = read_drafts(drafts, first, int(outputs.accepted[i]), n_top) if p.spec else []
            out.append(kept + [read_row(outputs, i, n_top)] if p.sample else [])
            first += p.spec
            if p.spec:
                self.metrics.drafts_verified(int(outputs.drafted[i]), len(kept))
        return out

    @staticmethod
    def _keeps(p: Planned, out: list[RowOutput]) -> bool:
        """A row's tokens are kept for a live request whose sampling succeeded."""
        req = p.seq.request
        return bool(out) and out[-1].token >= 0 and req.status is not Status.DONE and not req.cancelled

    def _deliver(self, p: Planned, out: list[RowOutput], now: float) -> None:
        """A row's tokens to its request, up to the one that ends it; or its end (cancelled, failed)."""
        req = p.seq.request
        if req.status is Status.DONE:  # it ended while this step ran: its row is discarded
            return
        req.inference_end_at = now
        if req.cancelled:
            self.requests.end(req, "cancelled")
            return
        if out and out[-1].token < 0:  # this row's sampling failed on the agent; its neighbours went on
            # Validated parameters cannot cause it (server/sampling_params.py): a server error.
            why = (f"request {req.request_id}: sampling failed: " + ("its grammar allows no token here"
                   if req.params.grammar else "the model's probabilities were not finite"))
            log.error("%s", why)
            self.requests.end(req, "error", why)
            return
        first = len(p.seq.output) - len(out)  # the scheduler appended them all
        for i, row in enumerate(out, first + 1):
            delta, reason = self.out.token(req, row.token, row.logprob, row.top, now, i)
            if reason:
                self.requests.end(req, reason, last=delta)
                return
            self.out.emit(req, delta)

    @staticmethod
    def _scores(rows: list[Planned], scores: ScoreOutputs) -> None:
        """Prompt logprobs of the step's scored rows (in token order in the arena) into their sequences."""
        k = 0
        for p in rows:
            if p.targets:  # valid even if it was preempted since: the step ran on its blocks of then
                n_top = p.seq.params.prompt_logprobs or 0
                p.seq.scores.update(enumerate(read_scores(scores, k, p.targets, n_top), p.start + 1))
            k += len(p.targets)

    def _step_done(self, lane: AgentLane, step: InFlight, reply: StepReply, now: float) -> None:
        rows = step.plan.rows
        previous = lane.replied(now)
        start = max(step.sent_at, previous)
        lane.pacer.observe(sum(p.n_tokens for p in rows), now - start)
        kind = "prefill" if step.plan.has_prefill else "decode"
        self.metrics.step_time.labels(kind).observe(now - start)
        self.step_count += 1
        self.step_wall_s += now - start
        self.metrics.graph_compiles.inc(lane.new_compiles(reply.graph_compiles))
        lane.memory.note(reply.rss_bytes)
        self.metrics.kv_handover_copy.inc(reply.handover_s)
        views = reply.views
        self._scores(rows, views.scores)
        emitted = self._emitted(rows, views.outputs, views.drafts)
        lane.sched.update(step.plan, [RowResult([o.token for o in out] if self._keeps(p, out) else [],
                                                *((int(views.outputs.accepted[i]), int(views.outputs.drafted[i]))
                                                  if p.spec else (0, 0)))
                                      for i, (p, out) in enumerate(zip(rows, emitted))])
        for p, out in zip(rows, emitted):
            self._deliver(p, out, now)
        if self.handover is not None:
            for req in self.handover.replied(lane, step.plan, self.supervisor.lanes, now, self.requests):
                self.supervisor.recompute(req)
        if lane.sched.spec is not None and not step.plan.has_prefill:  # wall time, the server's share included
            lane.sched.spec.observe_step(step.plan.running, step.plan.drafting, sum(map(len, emitted)),
                                         now - max(previous, step.sent_at - step.prepare_s))
        self.trace.record(StepRecord(lane.index, kind, len(rows), sum(p.n_tokens for p in rows), step.sent_at, start,
                                     now, step.prepare_s, time.monotonic() - now, reply.model_s, reply.agent_s,
                                     reply.graph_tokens))
