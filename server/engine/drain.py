"""Draining an agent live (`POST /admin/agents/{port}/drain`): every sequence it holds moves to the
other agents with its KV (server/engine/handover.py), those it has not started are queued elsewhere,
and nothing new is scheduled there, so a rolling restart drops no request and computes nothing
again. A drained agent takes work again when it restarts (a fresh agent) or on `.../resume`."""
from __future__ import annotations

import queue
from concurrent.futures import Future
from typing import Any

from common.config import ServingConfig
from common.config_values import Role
from server.engine.lane import AgentLane, LaneState
from server.engine.messages import AgentBack, Drain, Message
from server.engine.supervisor import Supervisor


class DrainError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Drains:
    """Drains as a hook between steps (server/engine/hooks.py): asked through the engine's inbox,
    started there (`start`), answered by a turn once their agent holds nothing."""

    def __init__(self, cfg: ServingConfig, lanes: list[AgentLane], supervisor: Supervisor, can_move: str | None,
                 inbox: "queue.Queue[Message] | None" = None):
        """`can_move`: None where KV can move between these agents, else why not."""
        self.cfg, self.lanes, self.supervisor, self.can_move, self.inbox = cfg, lanes, supervisor, can_move, inbox
        # lane -> (the Futures of the drains asked of it, its scheduler's moved count then): a second
        # drain of a draining agent shares the first's answer
        self.pending: dict[int, tuple[list[Future], int]] = {}
        self.armed = False  # a drain waits for its agent to empty: a turn between steps (server/engine/hooks.py)

    def ask(self, port: int, resume: bool = False) -> Future:
        """(any thread) Move every sequence of the agent on `port` to the others with its KV and schedule
        nothing more there (`resume`: schedule there again). The Future's result says what moved, or
        its exception (DrainError) why not."""
        done: Future = Future()
        self.inbox.put(Drain(port, resume, done))
        return done

    def holds_steps(self) -> bool:
        return False

    def agent_back(self, msg: AgentBack) -> None:  # a restarted agent is undrained by the supervisor
        pass

    def _lane(self, port: int) -> AgentLane:
        ports = self.cfg.agent_ports
        if port not in ports:
            raise DrainError(404, f"no agent on port {port} (serving_config.agent_ports: {ports})")
        group = next(i for i, g in enumerate(self.cfg.groups) if ports.index(port) in g)
        if ports[self.cfg.groups[group][0]] != port:
            raise DrainError(400, f"port {port} is a tensor-parallel rank > 0: drain its group's first port")
        return self.lanes[group]

    def start(self, msg: Drain) -> None:
        try:
            lane = self._lane(msg.port)
            if msg.resume:
                self._resume(lane, msg.done)
                return
            if lane.index in self.pending:
                self.pending[lane.index][0].append(msg.done)
                return
            if lane.state is not LaneState.LIVE:
                raise DrainError(409, f"agent {lane.index} (port {msg.port}) is {lane.state.value} ({lane.why}): its "
                                      "sequences were computed again elsewhere, and it takes work again when it is back")
            why = self.can_move or self._refusal(lane)
            if why:
                raise DrainError(409, why)
        except DrainError as exc:
            msg.done.set_exception(exc)
            return
        lane.sched.moves.draining = True
        self.pending[lane.index] = ([msg.done], lane.sched.moves.moved)
        self.armed = True
        for req in [seq.request for seq in lane.sched.evicted()]:  # not started: queued elsewhere
            self.supervisor.recompute(req)

    def _resume(self, lane: AgentLane, done: Future) -> None:
        """Schedule there again; a drain still moving its sequences ends, saying what it moved."""
        lane.sched.moves.draining = False
        self.turn()
        done.set_result({"port": self._port(lane), "draining": False})

    def _refusal(self, lane: AgentLane) -> str | None:
        """Why the other agents could not take over (None: they can)."""
        others = [o for o in self.lanes if o is not lane and o.live and not o.sched.moves.draining]
        if not any(o.sched.role != Role.DECODE for o in others) or not any(o.sched.role != Role.PREFILL for o in others):
            return (f"agent {lane.index} (port {self._port(lane)}) is needed: "
                    "no other live agent would take its prompts or its decodes")
        return None

    def turn(self) -> None:
        """Drains whose agent holds nothing now, was resumed, or went down meanwhile are done."""
        for index, (waiting, moved) in list(self.pending.items()):
            lane = self.lanes[index]
            if lane.sched.moves.draining and lane.live and (lane.sched.load or lane.busy):
                continue
            del self.pending[index]
            for done in waiting:
                done.set_result(self._result(lane, moved))
        self.armed = bool(self.pending)

    def waiting(self) -> int:
        """Drain requests not answered yet (/stats)."""
        return sum(len(futures) for futures, _ in self.pending.values())

    def draining(self) -> list[int]:
        """The ports of the agents drained now (nothing is scheduled there)."""
        return [self._port(lane) for lane in self.lanes if lane.sched.moves.draining]

    def _port(self, lane: AgentLane) -> int:
        return self.cfg.agent_ports[self.cfg.groups[lane.index][0]]

    def _result(self, lane: AgentLane, moved: int) -> dict[str, Any]:
        out = {"port": self._port(lane), "draining": lane.sched.moves.draining, "state": lane.state.value,
               "moved": lane.sched.moves.moved - moved}
        if not lane.live:
            out["note"] = (f"the agent went down during the drain ({lane.why}); the sequences it still held were "
                           "computed again elsewhere")
        elif not lane.sched.moves.draining:
            out["note"] = "resumed before the drain finished: it schedules again, and keeps what it still held"
        return out
