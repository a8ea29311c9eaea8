"""`llm-serving`: start the agents (or attach to running ones), connect, and serve HTTP."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from common.config import ConfigError, ServingConfig, load_config, speculative_overrides
from common.config_keys import ROUTINGS
from common.speculative import method_of
from common.config_values import as_adapters, as_roles
from common.config_values import parse_bytes
from common.memory import plan as memory_plan
from common.model_files import resolve_model
from common.tokenizer import TextTokenizer
from llm_serving.boot import START_ERRORS, start_engine
from llm_serving.agents import stop_agents
from llm_serving.launch import agent_env, positive
from server.engine.engine import Engine
from shm.arena import clean_stale_segments
from shm.endpoint import clean_stale_endpoints, lws_agents, parse_agents

log = logging.getLogger("llm_serving")


def bind_http(cfg: ServingConfig) -> socket.socket:
    """Take the HTTP port before anything slow starts: a busy port fails in a moment, not after the
    model has loaded. uvicorn serves on this very socket."""
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.server_ip else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.server_ip, cfg.server_port))
    except OSError as exc:
        sock.close()
        raise OSError(f"HTTP port {cfg.server_port} on {cfg.server_ip} is not available: {exc.strerror}") from None
    return sock


def dry_run(cfg: ServingConfig, attach: bool) -> int:
    """`--dry-run`: the memory plan of this config on this host, nothing started."""
    try:
        p = memory_plan(cfg, resolve_model(cfg.model_path, cfg.model_cfg_path), 0 if attach else len(cfg.agent_ports))
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        print(f"config: {exc}")
        return 1
    print(f"model {cfg.model_path or cfg.model_name}, {cfg.model_dtype}, device {cfg.device}, "
          f"{len(cfg.agent_ports)} agent(s){' (attached: not on this host)' if attach else ''}")
    print(p.describe())
    return 0 if p.refusal() is None else 1


def start_failed(why: str, verbose: bool) -> int:
    """A start-up error: one line and exit status 1; the traceback only with --verbose."""
    log.error("%s", why, exc_info=verbose)
    return 1


def _reap(procs: list, stop: threading.Event) -> None:
    """Collect agents that died and are not restarted (a lane given up on): no zombies meanwhile."""
    while not stop.wait(2.0):
        for p in list(procs):
            p.is_alive()  # waitpid(WNOHANG) on an exited child


def _demo(url: str, model: str, key: str | None) -> None:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300).json()
    print(f"demo request -> {r['choices'][0]['message']['content']!r}", flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="llm-serving", description="LLM inference server on MindSpore")
    ap.add_argument("--config", help="serving YAML (original llm-serving keys)")
    ap.add_argument("--model", dest="model_path", help="a packaged model (smollm2, gemma3-270m), a .gguf file, a HF folder or a .ckpt")
    ap.add_argument("--dtype", dest="model_dtype", choices=["float32", "bfloat16", "float16", "int8", "gguf"],
                    help="model_config.model_dtype: bfloat16 keeps projection and LM head weights 16-bit, "
                         "int8 runs them as W8A8")
    ap.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=["auto", "float32", "bfloat16", "float16", "int8"],
                    help="model_config.kv_cache_dtype: auto = the weights' 16-bit dtype, int8 with int8 weights, else float32")
    ap.add_argument("--device-memory", dest="device_memory", type=parse_bytes, metavar="BYTES",
                    help="serving_config.device_memory: each device's memory for the plan, e.g. 32GiB")
    ap.add_argument("--device", choices=["CPU", "Ascend", "GPU"], help="serving_config.device: where the agents "
                    "run the model (agent i on start_device_id + i)")
    ap.add_argument("--no-overlap", dest="overlap_steps", action="store_false", default=None,
                    help="serving_config.overlap_steps: false (one step in flight at a time)")
    ap.add_argument("--deterministic", action="store_true", default=None,
                    help="serving_config.deterministic: batch-invariant kernels (docs/config.md)")
    ap.add_argument("--speculative-config", metavar="JSON", help="speculative_config as vLLM's JSON, e.g. "
                    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (docs/config.md)")
    ap.add_argument("--lora-modules", nargs="+", metavar="NAME=FOLDER", help="serving_config.lora_modules: PEFT "
                    "LoRA adapters a request picks by `model` (vLLM's flag)")
    ap.add_argument("--enable-lora", dest="enable_lora", action="store_true", default=None,
                    help="serving_config.enable_lora: LoRA slots without adapters at start")
    ap.add_argument("--max-loras", dest="max_loras", type=int, help="serving_config.max_loras: adapter slots per agent")
    ap.add_argument("--max-lora-rank", dest="max_lora_rank", type=int, help="serving_config.max_lora_rank")
    ap.add_argument("--agent-roles", metavar="ROLE,...", help="serving_config.agent_roles: per agent port both, "
                    "prefill or decode (prefill/decode disaggregation), e.g. prefill,decode")
    ap.add_argument("--no-web-ui", dest="web_ui", action="store_false", default=None,
                    help="serving_config.web_ui: false (no chat page at /)")
    ap.add_argument("--routing", choices=ROUTINGS, help="serving_config.routing: where a new request goes among "
                    "data-parallel agents (prefix: where its prompt's prefix is cached; least_load)")
    ap.add_argument("--host", dest="server_ip")
    ap.add_argument("--port", dest="server_port", type=int)
    ap.add_argument("--attach", action="store_true", help="use agents started by launch_agents")
    ap.add_argument("--agents", metavar="HOST:PORT,...", help="the agents to attach to (implies --attach; "
                    "else from a LeaderWorkerSet's LWS_* variables, else serving_config.agent_ports)")
    ap.add_argument("--wait-agents", type=float, default=0.0, metavar="S", help="with --attach: wait up to S "
                    "seconds for local agents to appear (a pod's launch_agents starting beside the server)")
    ap.add_argument("--reset-agents", action="store_true",
                    help="with --attach: take over agents that another (stuck) server still holds (sends r)")
    ap.add_argument("--demo", action="store_true", help="send one chat request once ready and print the answer")
    ap.add_argument("--dump-logits", metavar="DIR", help="the contest's precision files: a sampled row's raw logits as "
                    "{time}_{ids}_{position}.npy at every --dump-every-th absolute position (prefix caching off; "
                    "tools/test_serving_performance.py)")
    ap.add_argument("--dump-every", type=positive, default=100, metavar="N", help="with --dump-logits (default 100)")
    ap.add_argument("--insecure", action="store_true", help="let agents we start listen on plain tcp beyond "
                    "loopback without CURVE keys (warned about at every start)")
    ap.add_argument("--api-key", action="append", metavar="KEY", help="require Authorization: Bearer KEY on every "
                    "route but /health and /metrics (repeat or comma-separate for several; also LLM_SERVING_API_KEY)")
    ap.add_argument("--metrics-auth", action="store_true", help="with API keys: /metrics needs a key too")
    ap.add_argument("--dry-run", action="store_true", help="print the memory plan (weights, KV cache, "
                    "activations per agent, against this host's available memory) and exit: 0 if it fits")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--verbose", action="store_true", help="MindSpore's own log on the console too")
    return ap


def configure(args: argparse.Namespace, overrides: dict[str, Any]) -> ServingConfig:
    """The YAML with the command line's overrides and the agents' addresses (--agents, else a
    LeaderWorkerSet's LWS_* variables): agents started elsewhere are attached to."""
    agents = parse_agents(args.agents) if args.agents else None
    if agents is None:  # the YAML's first port, before roles that may be one per LWS worker
        yaml_port = load_config(args.config, **{k: v for k, v in overrides.items() if k != "agent_roles"}).agent_ports[0]
        agents = lws_agents(dict(os.environ), yaml_port)
    if agents:
        overrides.update(agent_hosts=[h for h, _ in agents], agent_ports=[p for _, p in agents])
        args.attach = True
        log.info("agents: %s", ", ".join(f"{h}:{p}" for h, p in agents))
    return load_config(args.config, **overrides)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    agent_env(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = {k: getattr(args, k) for k in ("model_path", "model_dtype", "kv_cache_dtype", "server_ip", "server_port",
                                               "overlap_steps", "web_ui", "device", "device_memory", "max_loras", "enable_lora",
                                               "max_lora_rank", "routing", "deterministic")
                 if getattr(args, k) is not None}
    if args.dump_logits:  # every prompt fed from its first token, as the contest's agent fed it (its files' names)
        overrides["enable_prefix_caching"] = False
    started = time.monotonic()
    try:
        if args.speculative_config:
            overrides.update(speculative_overrides(args.speculative_config))
        if args.lora_modules:
            overrides["lora_modules"] = as_adapters(args.lora_modules)
        if args.agent_roles:
            overrides["agent_roles"] = as_roles(args.agent_roles)
        cfg = configure(args, overrides)
    except (ConfigError, ValueError) as exc:
        return start_failed(f"config: {exc}", args.verbose)
    for line in cfg.notices:
        log.warning("config: %s", line)
    if args.dry_run:
        return dry_run(cfg, args.attach)
    log.info("step graphs: %s tokens (at most %d per step, %d sequences per agent)", cfg.token_buckets,
             cfg.mixed_step_tokens, cfg.max_running)
    if cfg.spec_method:
        log.info("speculative decoding: %s", speculative_line(cfg))
    removed = clean_stale_segments()
    if removed:
        log.info("removed %d stale shared-memory segment(s)", len(removed))
    clean_stale_endpoints()
    try:
        http = bind_http(cfg)
        engine, tok, procs = start_engine(cfg, args.config, overrides, args.attach, args.reset_agents,
                                          args.wait_agents)
    except START_ERRORS as exc:
        return start_failed(str(exc), args.verbose)
    except Exception as exc:  # a bug or an unforeseen environment: still one line (--verbose: the traceback)
        return start_failed(f"{type(exc).__name__}: {exc}", args.verbose)
    return serve(args, cfg, http, engine, tok, procs, started)


def speculative_line(cfg: ServingConfig) -> str:
    """The start log's account of speculative_config: the method and what it drafts."""
    m = method_of(cfg)
    limit = f", off above {cfg.spec_max_batch} running" if cfg.spec_max_batch else ""
    return f"method {cfg.spec_method} ({m.says(cfg) if m else ''}), k = {cfg.spec_tokens} tokens a step{limit}"


def serve(args: argparse.Namespace, cfg: ServingConfig, http: socket.socket, engine: Engine, tok: TextTokenizer, procs: list,
          started: float) -> int:
    """HTTP until SIGTERM/SIGINT; then the engine and the agents we started stop."""
    import uvicorn

    from server.http.api_keys import parse_keys
    from server.http.app import build_app
    from server.http.guard import guarded_protocol

    keys = parse_keys(args.api_key, os.environ.get("LLM_SERVING_API_KEY"))
    if keys:
        log.info("API keys required (%d configured)", len(keys))
    app = build_app(engine, cfg, tok, keys, metrics_open=not args.metrics_auth)
    server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.server_ip, port=cfg.server_port, log_level="warning", timeout_graceful_shutdown=5,
        http=guarded_protocol(cfg.http_header_timeout_s, cfg.max_header_bytes),
        timeout_keep_alive=int(cfg.http_keepalive_timeout_s)))
    url = f"http://{cfg.server_ip}:{cfg.server_port}"

    def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            threading.Event().wait(0.05)
        print(f"llm-serving ready at {url} ({time.monotonic() - started:.1f}s)", flush=True)
        if args.demo:
            _demo(url, cfg.model_name, keys[0] if keys else None)

    threading.Thread(target=announce, daemon=True).start()
    handle_exit = server.handle_exit  # uvicorn's, installed for SIGINT/SIGTERM while it runs

    def on_signal(sig: int, frame: Any) -> None:
        engine.stopping()
        handle_exit(sig, frame)

    server.handle_exit = on_signal
    reaped = threading.Event()
    threading.Thread(target=_reap, args=(procs, reaped), name="reaper", daemon=True).start()
    # uvicorn re-raises SIGTERM / SIGINT after its graceful shutdown; with a Python handler in place
    # that becomes SystemExit (not a KeyboardInterrupt traceback on Ctrl-C), so the cleanup below
    # (unlinking shared memory, stopping agents) runs.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _: sys.exit(128 + s))
    try:
        server.run(sockets=[http])
    finally:
        reaped.set()
        engine.shutdown()
        stop_agents(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
