"""Start one agent process per `serving_config.agent_ports` entry and wait until each answers.

Used by `launch_agents` (standalone: the agents outlive the servers that attach to them, restarts
them when they die, and stops them on SIGTERM/SIGINT) and by `llm-serving` (agents + server in one
command). Every agent exits when the process that launched it is gone.
Readiness is a heartbeat answered over the agent's own socket, not log polling.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing as mp
import signal
import socket
import sys
import os
import time
from pathlib import Path
from typing import Any

import zmq

from agent.logits_dump import ENV_DIR, ENV_EVERY
from common.config import ConfigError, ServingConfig, load_config
from common.memory import MemoryPlan, gib, model_shape
from common.memory import plan as memory_plan
from common.model_files import resolve_model
from common.procs import Backoff, stopped
from shm import protocol as P
from shm.arena import clean_stale_segments, segment_name
from shm.curve import INSECURE_ENV, CurveKeyError, KeyFolder, exposure
from shm.endpoint import PortInUse, agent_address, clean_stale_endpoints, dial_host, holder, is_local

log = logging.getLogger("llm_serving.launch")
READY_TIMEOUT_S = 900.0  # model load + graph warm-up of one agent
STABLE_S = 60.0  # an agent alive this long after a restart ends its row of restarts
STOPPED_GRACE_S = 5.0  # a starting agent stopped (SIGSTOP) this long is given up on and killed


class AgentStartError(RuntimeError):
    pass


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


def ping(address: str, timeout_s: float, proc: mp.process.BaseProcess | None = None,
         curve: KeyFolder | None = None) -> dict[str, Any]:
    """Heartbeat an agent; fails early if its process dies or stays stopped meanwhile (a slow model
    load is indistinguishable from a hang by time alone, so loading gets the long timeout). A tcp
    agent with CURVE keys is pinged with its own key (the launcher runs on the agent's host)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None and address.startswith("tcp://"):
        curve.client(sock, as_agent=True)
    sock.connect(address)
    try:
        sock.send_multipart(P.encode(P.HEARTBEAT, {"id": 1}))
        deadline = time.monotonic() + timeout_s
        stopped_since = None
        while time.monotonic() < deadline:
            if sock.poll(200):
                ok, body, _ = P.decode_reply(sock.recv_multipart())
                if ok:
                    return body
            if proc is not None and not proc.is_alive():
                raise AgentStartError(f"agent at {address} exited with code {proc.exitcode}")
            if proc is not None and stopped(proc.pid):
                stopped_since = stopped_since or time.monotonic()
                if time.monotonic() - stopped_since > STOPPED_GRACE_S:
                    raise AgentStartError(f"agent at {address} (pid {proc.pid}) is stopped")
            else:
                stopped_since = None
        raise AgentStartError(f"agent at {address} not ready after {timeout_s:.0f}s")
    finally:
        sock.close(0)


def spawn_agent(config_path: str | None, index: int, overrides: dict[str, Any],
                tp_link: str | None = None) -> mp.process.BaseProcess:
    """Spawn (never fork: MindSpore hangs in a forked child) agent `index`; `tp_link`: where its
    tensor-parallel group meets (group_link)."""
    from agent.main import agent_process

    proc = mp.get_context("spawn").Process(target=agent_process, name=f"agent{index}", daemon=True,
                                           args=(config_path, index, overrides, os.getpid(), tp_link))
    proc.start()
    return proc


_epochs = itertools.count()


def group_link(cfg: ServingConfig, group: list[int]) -> tuple[str | None, Any]:
    """Where a tensor-parallel group's ranks meet, new at every (re)start, and what to stop with
    it: `shm:<segment>` for the native collectives (CPU; named by this launcher's pid, so a dead
    launcher's are cleaned like stale arenas), else `ms:<port>` and mindspore.communication's
    scheduler process. (None, None) for one rank."""
    if len(group) == 1:
        return None, None
    from agent.tensor_parallel import create_segment, run_scheduler, slot_floats

    if cfg.device == "CPU" and os.environ.get("LLM_SERVING_NATIVE", "1") != "0":  # agent.kernels.enabled()
        shape = model_shape(resolve_model(cfg.model_path, cfg.model_cfg_path))
        name = segment_name(f"tp{cfg.agent_ports[group[0]]}x{next(_epochs)}")
        create_segment(name, len(group), slot_floats(shape.hidden, shape.vocab, cfg.token_buckets[-1], cfg.max_rows,
                                                     len(group)))
        return f"shm:{name}", name
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sched = mp.get_context("spawn").Process(target=run_scheduler, args=(port, len(group)), daemon=True,
                                            name=f"scheduler{group[0]}")
    sched.start()
    return f"ms:{port}", sched


def spawn_group(cfg: ServingConfig, config_path: str | None, overrides: dict[str, Any],
                group: list[int]) -> list[mp.process.BaseProcess]:
    link, companion = group_link(cfg, group)
    procs = [spawn_agent(config_path, i, overrides, link) for i in group]
    procs[0].tp_companion = companion  # type: ignore[attr-defined]  (stopped with its group)
    return procs


def start_agents(cfg: ServingConfig, config_path: str | None, overrides: dict[str, Any],
                 ready_timeout_s: float = READY_TIMEOUT_S) -> list[mp.process.BaseProcess]:
    """Spawn every agent and wait until each answers a heartbeat. Refuses at once a port that a
    live agent holds (the agent would refuse too, but only after its interpreter started)."""
    try:
        keys = KeyFolder.find(cfg.curve_keys)
        if keys is not None and not all(is_local(cfg.bind_host(i)) for i in range(len(cfg.agent_ports))):
            keys.pair("agent")  # the agents' keypair is here: fail now, not in each agent
    except CurveKeyError as exc:
        raise AgentStartError(str(exc)) from None
    check_memory(cfg, overrides)
    for i, port in enumerate(cfg.agent_ports):
        refusal, warning = exposure(cfg.bind_host(i), keys, bool(os.environ.get(INSECURE_ENV)))
        if refusal:
            raise AgentStartError(refusal)
        if warning:
            log.warning("%s", warning)
        if is_local(cfg.bind_host(i)):
            clean_stale_endpoints()
            pid = holder(port)
            if pid is not None:
                raise AgentStartError(str(PortInUse(port, pid)))
    procs = [p for group in cfg.groups for p in spawn_group(cfg, config_path, overrides, group)]
    try:
        for i, proc in enumerate(procs):
            ping(agent_address(cfg.agent_ports[i], dial_host(cfg.bind_host(i))), ready_timeout_s, proc, keys)
            log.info("agent %d ready (pid %d, port %d)", i, proc.pid, cfg.agent_ports[i])
    except BaseException as exc:
        stop_agents(procs)
        if isinstance(exc, CurveKeyError):
            raise AgentStartError(str(exc)) from None
        raise
    return procs


def check_memory(cfg: ServingConfig, overrides: dict[str, Any]) -> MemoryPlan:
    """Size `num_blocks: auto` (the agents reload the config with the result) and refuse a config
    this host cannot hold, before any agent loads a weight."""
    p = memory_plan(cfg, resolve_model(cfg.model_path, cfg.model_cfg_path), len(cfg.agent_ports))
    overrides["num_blocks"] = cfg.num_blocks
    why = p.refusal()
    if why:
        raise AgentStartError(why)
    log.info("memory per agent: %s (weights %s, KV %s in %d blocks, activations %s, runtime %s)",
             gib(p.per_agent), gib(p.weights), gib(p.kv), p.num_blocks, gib(p.activations), gib(p.runtime))
    return p


def respawn_group(cfg: ServingConfig, config_path: str | None, overrides: dict[str, Any],
                  procs: list[mp.process.BaseProcess], index: int) -> None:
    """Replace replica `index`, every rank of it (dead or stuck: killed and reaped first; a rank
    alone cannot rejoin its group's collectives), and wait until each answers."""
    group = cfg.groups[index]
    for i in group:
        if procs[i].is_alive():
            procs[i].kill()
    for i in group:
        procs[i].join(5.0)
    _stop_companions([procs[group[0]]])
    clean_stale_endpoints()  # a killed agent leaves its socket and lock files behind
    for i, proc in zip(group, spawn_group(cfg, config_path, overrides, group)):
        procs[i] = proc
    for i in group:
        ping(agent_address(cfg.agent_ports[i], dial_host(cfg.bind_host(i))), READY_TIMEOUT_S, procs[i],
             KeyFolder.find(cfg.curve_keys))
        log.info("agent %d restarted (pid %d)", i, procs[i].pid)


def _stop_companions(procs: list[mp.process.BaseProcess]) -> None:
    """What a group's rank 0 carries: its collective segment (unlinked) or scheduler (stopped)."""
    from agent.tensor_parallel import SEGMENT_DIR

    for p in procs:
        companion = getattr(p, "tp_companion", None)
        if isinstance(companion, str):
            (SEGMENT_DIR / companion).unlink(missing_ok=True)
        elif companion is not None:
            companion.kill()
            companion.join(5.0)


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
    if procs:
        _stop_companions(procs)
        clean_stale_endpoints()
        clean_stale_segments()  # arenas of servers killed while attached


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch_agents", description=__doc__)
    ap.add_argument("--config", help="serving YAML (original llm-serving keys)")
    ap.add_argument("--verbose", action="store_true", help="MindSpore's own log on the console too")
    ap.add_argument("--dtype", dest="model_dtype", choices=["float32", "bfloat16", "float16", "int8"], help="model_config.model_dtype")
    ap.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=["auto", "float32", "bfloat16", "float16", "int8"],
                    help="model_config.kv_cache_dtype")
    ap.add_argument("--dump-logits", metavar="DIR", help="the contest's precision files (as llm-serving's)")
    ap.add_argument("--device", choices=["CPU", "Ascend", "GPU"], help="serving_config.device")
    ap.add_argument("--bind", metavar="ADDR", help="where the agents listen (e.g. 0.0.0.0 in a pod), instead of "
                    "agent_ip; remote binds need CURVE keys or --insecure")
    ap.add_argument("--insecure", action="store_true", help="let agents listen on plain tcp beyond loopback "
                    "without CURVE keys (warned about at every start)")
    ap.add_argument("--dump-every", type=positive, default=100, metavar="N", help="with --dump-logits (default 100)")
    args = ap.parse_args(argv)
    agent_env(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # agents reload the config with these
    overrides = {k: v for k, v in (("model_dtype", args.model_dtype), ("kv_cache_dtype", args.kv_cache_dtype),
                                   ("agent_bind", args.bind),
                                   ("device", args.device)) if v}
    try:
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
