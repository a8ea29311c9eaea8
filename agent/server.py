"""The agent's protocol server: one attached server at a time, its step commands (`*`, `a`) run on
the model runner, attach `#`, detach `e`, reset `r`, heartbeats, LoRA slots `l`; the failure replies of
shm.protocol. agent/main.py boots the process and hands it a loaded runner."""
from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import zmq

from agent.handover import Handovers
from agent.lora import load_into_slot
from common.lora import AdapterError
from agent.runner_config import graph_for
from common.procs import pid_alive, rss_bytes
from shm import protocol as P
from shm.arena import Arena, ArenaSpec, Segment
from shm.curve import KeyFolder
from shm.messages import AgentInfo, StepReply
from shm.step import check_decode, check_indices
from shm.transport import load_step_frames, step_header_dims

if TYPE_CHECKING:  # MindSpore: the runner is built once the process is pinned (agent/main.py)
    from agent.runner import ModelRunner

log = logging.getLogger("llm_serving.agent")
IDLE_POLL_MS = 500
# A tcp server that sent nothing (its idle heartbeats included) this long is gone.
REMOTE_IDLE_TIMEOUT_S = float(os.environ.get("LLM_SERVING_REMOTE_IDLE_S", 30.0))


class RuntimeFailure(RuntimeError):
    """The model step itself raised: MindSpore may now fail every later step ("an error occurred in
    the previous step"), so the agent replies, exits, and is restarted by its supervisor."""


class CommandError(RuntimeError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def check_identity(info: AgentInfo, h: dict[str, Any]) -> None:
    """A server may attach only with our KV geometry and model (the name is informational)."""
    for key, names in (("geometry", P.GEOMETRY_KEYS), ("model", P.MODEL_KEYS)):
        for name in names:
            ours, theirs = getattr(info, key)[name], h[key][name]
            if name == "name" or (name == "num_blocks" and theirs == 0):  # 0: the server takes our pool (auto)
                continue
            if ours != theirs:
                raise CommandError(P.E_MISMATCH, f"{key} mismatch: server has {name}={theirs!r}, agent has "
                                                 f"{name}={ours!r} (start both from the same YAML and model)")


def read_step(arena: Arena, msg: P.Message, dims: Any, runner: "ModelRunner", local: bool) -> tuple[Any, list, int]:
    """A step command's view of its arena slot, checked (ids, blocks, positions; a decode's rows), its
    KV frames (a tcp agent's, after the step's tensors) and the token bucket whose graph runs it."""
    if not arena.spec.fits(dims):
        raise CommandError(P.E_BAD_STEP, f"step {dims} exceeds the arena {arena.spec}")
    try:
        kv_frames = msg.frames if local else load_step_frames(arena, msg)
        v = arena.step(dims)
        rc = runner.rc
        check_indices(v, runner.cfg.vocab_size, rc.num_blocks, rc.block_size, rc.max_model_len)
        if msg.cmd == P.DECODE_STEP:
            check_decode(v)
        return v, kv_frames, graph_for(v.inputs, rc)[0]
    except (ValueError, OSError) as exc:
        raise CommandError(P.E_BAD_STEP, str(exc)) from None


class AgentServer:
    """Serves one server at a time: `#` attaches it (bound to its ZeroMQ routing id), `e` or its
    death detaches it, `r` detaches whoever is attached. The agent itself runs until SIGTERM, until
    the process that launched it (`owner_pid`) is gone, or after a fatal step."""

    def __init__(self, address: str, runner: "ModelRunner", info: AgentInfo, owner_pid: int | None = None,
                 curve: KeyFolder | None = None):
        """`curve`: keys for a tcp agent (shm/curve.py): only listed servers get through."""
        self.address, self.runner, self.info, self.owner_pid, self.curve = address, runner, info, owner_pid, curve
        self.arenas: list[Arena] = []  # the attached server's arena slots
        self.segment: Segment | None = None
        self.peer: bytes | None = None  # routing id of the attached server
        self.server_pid: int | None = None
        self.last_msg = time.monotonic()  # from the attached server
        self.exiting, self.failed = False, False  # failed: exited after a RuntimeFailure
        self.handovers = Handovers(runner)  # KV blocks in and out through the server's hand-over segment

    # ------------------------------------------------------------ attachment
    def _attached_to_live_server(self) -> bool:
        if not self.arenas:
            return False
        if self.segment is not None:  # a local server: its pid says
            return self.server_pid is not None and pid_alive(self.server_pid)
        return time.monotonic() - self.last_msg < REMOTE_IDLE_TIMEOUT_S

    def _detach(self, server_dead: bool = False) -> None:
        """Forget the attached server; a dead local server's arena segment is unlinked too (nobody
        else would: its creator is gone)."""
        if self.arenas:
            log.info("server pid %s detached", self.server_pid)
        self.arenas = []
        if self.segment is not None:
            self.segment.close()
            if server_dead:
                self.segment.path.unlink(missing_ok=True)
            self.segment = None
        self.peer = self.server_pid = None
        self.handovers.close()
        self.runner.reset()

    def _attach(self, peer: bytes, h: dict[str, Any]) -> dict[str, Any]:
        if self._attached_to_live_server() and peer != self.peer:
            raise CommandError(P.E_BUSY, f"attached to server pid {self.server_pid}; send r to take the agent over")
        check_identity(self.info, h)
        self._detach(server_dead=self.segment is not None and not self._attached_to_live_server())
        spec = ArenaSpec.from_wire(h["spec"])
        if h["arena"]:
            self.segment = Segment(h["arena"])
        self.arenas = Arena.slots(spec, self.segment.buf if self.segment else None)
        self.peer, self.server_pid, self.last_msg = peer, h["server_pid"], time.monotonic()
        log.info("server pid %d attached", self.server_pid)
        return self._status()

    def _status(self) -> dict[str, Any]:
        return replace(self.info, pid=os.getpid(), rss_bytes=rss_bytes(), attached=bool(self.arenas), server_pid=self.server_pid,
                       graph_compiles=self.runner.graph_compiles, protocol=P.VERSION).to_wire()

    # ------------------------------------------------------------ commands
    def _step(self, peer: bytes, msg: P.Message) -> tuple[dict[str, Any], list[bytes]]:
        t0 = time.perf_counter()
        if not self.arenas or peer != self.peer:
            raise CommandError(P.E_NOT_ATTACHED, "step from a server that is not attached (send # first)")
        h = msg.header
        dims = step_header_dims(h)
        if not h["slot"] < len(self.arenas):
            raise CommandError(P.E_BAD_STEP, f"slot {h['slot']} outside the arena's {len(self.arenas)}")
        arena = self.arenas[h["slot"]]
        v, kv_frames, graph_tokens = read_step(arena, msg, dims, self.runner, local=self.segment is not None)
        moves = bool(h.get("import") or h.get("export"))  # KV blocks in or out with this step (agent/handover.py)
        try:
            if moves or kv_frames:
                self.handovers.check(h, kv_frames)
        except (ValueError, OSError) as exc:
            raise CommandError(P.E_BAD_STEP, str(exc)) from None
        try:
            if moves:
                self.handovers.imports(h)
            model_s = self.runner.step(v, h["free"], h.get("grammars", []), h.get("histories", []))
            kv_out = self.handovers.exports(h) if moves else []
        except Exception as exc:
            raise RuntimeFailure(f"{type(exc).__name__}: {exc}") from exc
        frames = ([] if self.segment is not None else arena.output_frames(dims)) + kv_out
        return StepReply(model_s, time.perf_counter() - t0, graph_tokens, self.runner.graph_compiles,
                         rss_bytes(), self.handovers.seconds if moves else 0.0).to_wire(), frames

    def _load_adapter(self, peer: bytes, h: dict[str, Any]) -> dict[str, Any]:
        """`l`: the PEFT folder at `path` (None: nothing) into LoRA slot `slot`, from the next step on."""
        if peer != self.peer:
            raise CommandError(P.E_NOT_ATTACHED, "l from a server that is not attached (send # first)")
        try:
            return load_into_slot(self.runner, h["slot"], h["name"], h["path"])
        except (AdapterError, ValueError, OSError) as exc:
            raise CommandError(P.E_FAILED, str(exc)) from None

    def handle(self, peer: bytes, parts: list[bytes]) -> list[bytes]:
        """Never raises: malformed input or a failed command becomes an error reply."""
        try:
            msg = P.decode(parts)
        except P.ProtocolError as exc:
            return P.error_reply(P.E_PROTOCOL, f"protocol: {exc}", exc.msg_id)
        mid = msg.header.get("id")
        if peer == self.peer:
            self.last_msg = time.monotonic()
        try:
            frames: list[bytes] = []
            if msg.cmd == P.HANDSHAKE:
                body = self._attach(peer, msg.header)
            elif msg.cmd in P.STEP_COMMANDS:
                body, frames = self._step(peer, msg)
            elif msg.cmd == P.LOAD_ADAPTER:
                body = self._load_adapter(peer, msg.header)
            elif msg.cmd == P.RESET or (msg.cmd == P.DETACH and peer == self.peer):
                self._detach()
                body = {}
            elif msg.cmd == P.DETACH:  # from a server that is not attached: nothing to do
                body = {}
            else:  # heartbeat
                body = self._status()
            return P.encode_reply(True, {**body, "id": mid}, frames)
        except CommandError as exc:
            log.warning("command %r refused: %s", msg.cmd, exc)
            return P.error_reply(exc.code, str(exc), mid)
        except RuntimeFailure as exc:
            log.error("model step failed; exiting for a restart: %s", exc)
            self.exiting = self.failed = True
            return P.error_reply(P.E_FATAL, str(exc), mid)
        except Exception as exc:  # the agent keeps serving; the server decides what fails
            log.warning("command %r failed: %s", msg.cmd, exc)
            log.debug("%s", traceback.format_exc())
            return P.error_reply(P.E_FAILED, f"{type(exc).__name__}: {exc}", mid)

    def serve(self) -> None:
        sock, auth = _bound_router(self.address, self.curve)
        log.info("agent ready on %s", self.address)
        try:
            while not self.exiting:
                if sock.poll(IDLE_POLL_MS):  # blocks: no busy-spin while idle
                    peer, *parts = sock.recv_multipart()
                    sock.send_multipart([peer, *self.handle(peer, parts)])
                elif self.owner_pid and not pid_alive(self.owner_pid):
                    log.info("launcher pid %d is gone; exiting", self.owner_pid)
                    break
                elif self.arenas and not self._attached_to_live_server():
                    log.info("server pid %s went away without detaching", self.server_pid)
                    self._detach(server_dead=True)
        finally:
            self._detach()
            sock.close(0)
            if auth is not None:
                auth.stop()


def _bound_router(address: str, curve: KeyFolder | None) -> tuple[zmq.Socket, Any]:
    """The agent's socket, bound; with CURVE keys on tcp, (its authenticator) lets only listed servers in."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # A server's client reconnecting (same routing id) before its old connection's end reached us:
    # the new one takes over (ZeroMQ would otherwise drop its messages, and its handshake would hang).
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    auth = curve.serve(ctx, sock) if curve is not None and address.startswith("tcp://") else None
    old = os.umask(0o077)  # an ipc socket file owner-only (0600): no other uid may connect and send `r`
    try:
        sock.bind(address)
    finally:
        os.umask(old)
    return sock, auth
