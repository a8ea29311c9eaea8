"""`launch_agents`: start one agent process per `serving_config.agent_ports` entry (llm_serving.agents),
wait until each answers, and keep them up across the servers that attach to them: restarted when
they die, stopped on SIGTERM/SIGINT. `llm-serving` starts agents and server in one command."""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from agent.logits_dump import ENV_DIR, ENV_EVERY
from common.config import ConfigError, ServingConfig, load_config, speculative_overrides
from common.config_values import as_adapters
from common.procs import Backoff
from llm_serving.agents import AgentStartError, respawn_group, start_agents, stop_agents
from shm.curve import INSECURE_ENV

log = logging.getLogger("llm_serving.launch")
STABLE_S = 60.0  # an agent alive this long after a restart ends its row of restarts


def agent_env(args: argparse.Namespace) -> None:
    """Command-line switches the agents we spawn read from their environment."""
    if args.verbose:
        os.environ["LLM_SERVING_VERBOSE"] = "1"
    if args.insecure:
        os.environ[INSECURE_ENV] = "1"
    if args.dump_logits:
        os.environ[ENV_DIR] = str(Path(args.dump_logits).resolve())
        os.environ[ENV_EVERY] = str(args.dump_every)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch_agents", description=__doc__)
    ap.add_argument("--config", help="serving YAML (original llm-serving keys)")
    ap.add_argument("--verbose", action="store_true", help="MindSpore's own log on the console too")
    ap.add_argument("--dtype", dest="model_dtype", choices=["float32", "bfloat16", "float16", "int8", "gguf"], help="model_config.model_dtype")
    ap.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=["auto", "float32", "bfloat16", "float16", "int8"],
                    help="model_config.kv_cache_dtype")
    ap.add_argument("--dump-logits", metavar="DIR", help="the contest's precision files (as llm-serving's)")
    ap.add_argument("--device", choices=["CPU", "Ascend", "GPU"], help="serving_config.device")
    ap.add_argument("--bind", metavar="ADDR", help="where the agents listen (e.g. 0.0.0.0 in a pod), instead of "
                    "agent_ip; remote binds need CURVE keys or --insecure")
    ap.add_argument("--insecure", action="store_true", help="let agents listen on plain tcp beyond loopback "
                    "without CURVE keys (warned about at every start)")
    ap.add_argument("--dump-every", type=positive, default=100, metavar="N", help="with --dump-logits (default 100)")
    ap.add_argument("--speculative-config", metavar="JSON", help="speculative_config as vLLM's JSON (as llm-serving's)")
    ap.add_argument("--lora-modules", nargs="+", metavar="NAME=FOLDER", help="serving_config.lora_modules (as llm-serving's)")
    ap.add_argument("--deterministic", action="store_true", default=None, help="serving_config.deterministic (as llm-serving's)")
    args = ap.parse_args(argv)
    agent_env(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # agents reload the config with these
    overrides = {k: v for k, v in (("model_dtype", args.model_dtype), ("kv_cache_dtype", args.kv_cache_dtype),
                                   ("agent_bind", args.bind), ("device", args.device),
                                   ("deterministic", args.deterministic)) if v}
    try:
        if args.speculative_config:
            overrides.update(speculative_overrides(args.speculative_config))
        if args.lora_modules:
            overrides["lora_modules"] = as_adapters(args.lora_modules)
        cfg = load_config(args.config, **overrides)
    except ConfigError as exc:
        log.error("config: %s", exc, exc_info=args.verbose)
        return 1
    for line in cfg.notices:
        log.warning("config: %s", line)
    try:
        procs = start_agents(cfg, args.config, overrides)
    except (AgentStartError, ConfigError) as exc:
        log.error("%s", exc)
        return 1
    print("all agents started", flush=True)  # the original launcher's ready line
    log.info("agents stay up across servers: attach with `llm-serving --attach --config %s`; "
             "stop them with SIGTERM/Ctrl-C to this process (pid %d)", args.config, os.getpid())

    def forward(signum: int, _frame: Any) -> None:
        stop_agents(procs)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return supervise(cfg, args.config, overrides, procs)


def supervise(cfg: ServingConfig, config_path: str | None, overrides: dict[str, Any],
              procs: list[mp.process.BaseProcess]) -> int:
    """Restart replicas one of whose agents exits (a crash, or a runtime failure) with the server's
    backoff; give up on one that dies `max_agent_restarts` times in a row, each within STABLE_S of
    its restart."""
    backoff = [Backoff(cfg.max_agent_restarts) for _ in cfg.groups]
    started = [time.monotonic()] * len(cfg.groups)
    while True:
        time.sleep(0.5)
        for i, group in enumerate(cfg.groups):
            proc = next((procs[a] for a in group if not procs[a].is_alive()), None)
            if proc is None:
                continue
            if time.monotonic() - started[i] >= STABLE_S:
                backoff[i].reset()
            if backoff[i].exhausted:
                log.error("agent %d died %d times in a row (exit code %s); stopping", i, backoff[i].limit + 1,
                          proc.exitcode)
                stop_agents(procs)
                return 1
            delay = backoff[i].next_delay()
            log.warning("agent %d exited with code %s; restart %d/%d", i, proc.exitcode, backoff[i].count,
                        backoff[i].limit)
            time.sleep(delay)
            try:
                respawn_group(cfg, config_path, overrides, procs, i)
            except AgentStartError as exc:
                log.error("%s", exc)
            started[i] = time.monotonic()


if __name__ == "__main__":
    sys.exit(main())
