"""Prefill/decode disaggregation on the engine thread (serving_config.agent_roles): the shared-memory
segment that carries KV between agents, each step's hand-over entries, and what a reply moves.

A prompt that ends on a `prefill` agent samples its first token there; the same step exports the
prompt's blocks into hand-over slots (docs/protocol.md). At that step's reply the sequence joins a
`decode` agent's `incoming` (the one with the least load, then the most free blocks), whose next
step imports the blocks and decodes the first token in one command. A decode agent preempts by
handing the sequence back to a prefill agent, to be computed again from its tokens."""
from __future__ import annotations

import logging
from typing import Any

from common.config import ServingConfig
from common.config_values import Role
from server.engine.lane import AgentLane, LaneState
from server.engine.metrics import Metrics
from server.engine.requests import Requests
from server.sched.handover import HandoverSlots
from server.request import Status
from server.sched.step_plan import StepPlan
from shm.arena import Segment, segment_name
from shm.link import AgentLink

log = logging.getLogger("llm_serving.engine")
# The hand-over segment holds two of the longest sequences' KV, and at least this much (tmpfs: its
# pages exist once written). With no slots free a prompt waits one token short of its end.
SEGMENT_BYTES = 64 << 20


class HandoverError(RuntimeError):
    """Disaggregated agents whose KV cannot move between them (agents started with other dtypes)."""


def block_bytes(client: AgentLink) -> int:
    """The bytes of one of the agent's KV blocks: one hand-over slot."""
    return client.info.kv_cache_bytes // client.info.geometry["num_blocks"]


class Handover:
    def __init__(self, cfg: ServingConfig, clients: list[AgentLink], metrics: Metrics):
        self.slot_bytes = block_bytes(clients[0])
        n = max(2 * -(-cfg.max_model_len // cfg.block_size), SEGMENT_BYTES // self.slot_bytes)
        self.segment = Segment(segment_name("handover"), n * self.slot_bytes, create=True)
        self.slots = HandoverSlots(n)
        self.metrics = metrics

    def close(self) -> None:
        self.segment.close()

    @staticmethod
    def _moving(plan: StepPlan) -> tuple[list[Any], list[Any]]:
        """The sequences a step exports and those it imports, in the order its entries list them."""
        exports = plan.moves + [p.seq for p in plan.rows if p.export]
        return exports, [p.seq for p in plan.rows if p.imported and not p.export]

    def entries(self, plan: StepPlan, local: bool) -> tuple[dict[str, Any], list[memoryview]]:
        """A step's hand-over header fields (shm/protocol.py), none when it moves nothing, and its
        frames: a `local` agent's slots are the segment's; another's are the step's frames, in order."""
        out: dict[str, Any] = {}
        frames: list[memoryview] = []
        position = 0
        for key, seqs in zip(("export", "import"), self._moving(plan)):
            for seq in seqs:
                if local:
                    slots = list(seq.handover)
                else:
                    slots = list(range(position, position + len(seq.handover)))
                    position += len(seq.handover)
                out.setdefault(key, []).append([seq.seq_id, seq.table[:len(seq.handover)], slots])
            position = 0
            if not local and key == "import":
                frames = [self._slot(s) for seq in seqs for s in seq.handover]
        if out and local:
            out["handover"] = self.segment.name
        return out, frames

    def _slot(self, s: int) -> memoryview:
        return self.segment.buf[s * self.slot_bytes:(s + 1) * self.slot_bytes]

    def received(self, plan: StepPlan, frames: list[bytes]) -> None:
        """A step's exported slots that came back as frames (an agent without the segment), into the segment."""
        slots = [s for seq in self._moving(plan)[0] for s in seq.handover]
        if frames and len(frames) != len(slots):
            raise HandoverError(f"a step exported {len(slots)} slots and its reply carries {len(frames)} frames")
        for s, frame in zip(slots, frames):
            self._slot(s)[:] = frame

    def replied(self, lane: AgentLane, plan: StepPlan, lanes: list[AgentLane], now: float,
                requests: Requests) -> list[Any]:
        """A step's reply (after its tokens were delivered): imported slots are free again, exported
        sequences move to another agent. Returns the requests to compute again where prompts run (a
        decode agent preempted them, a draining agent had not started them)."""
        for p in plan.rows:
            seq = p.seq
            if p.imported:
                self.slots.give(seq.handover)  # the agent copied them in before the step
                self.metrics.kv_handover_time.observe(now - seq.moved_at)
        for seq in plan.moves + [p.seq for p in plan.rows if p.export]:
            if seq in lane.sched.moves.exporting and seq.request.status is not Status.DONE:
                self._hand(lane, seq, lanes, now, requests)
            else:  # it ended meanwhile: the agent has written its slots, nobody reads them
                self.slots.give(seq.handover)
        return [seq.request for seq in lane.sched.evicted()]

    def _hand(self, lane: AgentLane, seq: Any, lanes: list[AgentLane], now: float, requests: Requests) -> None:
        """`seq`'s KV is out of `lane`: into the `incoming` of the agent that goes on with it (a
        decode, or the rest of its prompt), the least loaded first, then the one with the most free blocks."""
        lane.sched.handed(seq)
        target = successor(seq, [d for d in lanes if d is not lane])
        if target is None:
            self.slots.give(seq.handover)
            log.error("request %s: its KV is out and no agent to go on with it is live", seq.request.request_id)
            requests.end(seq.request, "error", "no agent to go on with it is live or coming back", 503)
            return
        target.sched.moves.incoming.append(seq)
        seq.request.lane = target.index
        seq.moved_at = now
        self.metrics.kv_handovers.inc()
        self.metrics.kv_handover_bytes.inc(len(seq.handover) * self.slot_bytes)


def successor(seq: Any, lanes: list[AgentLane]) -> AgentLane | None:
    """Of `lanes`, the one to go on with `seq` once its KV is in hand-over slots: one whose role
    allows its next row (a decode, or the rest of its prompt), not draining, live (else coming
    back), the least loaded, then the one with the most free blocks. None: no such lane."""
    role = Role.PREFILL if seq.remaining == 1 else Role.DECODE  # the role that cannot go on with it
    targets = [d for d in lanes if d.sched.role != role and not d.sched.moves.draining
               and d.state in (LaneState.LIVE, LaneState.RECOVERING)]
    seq.agent_has_next = False  # its next row carries its token
    return min(targets, key=lambda d: (d.state is not LaneState.LIVE, d.sched.load, -d.sched.blocks.num_free),
               default=None)
