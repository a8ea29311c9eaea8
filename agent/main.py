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
from typing import Any

import numpy as np
import zmq

from shm import protocol as P
from shm.arena import Arena, ArenaSpec, Segment
from shm.transport import _pid_alive, load_step_frames

log = logging.getLogger("llm_serving.agent")
IDLE_POLL_MS = 500
# A tcp server that sent nothing (its idle heartbeats included) this long is gone.
REMOTE_IDLE_TIMEOUT_S = float(os.environ.get("LLM_SERVING_REMOTE_IDLE_S", 30.0))


class RuntimeFailure(RuntimeError):
    """The model step itself raised: MindSpore may now fail every later step ("an error occurred in
    the previous step"), so the agent replies, exits, and is restarted by its supervisor."""


class AgentServer:
    def __init__(self, address: str, runner: Any, info: dict[str, Any]):
        self.address, self.runner, self.info = address, runner, info
        self.arena: Arena | None = None
        self.segment: Segment | None = None
        self.server_pid: int | None = None
        self.last_msg = time.monotonic()
        self.exiting = False
        self.failed = False  # exited after a RuntimeFailure

    # ------------------------------------------------------------ attachment
    def _attached_to_live_server(self) -> bool:
        if self.arena is None:
            return False
        if self.server_pid is not None and self.segment is not None:
            return _pid_alive(self.server_pid)
        return time.monotonic() - self.last_msg < REMOTE_IDLE_TIMEOUT_S

    def _detach(self) -> None:
        self.arena = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.server_pid = None
        self.runner.reset()

    def _attach(self, h: dict[str, Any]) -> dict[str, Any]:
        if self._attached_to_live_server() and h["server_pid"] != self.server_pid:
            raise RuntimeError("already connected to another server")
        self._detach()
        spec = ArenaSpec.from_wire(h["spec"])
        if h["arena"]:
            self.segment = Segment(h["arena"])
            self.arena = Arena(spec, self.segment.buf)
        else:
            self.arena = Arena.private(spec)
        self.server_pid = h["server_pid"]
        return {**self.info, "pid": os.getpid(), "graph_compiles": self.runner.graph_compiles}

    # ------------------------------------------------------------ commands
    def _step(self, msg: P.Message) -> tuple[dict[str, Any], list[bytes]]:
        if self.arena is None:
            raise RuntimeError("step before handshake")
        h, spec = msg.header, self.arena.spec
        n_tokens, n_rows, width = h["n_tokens"], h["n_rows"], h["width"]
        if n_tokens > spec.max_tokens or n_rows > spec.max_rows or width > spec.max_blocks:
            raise ValueError(f"step ({n_tokens} tokens, {n_rows} rows, width {width}) exceeds the arena")
        if self.segment is None:
            load_step_frames(self.arena, msg)
        v = self.arena.views(n_tokens, n_rows, width)
        self._check_ranges(v)
        try:
            model_s = self.runner.step(v, h["free"])
        except Exception as exc:
            raise RuntimeFailure(f"{type(exc).__name__}: {exc}") from exc
        frames = [] if self.segment is not None else self.arena.output_frames(n_rows)
        return {"model_s": model_s, "graph_compiles": self.runner.graph_compiles}, frames

    def _check_ranges(self, v: dict[str, np.ndarray]) -> None:
        rc, vocab = self.runner.rc, self.runner.cfg.vocab_size
        checks = (("tokens", vocab), ("slots", rc.num_blocks * rc.block_size),
                  ("block_tables", rc.num_blocks), ("positions", rc.max_model_len))
        for name, bound in checks:
            a = v[name]
            if a.size and (a.min() < 0 or a.max() >= bound):
                raise ValueError(f"{name} out of range [0, {bound})")
        if np.any(v["n_logprobs"] > v["out_top_ids"].shape[1]):
            raise ValueError("n_logprobs above the maximum")

    def handle(self, parts: list[bytes]) -> list[bytes]:
        """Never raises: malformed input or a failed step becomes an error reply."""
        try:
            msg = P.decode(parts)
        except P.ProtocolError as exc:
            return P.encode_reply(False, {"error": f"protocol: {exc}", "id": None})
        mid = msg.header.get("id")
        try:
            frames: list[bytes] = []
            if msg.cmd == P.HANDSHAKE:
                body = self._attach(msg.header)
            elif msg.cmd in P.STEP_COMMANDS:
                body, frames = self._step(msg)
            elif msg.cmd == P.RESET:
                self.runner.reset()
                body = {}
            elif msg.cmd == P.EXIT:
                self.exiting = True
                body = {}
            else:  # heartbeat
                body = {"pid": os.getpid(), "attached": self.arena is not None,
                        "graph_compiles": self.runner.graph_compiles}
            return P.encode_reply(True, {**body, "id": mid}, frames)
        except RuntimeFailure as exc:
            log.error("model step failed; exiting for a restart: %s", exc)
            self.exiting = self.failed = True
            return P.encode_reply(False, {"error": str(exc), "fatal": True, "id": mid})
        except Exception as exc:  # the agent keeps serving; the server decides what fails
            log.warning("command %r failed: %s", msg.cmd, exc)
            log.debug("%s", traceback.format_exc())
            return P.encode_reply(False, {"error": f"{type(exc).__name__}: {exc}", "id": mid})

    def serve(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.address.startswith("ipc://"):
            path = self.address[len("ipc://"):]
            if os.path.exists(path):
                os.unlink(path)  # left behind by a killed agent
        sock.bind(self.address)
        log.info("agent ready on %s", self.address)
        try:
            while not self.exiting:
                if sock.poll(IDLE_POLL_MS):  # blocks: no busy-spin while idle
                    ident, *parts = sock.recv_multipart()
                    self.last_msg = time.monotonic()
                    sock.send_multipart([ident, *self.handle(parts)])
                elif self.arena is not None and not self._attached_to_live_server():
                    log.info("server went away; exiting")
                    break
        finally:
            self._detach()
            sock.close(0)


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


def agent_process(config_path: str | None, index: int, overrides: dict[str, Any]) -> None:
    """Spawn target: load the model for device `start_device_id + index`, then serve."""
    logging.basicConfig(level=os.environ.get("LLM_SERVING_LOG", "INFO"),
                        format=f"%(asctime)s agent{index} %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _exit_once)
    from server.config import load_config

    cfg = load_config(config_path, **overrides)
    _pin(index, len(cfg.agent_ports), cfg.agent_cores)
    os.environ.setdefault("DEVICE_ID", str(cfg.start_device_id + index))
    from agent.runner import ModelRunner, RunnerConfig, compile_cache_key, setup_mindspore  # mindspore first
    from agent.weights import load_model
    from server.model_files import resolve_model
    from shm.transport import agent_address

    t0 = time.monotonic()
    model_cfg, weights = load_model(resolve_model(cfg.model_path, cfg.model_cfg_path), cfg.max_model_len)
    rc = RunnerConfig(num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                      token_buckets=cfg.token_buckets, max_rows=cfg.max_running,
                      mixed_tokens=cfg.mixed_step_tokens, prefill_rows=cfg.max_prefill_rows)
    # The on-disk cache is only sound for warm-up's fixed compile order (see freeze_compile_cache).
    setup_mindspore(cfg.compile_cache_dir if cfg.warmup else None, key=compile_cache_key(model_cfg, rc))
    runner = ModelRunner(model_cfg, weights, rc, seed=index)
    del weights
    if cfg.warmup:
        runner.warmup()
    log.info("model loaded and compiled in %.1fs", time.monotonic() - t0)
    info = {"vocab_size": model_cfg.vocab_size, "eos_token_ids": model_cfg.eos_token_ids,
            "max_model_len": rc.max_model_len, "num_blocks": rc.num_blocks, "block_size": rc.block_size,
            "device_id": cfg.start_device_id + index}
    server = AgentServer(agent_address(cfg.agent_ports[index], cfg.agent_ip), runner, info)
    server.serve()
    if server.failed:
        sys.exit(3)

