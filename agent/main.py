"""Agent process: owns one device's model and KV cache and serves step commands over ZeroMQ.

Module import stays light (no mindspore) so the launcher can name `agent_process` as a spawn target.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq

from common.procs import pid_alive
from shm import protocol as P
from shm.arena import Arena, ArenaSpec, Segment
from common.cpu import describe
from shm.curve import INSECURE_ENV, KeyFolder, exposure
from shm.endpoint import PortInUse, PortLock, agent_address
from shm.messages import AgentInfo, StepReply
from shm.step import StepDims, check_decode, check_indices
from shm.transport import load_step_frames

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


class AgentServer:
    """Serves one server at a time: `#` attaches it (bound to its ZeroMQ routing id), `e` or its
    death detaches it, `r` detaches whoever is attached. The agent itself runs until SIGTERM, until
    the process that launched it (`owner_pid`) is gone, or after a fatal step."""

    def __init__(self, address: str, runner: Any, info: AgentInfo, owner_pid: int | None = None,
                 curve: KeyFolder | None = None):
        """`curve`: keys for a tcp agent (shm/curve.py): only listed servers get through."""
        self.address, self.runner, self.info, self.owner_pid = address, runner, info, owner_pid
        self.curve = curve
        self.arenas: list[Arena] = []  # the attached server's arena slots
        self.segment: Segment | None = None
        self.peer: bytes | None = None  # routing id of the attached server
        self.server_pid: int | None = None
        self.last_msg = time.monotonic()  # from the attached server
        self.exiting = False
        self.failed = False  # exited after a RuntimeFailure

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
        return replace(self.info, pid=os.getpid(), attached=bool(self.arenas), server_pid=self.server_pid,
                       graph_compiles=self.runner.graph_compiles, protocol=P.VERSION).to_wire()

    # ------------------------------------------------------------ commands
    def _step(self, peer: bytes, msg: P.Message) -> tuple[dict[str, Any], list[bytes]]:
        t0 = time.perf_counter()
        if not self.arenas or peer != self.peer:
            raise CommandError(P.E_NOT_ATTACHED, "step from a server that is not attached (send # first)")
        h = msg.header
        dims = StepDims(h["n_tokens"], h["n_rows"], h["width"])
        if not h["slot"] < len(self.arenas):
            raise CommandError(P.E_BAD_STEP, f"slot {h['slot']} outside the arena's {len(self.arenas)}")
        arena = self.arenas[h["slot"]]
        if not arena.spec.fits(dims):
            raise CommandError(P.E_BAD_STEP, f"step {dims} exceeds the arena {arena.spec}")
        try:
            if self.segment is None:
                load_step_frames(arena, msg)
            v = arena.step(dims)
            rc = self.runner.rc
            check_indices(v, self.runner.cfg.vocab_size, rc.num_blocks, rc.block_size, rc.max_model_len)
            if msg.cmd == P.DECODE_STEP:
                check_decode(v)
            graph_tokens, _ = self.runner.graph_for(v.inputs)
        except ValueError as exc:
            raise CommandError(P.E_BAD_STEP, str(exc)) from None
        try:
            model_s = self.runner.step(v, h["free"])
        except Exception as exc:
            raise RuntimeFailure(f"{type(exc).__name__}: {exc}") from exc
        frames = [] if self.segment is not None else arena.output_frames(dims.n_rows)
        return StepReply(model_s, time.perf_counter() - t0, graph_tokens, self.runner.graph_compiles).to_wire(), frames

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
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        auth = self.curve.serve(ctx, sock) if self.curve is not None and self.address.startswith("tcp://") else None
        old = os.umask(0o077)  # an ipc socket file owner-only (0600): no other uid may connect and send `r`
        try:
            sock.bind(self.address)
        finally:
            os.umask(old)
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


def _pin(index: int, n_agents: int, cores: list[list[int]]) -> None:
    """MindSpore collapses when another busy process shares its cores: give each agent its own."""
    avail = sorted(os.sched_getaffinity(0))
    if cores and index < len(cores):
        want = cores[index]
    elif n_agents > 1:
        want = [avail[index % len(avail)]]
    else:
        want = avail
    os.sched_setaffinity(0, [c for c in want if c in avail] or avail)


def _exit_once(*_: Any) -> None:
    """SIGTERM: exit cleanly (the arena is unlinked on the way out). The launcher and the shell
    may both send one; a second landing inside the exit handlers printed a SystemExit traceback."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(0)


def agent_process(config_path: str | None, index: int, overrides: dict[str, Any], owner_pid: int | None = None,
                  tp_link: str | None = None) -> None:
    """Spawn target: take the port, load the model (its rank's share with tensor_parallel_size > 1,
    meeting the other ranks where the launcher's `tp_link` says) for device `start_device_id +
    index`, then serve until SIGTERM or until `owner_pid` (the launcher) is gone."""
    logging.basicConfig(level=os.environ.get("LLM_SERVING_LOG", "INFO"),
                        format=f"%(asctime)s agent{index} %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _exit_once)
    if not os.path.isfile(sys.argv[0]):  # a spawn of `python -c` (pytest-xdist's workers): MindSpore's compile
        sys.argv[0] = __file__  # cache reads the entry script, named by sys.argv[0] when mindspore is imported
    from common.config import load_config

    cfg = load_config(config_path, **overrides)
    port = cfg.agent_ports[index]
    keys = KeyFolder.find(cfg.curve_keys)
    refusal, warning = exposure(cfg.bind_host(index), keys, bool(os.environ.get(INSECURE_ENV)))
    if refusal:
        log.error("%s", refusal)
        sys.exit(6)
    if warning:
        log.warning("%s", warning)
    try:  # before the model loads: a second agent on a busy port fails in a moment
        lock = PortLock(port)
    except PortInUse as exc:
        log.error("%s", exc)
        sys.exit(4)
    log_path = _quiet_console(port)
    try:
        _serve(cfg, index, owner_pid, tp_link)
    except Exception as exc:  # one line on the console; the traceback goes to the log
        log.error("agent %d failed: %s: %s%s", index, type(exc).__name__, exc,
                  f" (details: {log_path})" if log_path else "")
        log.debug("%s", traceback.format_exc())
        if log_path:
            traceback.print_exc()
        sys.exit(5)
    finally:
        lock.release()


def _quiet_console(port: int) -> Path | None:
    """MindSpore writes its own C++ log (compile-cache checks, "side effect nodes eliminated", ...)
    to file descriptor 2, whatever GLOG says: point fd 2 at a log file per agent and keep our own
    lines on the console (and in that file). `LLM_SERVING_VERBOSE=1` (`--verbose`) changes nothing."""
    if os.environ.get("LLM_SERVING_VERBOSE"):
        return None
    # Named by port: the port lock makes it this agent's alone (agent indexes repeat across deployments).
    path = Path(os.environ.get("LLM_SERVING_LOG_DIR", Path.home() / ".cache/llm-serving/logs")) / f"agent-{port}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(console)
    file_handler = logging.StreamHandler(sys.stderr)  # now the log file
    file_handler.setFormatter(root.handlers[0].formatter if root.handlers else None)
    root.addHandler(file_handler)
    log.info("MindSpore's own log: %s", path)
    return path


def activation_estimate(model_cfg: Any, cfg: Any) -> int:
    """The memory plan's activation bytes for this model and the largest step (common/memory.py)."""
    from common.memory import ModelShape, activation_bytes

    m = model_cfg
    shape = ModelShape(m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads,
                       m.head_dim)
    return activation_bytes(shape, cfg.token_buckets[-1], cfg.max_rows)


def _serve(cfg: Any, index: int, owner_pid: int | None, tp_link: str | None) -> None:
    _pin(index, len(cfg.agent_ports), cfg.agent_cores)
    device_id = cfg.start_device_id + index
    os.environ["LLM_SERVING_DEVICE"] = cfg.device  # read by the native kernels' switch too
    os.environ["DEVICE_ID"] = str(device_id)
    from agent.runner import ModelRunner, RunnerConfig, compile_cache_key, setup_mindspore  # mindspore first
    from agent.tensor_parallel import Group, slot_floats
    from agent.calibrate import CALIBRATION_TEXT
    from agent.weights import load_model
    from common.memory import plan as memory_plan
    from common.model_files import model_identity, resolve_model
    from common.tokenizer import load_tokenizer

    t0 = time.monotonic()
    files = resolve_model(cfg.model_path, cfg.model_cfg_path)
    if not cfg.num_blocks:  # num_blocks: auto and no launcher sized it (an agent started by itself)
        log.info("memory plan:\n%s", memory_plan(cfg, files, 1).describe())
    log.info("loading weights from %s", files.path)
    int8 = cfg.model_dtype == "int8"
    model_cfg, weights = load_model(files, cfg.max_model_len, int8=int8)
    log.info("weights loaded in %.1fs (%d layers, hidden %d, vocab %d)", time.monotonic() - t0,
             model_cfg.num_layers, model_cfg.hidden_size, model_cfg.vocab_size)
    rc = RunnerConfig(num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                      token_buckets=cfg.token_buckets, max_running=cfg.max_running,
                      mixed_tokens=cfg.mixed_step_tokens, prefill_rows=cfg.max_prefill_rows,
                      model_dtype=cfg.model_dtype, kv_cache_dtype=cfg.kv_cache_dtype,
                      int8_group=cfg.quant_group_size, tp=Group())
    tp = cfg.tensor_parallel_size
    if tp > 1:  # rank index % tp of replica index // tp
        kind, _, where = (tp_link or "").partition(":")
        if kind == "shm":
            rc.tp = Group(index % tp, tp, where, slot_floats(model_cfg.hidden_size, model_cfg.vocab_size,
                                                             cfg.token_buckets[-1], cfg.max_rows, tp))
        elif kind == "ms":
            rc.tp = Group(index % tp, tp, sched_port=int(where))
        else:
            raise ValueError("tensor_parallel_size > 1: start the group with launch_agents or llm-serving "
                             "(they make where its ranks meet)")
    # The on-disk cache is only sound for warm-up's fixed compile order (see freeze_compile_cache).
    device, device_id = setup_mindspore(cfg.compile_cache_dir if cfg.warmup else None,
                                        key=compile_cache_key(model_cfg, rc), device_id=device_id)
    log.info("device %s:%d (as MindSpore reports it)", device, device_id)
    calibration = load_tokenizer(files, cfg.tokenizer_path).encode(CALIBRATION_TEXT) if int8 else None
    # The ranks of a group sample alike: one seed per replica.
    runner = ModelRunner(model_cfg, weights, rc, seed=index // tp, calibration=calibration)
    del weights
    log.info("model weights in memory: %.0f MiB (%s%s)", runner.model.weight_bytes / 2**20, cfg.model_dtype,
             f", int8 scale per {cfg.quant_group_size or 'row and token'}" if int8 else "")
    log.info("CPU: %s; kernels: %s", describe(), runner.kernel_paths)
    if cfg.warmup:
        runner.warmup()
    log.info("model loaded and compiled in %.1fs", time.monotonic() - t0)
    info = AgentInfo(model_cfg.vocab_size, list(model_cfg.eos_token_ids), cfg.geometry,
                     model_identity(cfg.model_name, files), device, device_id, cfg.model_dtype,
                     runner.model.weight_bytes, runner.model.streamed_bytes, runner.model.kv_cache_bytes,
                     runner.kv_dtype, activation_estimate(model_cfg, cfg), runner.kernel_paths,
                     launcher_pid=owner_pid,  # a server attached to us sees whether anyone will restart us
                     tp_rank=rc.tp.rank, tp_size=rc.tp.size, pads_cost=not runner.model.one_op_stack)
    server = AgentServer(agent_address(cfg.agent_ports[index], cfg.bind_host(index)), runner, info, owner_pid,
                         KeyFolder.find(cfg.curve_keys))
    server.serve()
    if server.failed:
        sys.exit(3)
