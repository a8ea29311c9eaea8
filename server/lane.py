"""One agent lane: an agent's connection, its scheduler (its KV pool) and its life cycle.

LIVE lanes run steps and send a heartbeat when idle; a lane whose agent died or got stuck is
RECOVERING (its sequences wait in a fresh scheduler, as the new agent's cache is empty) until the
engine's restart brings a new agent, or FAILED after too many restarts in a row.
"""
from __future__ import annotations

import enum
import os
import time

import numpy as np

from common.config import ServingConfig
from server.scheduler import Planned, Scheduler, Sequence
from shm.protocol import E_NOT_ATTACHED
from shm.step import RowInput
from shm.transport import AgentClient, AgentError


class LaneState(enum.Enum):
    LIVE = "live"
    RECOVERING = "recovering"
    FAILED = "failed"


class AgentLane:
    def __init__(self, index: int, client: AgentClient, cfg: ServingConfig):
        self.index, self.client, self.cfg = index, client, cfg
        self.sched = Scheduler(cfg)
        self.state = LaneState.LIVE
        self.inflight: list[Planned] | None = None  # the step awaiting its reply
        self.sent_at = time.monotonic()  # when the command in flight (or the last one) was sent
        self.ping_pending = False
        self.pending_free: list[int] = []  # finished sequence ids, told to the agent with the next step
        self.restarts = 0  # restarts in a row, reset by a successful step
        self.graph_compiles = 0  # graphs this lane's agent process has built, as it last said
        self.down_since = 0.0
        self.why = ""

    @property
    def live(self) -> bool:
        return self.state is LaneState.LIVE

    @property
    def busy(self) -> bool:
        return self.inflight is not None or self.ping_pending

    def send_plan(self, plan: list[Planned]) -> None:
        """Write the step into the arena and send it (raises AgentDead)."""
        rows = [RowInput(p.seq.seq_id, np.asarray(p.seq.tokens[p.seq.computed:p.seq.computed + p.n_tokens], np.int32),
                         p.seq.computed, p.seq.table, p.sample, p.seq.params, len(p.seq.prompt), len(p.seq.output))
                for p in plan]
        has_prefill = any(p.n_tokens > 1 or p.seq.computed < len(p.seq.prompt) for p in plan)
        self.inflight = plan  # before sending: a dead agent's step is recomputed elsewhere
        dims = self.client.arena.write_step(rows, self.cfg.block_size)
        self.client.send_step(dims, free=self.pending_free, has_prefill=has_prefill)
        self.pending_free = []
        self.sent_at = time.monotonic()

    def ping_if_due(self, now: float) -> None:
        """Idle heartbeat: keeps remote agents attached and finds a dead or stopped one while idle."""
        if now - self.sent_at >= self.cfg.heartbeat_s:
            self.client.send_heartbeat()
            self.ping_pending, self.sent_at = True, now

    def poll(self, timeout_s: float) -> dict | None:
        """The reply to the step in flight, or None (none yet, or a heartbeat's). Raises AgentDead/AgentError."""
        if self.ping_pending:
            try:
                reply = self.client.poll(timeout_s)
            except AgentError:
                self.ping_pending = False
                raise
            if reply is not None:
                self.ping_pending = False
                if reply[0].get("server_pid") != os.getpid():  # `r` from another server took the agent
                    raise AgentError("the agent no longer serves this server (reset by another)", E_NOT_ATTACHED)
            return None
        return self.client.poll_step(timeout_s)

    def stuck(self, now: float) -> bool:
        return self.busy and now - self.sent_at > self.cfg.step_timeout_s

    def go_down(self, why: str, now: float, kill: bool = True) -> tuple[list[Planned], list[Sequence]]:
        """The agent is gone or stuck (`kill`: kill what is left of it), or serves another server
        now; start an empty KV pool. Returns the step in flight and every sequence the lane held
        (to recompute)."""
        plan = self.inflight or []
        self.inflight, self.ping_pending, self.pending_free = None, False, []
        seqs = self.sched.drain()
        self.sched = Scheduler(self.cfg)
        if kill:
            self.client.kill()
        self.client.close(detach=False)
        self.state, self.down_since, self.why = LaneState.RECOVERING, now, why
        return plan, seqs

    def attach(self, client: AgentClient) -> None:
        self.client, self.state, self.sent_at = client, LaneState.LIVE, time.monotonic()
        self.graph_compiles = 0  # a new process

    def new_compiles(self, reply: dict) -> int:
        """Graphs the agent built since its last reply (its count is per process)."""
        n = int(reply.get("graph_compiles", self.graph_compiles))
        delta, self.graph_compiles = max(0, n - self.graph_compiles), max(n, self.graph_compiles)
        return delta
