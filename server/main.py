"""`llm-serving`: start the agents (unless --attach), connect, and serve HTTP."""
from __future__ import annotations

import argparse
import itertools
import logging
import signal
import sys
import threading
from typing import Any, Callable

from server.config import load_config
from server.engine import Engine
from server.model_files import resolve_model
from server.tokenizer import load_tokenizer
from shm.arena import ArenaSpec, clean_stale_segments
from shm.transport import AgentClient, agent_address

log = logging.getLogger("llm_serving")


def arena_spec(cfg: Any) -> ArenaSpec:
    return ArenaSpec(cfg.token_buckets[-1], cfg.max_rows, cfg.max_blocks_per_seq)


def connect_agent(cfg: Any, index: int, tag: str, timeout_s: float = 600.0) -> AgentClient:
    client = AgentClient(agent_address(cfg.agent_ports[index], cfg.agent_ip), arena_spec(cfg), tag=tag)
    try:
        client.handshake(timeout_s)
    except BaseException:
        client.close(send_exit=False)
        raise
    return client


def connect_agents(cfg: Any) -> list[AgentClient]:
    clients: list[AgentClient] = []
    try:
        for i in range(len(cfg.agent_ports)):
            clients.append(connect_agent(cfg, i, f"agent{i}"))
    except BaseException:
        for c in clients:
            c.close(send_exit=False)
        raise
    return clients


def restarter(cfg: Any, config_path: str | None, overrides: dict[str, Any], procs: list) -> Callable[[int], AgentClient]:
    """How the engine brings agent i back: respawn it when we started it, else wait for its
    launcher (launch_agents restarts it) until the recovery deadline; then attach again."""
    from agent.launch import respawn_agent

    generation = itertools.count(1)

    def restart(index: int) -> AgentClient:
        if procs:
            respawn_agent(cfg, config_path, overrides, procs, index)
        return connect_agent(cfg, index, f"agent{index}r{next(generation)}", timeout_s=cfg.recovery_deadline_s)

    return restart


def _demo(url: str, model: str) -> None:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
    print(f"demo request -> {r['choices'][0]['message']['content']!r}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llm-serving", description="LLM inference server on MindSpore")
    ap.add_argument("--config", help="serving YAML (original llm-serving keys)")
    ap.add_argument("--model", dest="model_path", help="smollm2, a .gguf file, a HF folder or a .ckpt")
    ap.add_argument("--host", dest="server_ip")
    ap.add_argument("--port", dest="server_port", type=int)
    ap.add_argument("--attach", action="store_true", help="use agents started by launch_agents")
    ap.add_argument("--demo", action="store_true", help="send one chat request once ready and print the answer")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = {k: getattr(args, k) for k in ("model_path", "server_ip", "server_port") if getattr(args, k)}
    cfg = load_config(args.config, **overrides)
    removed = clean_stale_segments()
    if removed:
        log.info("removed %d stale shared-memory segment(s)", len(removed))

    import uvicorn  # after the config is known to be valid

    from agent.launch import AgentStartError, start_agents, stop_agents
    from server.api import build_app

    procs = []
    try:
        if not args.attach:
            procs = start_agents(cfg, args.config, overrides)
        clients = connect_agents(cfg)
    except (AgentStartError, TimeoutError, OSError) as exc:
        log.error("agents failed to start: %s", exc)
        stop_agents(procs)
        return 1
    tok = load_tokenizer(resolve_model(cfg.model_path, cfg.model_cfg_path), cfg.tokenizer_path)
    engine = Engine(cfg, tok, clients, restart=restarter(cfg, args.config, overrides, procs))
    engine.start()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, cfg, tok), host=cfg.server_ip, port=cfg.server_port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    url = f"http://{cfg.server_ip}:{cfg.server_port}"

    def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            threading.Event().wait(0.05)
        print(f"llm-serving ready at {url}", flush=True)
        if args.demo:
            _demo(url, cfg.model_name)

    threading.Thread(target=announce, daemon=True).start()
    # uvicorn re-raises SIGTERM after its graceful shutdown; with a Python handler in place that
    # becomes SystemExit, so the cleanup below (unlinking shared memory, stopping agents) runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        server.run()
    finally:
        engine.shutdown()
        stop_agents(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
