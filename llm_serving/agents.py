"""The agent processes of one serving config: spawned (one per `agent_ports` entry), awaited until
each answers a heartbeat over its own socket (not log polling), replaced a replica at a time, and
stopped. Every agent exits when the process that launched it is gone."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from typing import Any

import zmq

from agent.tensor_parallel import group_link, stop_link
from common.config import ServingConfig
from common.memory import MemoryPlan, gib
from common.memory import plan as memory_plan
from common.model_files import resolve_model
from common.procs import stopped
from shm import protocol as P
from shm.arena import clean_stale_segments
from shm.curve import INSECURE_ENV, CurveKeyError, KeyFolder, exposure
from shm.endpoint import (PortInUse, agent_address, clean_stale_endpoints, dial_host, holder, is_local,
                          socket_path)

log = logging.getLogger("llm_serving.launch")
READY_TIMEOUT_S = 900.0  # model load + graph warm-up of one agent
STOPPED_GRACE_S = 5.0  # a starting agent stopped (SIGSTOP) this long is given up on and killed


class AgentStartError(RuntimeError):
    pass


def ping(address: str, timeout_s: float, proc: mp.process.BaseProcess | None = None,
         curve: KeyFolder | None = None) -> None:
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
                ok, _, _ = P.decode_reply(sock.recv_multipart())
                if ok:
                    return
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


def _stop_companions(procs: list[mp.process.BaseProcess]) -> None:
    for p in procs:
        stop_link(getattr(p, "tp_companion", None))


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
            socket_path(port)  # a runtime folder too long for a unix socket: refused before any agent starts
            clean_stale_endpoints()
        pid = holder(port)  # a tcp agent's too: a ping would reach the holder and call ours ready
        if pid is not None:
            raise AgentStartError(str(PortInUse(port, pid)))
    procs = [p for group in cfg.groups for p in spawn_group(cfg, config_path, overrides, group)]
    try:
        for i, proc in enumerate(procs):
            ping(agent_address(cfg.agent_ports[i], dial_host(cfg.bind_host(i))), ready_timeout_s, proc, keys)
            log.debug("agent %d ready (pid %d, port %d)", i, proc.pid, cfg.agent_ports[i])  # the agent said so
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
