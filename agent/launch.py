"""Start one agent process per `serving_config.agent_ports` entry and wait until each answers.

Used by `launch_agents` (standalone) and by `llm-serving` (agents + server in one command).
Readiness is a heartbeat answered over the agent's own socket, not log polling.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import signal
import sys
import time
from typing import Any

import zmq

from server.config import ServingConfig, load_config
from shm import protocol as P
from shm.transport import agent_address

log = logging.getLogger("llm_serving.launch")


class AgentStartError(RuntimeError):
    pass


def ping(address: str, timeout_s: float, proc: mp.process.BaseProcess | None = None) -> dict[str, Any]:
    """Heartbeat an agent; fails early if its process dies meanwhile."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(P.encode(P.HEARTBEAT, {"id": 1}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(200):
                ok, body, _ = P.decode_reply(sock.recv_multipart())
                if ok:
                    return body
            if proc is not None and not proc.is_alive():
                raise AgentStartError(f"agent at {address} exited with code {proc.exitcode}")
        raise AgentStartError(f"agent at {address} not ready after {timeout_s:.0f}s")
    finally:
        sock.close(0)


def start_agents(cfg: ServingConfig, config_path: str | None, overrides: dict[str, Any],
                 ready_timeout_s: float = 900.0) -> list[mp.process.BaseProcess]:
    """Spawn (never fork: MindSpore hangs in a forked child) and wait for every agent."""
    ctx = mp.get_context("spawn")
    from agent.main import agent_process

    procs = []
    for i, _ in enumerate(cfg.agent_ports):
        proc = ctx.Process(target=agent_process, args=(config_path, i, overrides), name=f"agent{i}", daemon=True)
        proc.start()
        procs.append(proc)
    try:
        for i, proc in enumerate(procs):
            ping(agent_address(cfg.agent_ports[i], cfg.agent_ip), ready_timeout_s, proc)
            log.info("agent %d ready (pid %d, port %d)", i, proc.pid, cfg.agent_ports[i])
    except BaseException:
        stop_agents(procs)
        raise
    return procs


def stop_agents(procs: list[mp.process.BaseProcess], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch_agents", description=__doc__)
    ap.add_argument("--config", help="serving YAML (original llm-serving keys)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(args.config)
    try:
        procs = start_agents(cfg, args.config, {})
    except AgentStartError as exc:
        log.error("%s", exc)
        return 1
    print("all agents started", flush=True)  # the original launcher's ready line

    def forward(signum: int, _frame: Any) -> None:
        stop_agents(procs)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while all(p.is_alive() for p in procs):
        time.sleep(0.5)
    dead = [p.name for p in procs if not p.is_alive()]
    log.info("agent(s) %s exited; stopping the rest", dead)
    stop_agents(procs)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
