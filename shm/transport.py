"""ZeroMQ transport between the server (DEALER) and an agent (ROUTER).

A local agent (``ipc://``) gets tensors through the shared-memory arena; a remote agent (``tcp://``)
gets the same arena fields as extra frames. Every call has a deadline, and a dead agent is noticed
within a poll interval (its pid for local agents, the socket's disconnect event for all).
"""
from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.procs import pid_alive
from shm import protocol as P
from shm.arena import Arena, ArenaSpec, Segment, segment_name
from shm.curve import KeyFolder
from shm.messages import AgentInfo, StepReply
from shm.step import StepDims

POLL_MS = 100


class AgentError(RuntimeError):
    """The agent answered a command with an error (`code`: one of protocol.E_*). A fatal one means
    the agent's runtime is no longer usable (it exits after this reply and must be restarted)."""

    def __init__(self, message: str, code: str = P.E_FAILED):
        super().__init__(message)
        self.code = code

    @property
    def fatal(self) -> bool:
        return self.code == P.E_FATAL


class AgentDead(RuntimeError):
    """The agent process is gone or its connection dropped."""


@dataclass
class Pending:
    """A command sent and awaiting its reply."""
    msg_id: int
    dims: StepDims  # a step's (zero for other commands)
    slot: int  # a step's arena slot
    tag: Any = None  # what the caller sent a step with (the engine's plan): the one record of steps in flight


PROC_CHECK_S = 0.05  # how stale a local agent's process state may be (its socket's events come at once)


class Liveness:
    """Whether an agent is still there: its socket's connect/disconnect events and, for a local
    agent, its process."""

    def __init__(self, sock: zmq.Socket, address: str):
        self.address = address
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        self.connected = False
        self.dead = False
        self.proc_read_at = -PROC_CHECK_S  # the last /proc read of the agent's state

    def check(self, pid: int | None, local: bool) -> None:
        """Raises AgentDead if the agent is gone: a monitor poll each time, and a /proc read at most
        every PROC_CHECK_S (read on every poll, it was a tenth of the engine thread's time with 16
        agents replying at once: tools/bench_ceiling.py)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.dead = True
        now = time.monotonic()
        if pid and local and now - self.proc_read_at >= PROC_CHECK_S:
            self.proc_read_at = now
            self.dead = self.dead or not pid_alive(pid)
        if self.dead:
            raise AgentDead(f"agent at {self.address} is gone")

    def close(self, sock: zmq.Socket) -> None:
        sock.disable_monitor()
        self.monitor.close(0)


def _arenas(spec: ArenaSpec, tag: str, local: bool, lead: "AgentClient | None") -> tuple[Segment | None, list[Arena]]:
    """The client's shared-memory segment (local agents only: a tcp agent's arena is private, its
    tensors go as frames) and arena slots; a tensor-parallel rank > 0 shares its lead's."""
    if lead is not None:
        return lead.segment, lead.arenas
    segment = Segment(segment_name(tag), spec.size, create=True) if local else None
    return segment, Arena.slots(spec, segment.buf if segment else None)


def _dealer(tag: str, curve: KeyFolder | None) -> zmq.Socket:
    """The client's socket, with a fixed routing id: the agent binds its attachment to it, and it
    survives tcp reconnects. `curve`: keys for a tcp agent."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, f"{os.getpid()}-{tag}".encode())
    if curve is not None:
        curve.client(sock)
    return sock


class AgentClient:
    """Server-side handle of one agent (an AgentLink, shm/link.py). Not thread-safe: one engine
    thread owns it."""

    def __init__(self, address: str, spec: ArenaSpec, tag: str, pid: int | None = None,
                 curve: KeyFolder | None = None, lead: "AgentClient | None" = None):
        """`pid`: the local agent's process if known before the handshake (its port lock's holder),
        so a wait for an agent that dies while loading ends at once. `curve`: keys for a tcp agent.
        `lead`: the client whose arena this agent reads too and whose outputs it leaves alone (a
        tensor-parallel rank > 0: shm/group.py)."""
        self.address, self.spec = address, spec
        self.local = address.startswith("ipc://")
        self.sock = _dealer(tag, None if self.local else curve)
        self.liveness = Liveness(self.sock, address)
        self.sock.connect(address)
        self.owns_segment = lead is None
        self.segment, self.arenas = _arenas(spec, tag, self.local, lead)
        self.pid = pid
        self.info: AgentInfo | None = None  # from the handshake
        self._msg_id = 0
        # Commands awaiting their replies, oldest first. Steps may be pipelined up to one per arena
        # slot (the agent runs them in order); others go alone.
        self._pending: deque[Pending] = deque()
        self.closed = False

    def check_alive(self) -> None:
        self.liveness.check(self.pid, self.local)

    # ------------------------------------------------------------ raw calls
    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def steps(self) -> list[Any]:
        """The tags of the steps in flight, oldest first."""
        return [p.tag for p in self._pending if p.tag is not None]

    def next_slot(self) -> int:
        """The arena slot the next pipelined step goes to."""
        return (self._pending[-1].slot + 1) % len(self.arenas) if self._pending else 0

    def send(self, cmd: bytes, header: dict[str, Any] | None = None, frames: list[bytes] | None = None,
             dims: StepDims = StepDims(0, 0, 0), slot: int = 0, tag: Any = None) -> None:
        step = cmd in P.STEP_COMMANDS
        if self._pending and (not step or len(self._pending) >= len(self.arenas)
                              or any(p.slot == slot for p in self._pending)):
            raise RuntimeError("the command cannot be pipelined behind the ones in flight")
        self.check_alive()
        self._msg_id += 1
        self._pending.append(Pending(self._msg_id, dims, slot, tag))
        self.sock.send_multipart(P.encode(cmd, {**(header or {}), "id": self._msg_id}, frames))

    def poll(self, timeout_s: float) -> tuple[dict[str, Any], list[bytes]] | None:
        """Wait up to timeout_s for the reply to the oldest command in flight; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            wait = max(0.0, min(POLL_MS / 1000, deadline - time.monotonic()))
            if self.sock.poll(int(wait * 1000)):
                ok, body, frames = P.decode_reply(self.sock.recv_multipart(copy=True))
                if not self._pending or body.get("id") != self._pending[0].msg_id:
                    continue  # a late reply to a command we gave up on
                self._pending.popleft()
                if not ok:
                    raise AgentError(str(body.get("error", "agent failed")), str(body.get("code", P.E_FAILED)))
                return body, frames
            if time.monotonic() >= deadline:
                return None

    def call(self, cmd: bytes, header: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        self.send(cmd, header)
        reply = self.poll(timeout_s)
        if reply is None:
            self._pending.clear()
            raise TimeoutError(f"agent at {self.address}: no reply to {cmd!r} within {timeout_s:.0f}s")
        return reply[0]

    # ------------------------------------------------------------ protocol
    def handshake(self, geometry: dict[str, int], model: dict[str, str], timeout_s: float = 600.0) -> AgentInfo:
        """Attach the agent to our arena (waits for it to load). The agent refuses (E_MISMATCH) when
        its KV geometry or model differs from ours, or (E_BUSY) while another live server holds it."""
        body = self.call(P.HANDSHAKE, {"arena": self.segment.name if self.segment else None,
                                       "spec": self.spec.to_wire(), "server_pid": os.getpid(),
                                       "geometry": geometry, "model": model}, timeout_s)
        self.info = AgentInfo.from_wire(body)
        self.pid = self.info.pid
        return self.info

    def send_step(self, dims: StepDims, free: list[int], has_prefill: bool, slot: int = 0, tag: Any = None,
                  grammars: list[list[Any]] | None = None, extra: dict[str, Any] | None = None,
                  kv_frames: list[Any] | None = None) -> None:
        """Inputs must already be in `self.arenas[slot]`; outputs land there when `poll_step` returns
        this step's reply. `has_prefill`: some row carries tokens (`*`), else every row is fed (`a`).
        One step per slot may be in flight; `tag` (not None) is kept with it until its reply (`steps()`);
        `grammars`: the constrained sequences this step (re)admits; `extra`: more header fields (its KV
        hand-over entries: shm/protocol.py); `kv_frames`: the hand-over slots it imports, without a segment."""
        frames = ([] if self.local else self.arenas[slot].input_frames(dims)) + (kv_frames or [])
        header = {"n_tokens": dims.n_tokens, "n_rows": dims.n_rows, "width": dims.width, "slot": slot, "free": free,
                  "n_scored": dims.n_scored, "n_drafts": dims.n_drafts}
        if grammars:
            header["grammars"] = grammars
        header.update(extra or {})
        self.send(P.FULL_STEP if has_prefill else P.DECODE_STEP, header, frames, dims, slot, tag)

    def poll_step(self, timeout_s: float) -> StepReply | None:
        """The reply to the oldest step in flight (its outputs are then in its slot, the slots it
        exported without a segment in `kv_frames`), or None."""
        head = self._pending[0]
        reply = self.poll(timeout_s)
        if reply is None:
            return None
        body, frames = reply
        n = 0 if self.local else self.arenas[head.slot].n_output_frames
        if n and self.owns_segment:  # a group's rank > 0 leaves its lead's outputs alone
            self.arenas[head.slot].load_outputs(head.dims, frames[:n])
        return replace(StepReply.from_wire(body), kv_frames=frames[n:], views=self.arenas[head.slot].full)

    def send_heartbeat(self) -> None:
        self.send(P.HEARTBEAT)

    def kill(self) -> None:
        """SIGKILL a local agent that is stuck (a stopped or hung process answers nothing else)."""
        if self.local and self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self, detach: bool = True, timeout_s: float = 2.0) -> None:
        """Disconnect; with `detach`, first tell the agent (`e`) so it frees our state and waits for
        the next server at once (it would also notice our exit, later)."""
        if self.closed:
            return
        self.closed = True
        self._pending.clear()  # nothing of a closed client is in flight
        if detach and not self.liveness.dead:
            try:
                self.call(P.DETACH, timeout_s=timeout_s)
            except (AgentDead, AgentError, TimeoutError, zmq.ZMQError):
                pass
        self.liveness.close(self.sock)
        self.sock.close(0)
        self.arenas = []  # drop numpy views before unmapping
        if self.segment is not None and self.owns_segment:
            self.segment.close()


def load_step_frames(arena: Arena, msg: P.Message) -> list[bytes]:
    """Agent side, tcp: copy the step's tensor frames into the private arena's slot; returns the
    frames after them (its KV hand-over's)."""
    n = arena.n_input_frames
    arena.load_inputs(step_header_dims(msg.header), msg.frames[:n])
    return msg.frames[n:]


def step_header_dims(h: dict[str, Any]) -> StepDims:
    """A step command's sizes, as its header gives them (shm/protocol.py checked their types)."""
    return StepDims(h["n_tokens"], h["n_rows"], h["width"], h["n_scored"], h["n_drafts"])
