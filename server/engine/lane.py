"""One agent lane: an agent's connection, its scheduler (its KV pool) and its life cycle.

LIVE lanes run steps and send a heartbeat when idle; a lane whose agent died or got stuck is
RECOVERING (its sequences wait in a fresh scheduler, as the new agent's cache is empty) until the
engine's restart brings a new agent, or FAILED after too many restarts in a row.
"""
from __future__ import annotations

import enum
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.config import ServingConfig
from common.procs import Backoff, pid_alive
from server.engine.memory_watch import MemoryWatch
from server.engine.pacing import StepPacer
from server.sched.handover import HandoverSlots
from server.sched.scheduler import Scheduler
from server.sched.sequence import Sequence
from server.sched.speculative import SpecPolicy
from server.sched.step_plan import Planned, StepPlan
from shm.protocol import E_NOT_ATTACHED
from shm.step import RowInput
from shm.messages import AgentInfo, StepReply
from shm.link import AgentLink
from shm.transport import AgentDead, AgentError

log = logging.getLogger("llm_serving.supervisor")


class LaneState(enum.Enum):
    LIVE = "live"
    RECOVERING = "recovering"
    FAILED = "failed"
    ORPHANED = "orphaned"  # its launcher is gone: nobody restarts it; re-attached when one starts it again


@dataclass
class InFlight:
    """A step sent and awaiting its reply: the tag its agent client keeps with it."""
    plan: StepPlan
    slot: int  # its arena slot
    sent_at: float
    prepare_s: float  # server time to plan, encode and send it


def _targets(p: Planned) -> np.ndarray | None:
    """A scored row's targets column (-1 past its scored tokens), or None."""
    if not p.targets:
        return None
    t = np.full(p.n_tokens, -1, np.int32)
    t[:len(p.targets)] = p.targets
    return t


def row_input(p: Planned) -> RowInput:
    """A planned row as the arena takes it. A fed row carries a placeholder token: the agent takes its
    own last sample (its real token may not be back yet)."""
    return RowInput(p.seq.seq_id, np.zeros(p.n_tokens, np.int32) if p.feed else
                    np.asarray(p.seq.tokens[p.start:p.start + p.n_tokens], np.int32),
                    p.start, p.seq.table, p.sample, p.seq.params, len(p.seq.prompt), p.output_len, p.feed,
                    _targets(p), p.spec, p.seq.params.adapter_slot)


def admitted_state(plan: StepPlan, drafts: bool) -> tuple[list[list[Any]], list[list[Any]]]:
    """What the agent must know of the rows a step admits: the constrained ones' grammars and outputs
    so far, and the tokens before a row admitted past position 0 (a prefix-cache hit, a hand-over)
    whose sampling reads them (penalties; drafts), which the agent never saw."""
    grammars = [[p.seq.seq_id, p.seq.params.grammar, list(p.seq.output)] for p in plan.rows
                if p.admitted and p.seq.params.grammar]
    histories = [[p.seq.seq_id, p.seq.tokens[:p.start]] for p in plan.rows
                 if p.admitted and p.start > 0 and (drafts or p.seq.params.penalized)]
    return grammars, histories


def pads_cost(client: AgentLink) -> bool:
    """Whether the agent computes its steps' padding (as it said in its handshake; yes if unknown)."""
    return client.info is None or client.info.pads_cost


def speculates(client: AgentLink, cfg: ServingConfig) -> bool:
    """Whether decodes ask this agent for drafts: speculative_config is on and the agent drafts with
    that method (one started without it says so in its handshake, and gets plain decodes)."""
    return cfg.spec_method is not None and client.info is not None and client.info.speculative == cfg.spec_method


class AgentLane:
    def __init__(self, index: int, client: AgentLink, cfg: ServingConfig, handover: HandoverSlots | None = None):
        """`handover`: the hand-over segment's slots, where serving_config.agent_roles disaggregates."""
        self.index, self.client, self.cfg, self.handover = index, client, cfg, handover
        self.sched = self._scheduler()
        if cfg.spec_method and not self.sched.spec:
            log.warning("agent %d drafts with %r, not speculative_config.method %r: its decodes take no drafts "
                        "(start it from the same config)", index, client.info.speculative, cfg.spec_method)
        self.state = LaneState.LIVE
        # Steps in flight: two with overlap (the agent starts the second as it replies to the first).
        self.depth = 2 if cfg.overlap_steps else 1
        self.pacer = StepPacer(cfg.token_buckets)  # when the second step goes (server/engine/pacing.py)
        self.sent_at = time.monotonic()  # when the command in flight (or the last one) was sent
        self.replied_at = self.sent_at  # when the last step's reply came: the agent's next step starts then
        self.backoff = Backoff(cfg.max_agent_restarts)  # restarts in a row, reset by a successful step
        self.graph_compiles = 0  # graphs this lane's agent process has built, as it last said
        self.down_since, self.why = 0.0, ""
        self.reattach = False  # down because another client took the agent (`r`): attach again, never restart
        self.memory = MemoryWatch(index, cfg.memory_margin, client.info)  # its resident memory against its plan

    def _scheduler(self) -> Scheduler:
        """A fresh scheduler: an empty KV pool, this agent's role."""
        return Scheduler(self.cfg, pads_cost(self.client), speculates(self.client, self.cfg), self.cfg.role(self.index),
                         self.handover)

    @property
    def inflight(self) -> list[InFlight]:
        """Steps awaiting their replies, oldest first (its client's record)."""
        return self.client.steps()

    @property
    def ping_pending(self) -> bool:
        """A heartbeat awaits its reply (it never shares the wire with a step)."""
        return self.client.in_flight > 0 and not self.client.steps()

    @property
    def live(self) -> bool:
        return self.state is LaneState.LIVE

    @property
    def busy(self) -> bool:
        return bool(self.inflight) or self.ping_pending

    @property
    def can_send(self) -> bool:
        return self.live and not self.ping_pending and len(self.inflight) < self.depth

    def send_wait(self, now: float) -> float:
        """Seconds before the next step should be sent: 0 now (none in flight, or the one in flight
        is due to end within the pacer's lead)."""
        steps = self.inflight
        if len(steps) != 1:
            return 0.0
        step = steps[0]
        return self.pacer.wait_s(sum(p.n_tokens for p in step.plan.rows), max(step.sent_at, self.replied_at), now)

    def in_flight(self, seq: Sequence) -> bool:
        return any(p.seq is seq for step in self.inflight for p in step.plan.rows)

    def send_plan(self, plan: StepPlan, planned_at: float, extra: dict[str, Any] | None = None,
                  kv_frames: list[Any] | None = None) -> None:
        """Write the step into a free arena slot and send it (raises AgentDead). `extra`: header fields (its KV hand-over entries), `kv_frames` the slots it imports as frames."""
        rows = [row_input(p) for p in plan.rows]
        slot = self.client.next_slot()
        dims = self.client.arenas[slot].write_step(rows, self.cfg.block_size)
        step = InFlight(plan, slot, 0.0, 0.0)
        grammars, histories = admitted_state(plan, self.sched.spec is not None)
        if histories:
            extra = {**(extra or {}), "histories": histories}
        self.client.send_step(dims, free=plan.freed, has_prefill=plan.has_prefill, slot=slot, tag=step,
                              grammars=grammars, extra=extra, kv_frames=kv_frames)
        self.sent_at = step.sent_at = time.monotonic()
        step.prepare_s = self.sent_at - planned_at

    def ping_if_due(self, now: float) -> None:
        """Idle heartbeat: keeps remote agents attached and finds a dead or stopped one while idle.
        A local agent's death, or its launcher's (it exits when idle), is seen at once, between
        heartbeats: /health follows within an engine turn (raises AgentDead)."""
        self.client.check_alive()
        if self.orphaned() is not None:
            raise AgentDead("its launcher is gone")
        if now - self.sent_at >= self.cfg.heartbeat_s:
            self.client.send_heartbeat()
            self.sent_at = now

    def poll(self, timeout_s: float) -> StepReply | None:
        """The reply to the oldest step in flight, or None (none yet, or a heartbeat's). Raises
        AgentDead/AgentError."""
        if self.ping_pending:
            reply = self.client.poll(timeout_s)
            if reply is not None:
                info = AgentInfo.from_wire(reply[0])
                if info.server_pid != os.getpid():  # `r` from another server took the agent
                    raise AgentError("the agent no longer serves this server (reset by another)", E_NOT_ATTACHED)
                self.memory.note(info.rss_bytes)
            return None
        return self.client.poll_step(timeout_s)

    def stuck(self, now: float) -> bool:
        """No reply for step_timeout_s since the agent could start the oldest command in flight."""
        if self.inflight:
            return now - max(self.inflight[0].sent_at, self.replied_at) > self.cfg.step_timeout_s
        return self.ping_pending and now - self.sent_at > self.cfg.step_timeout_s

    def orphaned(self) -> int | None:
        """The pid of this local agent's launcher if that process is gone (no restart will come)."""
        launcher = self.client.info.launcher_pid
        if self.client.local and launcher and not pid_alive(int(launcher)):
            return int(launcher)
        return None

    def go_down(self, why: str, now: float, kill: bool = True) -> list[Sequence]:
        """The agent is gone or stuck (`kill`: kill what is left of it), or serves another server
        now (attach again later, never restart); start an empty KV pool. Returns every sequence
        the lane held (to recompute), those of its steps in flight included."""
        if self.handover is not None:  # the agent is gone: the hand-overs its steps in flight carried go nowhere
            for step in self.inflight:
                for p in step.plan.rows:
                    self.handover.give(p.seq.handover)
        seqs = self.sched.drain()
        self.sched = self._scheduler()
        if kill:
            self.client.kill()
        self.client.close(detach=False)
        self.state, self.down_since, self.why, self.reattach = LaneState.RECOVERING, now, why, not kill
        return seqs

    def orphan(self, launcher: int) -> None:
        self.state, self.why = LaneState.ORPHANED, f"its launcher (pid {launcher}) is gone; start launch_agents again"

    def fail(self) -> None:
        """Down for good: restarts exhausted or not allowed."""
        self.state = LaneState.FAILED

    def replied(self, now: float) -> float:
        """A reply came `now`; returns when the agent started the step it answers (it ran the one
        before until that one's reply)."""
        start, self.replied_at = self.replied_at, now
        return start

    def attach(self, client: AgentLink) -> None:
        self.client, self.state, self.sent_at = client, LaneState.LIVE, time.monotonic()
        self.graph_compiles = 0  # a new process
        self.memory.attached(client.info)
        self.sched.spec = SpecPolicy(self.cfg) if speculates(client, self.cfg) else None  # as the new agent drafts

    def new_compiles(self, n: int) -> int:
        """Graphs the agent built since its last reply, of the `n` it has built (per process)."""
        delta, self.graph_compiles = max(0, n - self.graph_compiles), max(n, self.graph_compiles)
        return delta


def lanes_stats(lanes: list[AgentLane]) -> dict[str, Any]:
    """What the lanes hold: running and waiting sequences, live agents, each KV pool's use, each
    agent's device and memory."""
    return {"running": sum(lane.sched.active for lane in lanes),
            "waiting": sum(len(lane.sched.waiting) for lane in lanes),
            "agents_alive": sum(lane.live for lane in lanes),
            "kv_usage": [round(lane.sched.blocks.usage(), 4) for lane in lanes],
            "cached_blocks": [len(lane.sched.blocks.by_hash) for lane in lanes],  # prefix-cache blocks each holds
            "draining": [lane.sched.moves.draining for lane in lanes],
            "devices": [f"{lane.client.info.device}:{lane.client.info.device_id}" for lane in lanes],
            "memory": [{**lane.client.info.memory(), "rss_bytes": lane.memory.rss_bytes} for lane in lanes]}
