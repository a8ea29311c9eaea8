"""Booting a server as a library (the CLI in serve.py and the offline `LLM` both use it): connect to
the agents (starting them, or attaching to running ones), check the model against the tokenizer,
and start the engine with a restart hook."""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

from common.config import ServingConfig
from common.model_files import model_identity, resolve_model
from llm_serving.agents import AgentStartError, respawn_group, start_agents, stop_agents
from server.engine.engine import Engine
from server.engine.handover import HandoverError
from common.tokenizer import TextTokenizer, load_tokenizer
from shm import protocol as P
from shm.arena import ArenaSpec
from shm.curve import CurveKeyError, KeyFolder
from shm.endpoint import agent_address, holder, is_local
from shm.group import GroupClient
from shm.link import AgentLink
from shm.transport import AgentClient, AgentDead, AgentError

log = logging.getLogger("llm_serving")


class AttachError(RuntimeError):
    """An agent to attach to is missing, held by another server, or built for another model."""


def arena_spec(cfg: ServingConfig) -> ArenaSpec:
    return ArenaSpec(cfg.token_buckets[-1], cfg.max_rows, cfg.max_blocks_per_seq, slots=2)


def _agent_pid(port: int, wait_s: float) -> int:
    """The pid of the local agent holding `port`, waiting up to `wait_s` for one to appear."""
    deadline = time.monotonic() + wait_s
    while (pid := holder(port)) is None:
        if time.monotonic() >= deadline:
            raise AttachError(f"no agent on port {port} (start one with `launch_agents --config ...`)")
        time.sleep(0.2)
    return pid


def connect_agent(cfg: ServingConfig, index: int, tag: str, timeout_s: float = 600.0,
                  reset: bool = False, wait_s: float = 0.0, lead: AgentClient | None = None) -> AgentClient:
    """Attach to agent `index` (waiting while it loads); `reset` first detaches any other server;
    `wait_s`: how long a local agent may take to appear (its launcher restarting it); `lead`: its
    group's rank 0, whose arena it reads. Checks that it is the rank of the group it should be."""
    port = cfg.agent_ports[index]
    host = cfg.agent_host(index)
    pid = _agent_pid(port, wait_s) if is_local(host) else None
    client = AgentClient(agent_address(port, host), arena_spec(cfg), tag=tag, pid=pid,
                         curve=KeyFolder.find(cfg.curve_keys), lead=lead)
    try:
        if reset:
            client.call(P.RESET, timeout_s=timeout_s)
        files = resolve_model(cfg.model_path, cfg.model_cfg_path)
        info = client.handshake(cfg.geometry, model_identity(cfg.model_name, files, cfg.lora_modules), timeout_s)
        if not cfg.num_blocks:  # num_blocks: auto, attached: the agents sized the pool (0 matches any)
            cfg.num_blocks = int(info.geometry["num_blocks"])
        want = (index % cfg.tensor_parallel_size, cfg.tensor_parallel_size)
        if (info.tp_rank, info.tp_size) != want:
            raise AttachError(f"agent on port {port} is tensor-parallel rank {info.tp_rank} of {info.tp_size}, not "
                              f"rank {want[0]} of {want[1]}: start the agents from the same config "
                              "(serving_config.tensor_parallel_size)")
    except AgentError as exc:
        client.close(detach=False)
        raise AttachError(f"agent on port {port} refused: {exc}") from None
    except AgentDead:
        client.close(detach=False)
        raise AttachError(f"agent on port {port} exited before it was ready") from None
    except BaseException:
        client.close(detach=False)
        raise
    return client


def connect_replica(cfg: ServingConfig, index: int, tag: str, timeout_s: float = 600.0, reset: bool = False,
                    wait_s: float = 0.0) -> AgentLink:
    """Attach to replica `index`: its one agent, or every rank of its tensor-parallel group."""
    ranks: list[AgentClient] = []
    try:
        for r, i in enumerate(cfg.groups[index]):
            ranks.append(connect_agent(cfg, i, f"{tag}" if r == 0 else f"{tag}r{r}", timeout_s, reset, wait_s,
                                       ranks[0] if ranks else None))
    except BaseException:
        for c in reversed(ranks):
            c.close(detach=True)
        raise
    return ranks[0] if len(ranks) == 1 else GroupClient(ranks)


def connect_agents(cfg: ServingConfig, reset: bool = False, wait_s: float = 0.0) -> list[AgentLink]:
    """One client per replica (a GroupClient for tensor-parallel ranks); `wait_s`: how long a local
    agent may take to appear."""
    clients: list[AgentLink] = []
    try:
        for i in range(len(cfg.groups)):
            clients.append(connect_replica(cfg, i, f"agent{i}", reset=reset, wait_s=wait_s))
    except BaseException:
        for c in clients:
            c.close(detach=True)
        raise
    return clients


def vocab_mismatch(cfg: ServingConfig, tokenizer: int, model: int) -> str | None:
    """Why this tokenizer or YAML does not belong to the model, or None. A model's embedding may be
    padded past its tokenizer (Qwen2: 151936 rows for 151665 ids), by a little."""
    if cfg.vocab_size is not None and cfg.vocab_size != model:
        return f"model_config.vocab_size is {cfg.vocab_size}, the model has {model}: the YAML describes another model"
    if tokenizer > model or model - tokenizer > max(256, model // 50):
        return (f"the tokenizer has {tokenizer} ids, the model {model}: tokenizer.vocab_file does not belong to "
                "the model")
    return None


def restarter(cfg: ServingConfig, config_path: str | None, overrides: dict[str, Any],
              procs: list) -> Callable[[int, bool], AgentLink]:
    """How the engine brings agent i back: respawn it when we started it, else wait for its
    launcher (launch_agents restarts it) until the recovery deadline; then attach again. An agent
    taken from us by `r` (`reattach`) is attached again as it is, model loaded: while another live
    server holds it the attach fails (and is retried), it is never killed."""
    generation = itertools.count(1)

    def restart(index: int, reattach: bool = False) -> AgentLink:
        if procs and not (reattach and all(procs[i].is_alive() for i in cfg.groups[index])):
            respawn_group(cfg, config_path, overrides, procs, index)
        return connect_replica(cfg, index, f"agent{index}g{next(generation)}", timeout_s=cfg.recovery_deadline_s,
                               wait_s=cfg.recovery_deadline_s)

    return restart


START_ERRORS = (AgentStartError, AttachError, CurveKeyError, TimeoutError, OSError, ValueError)


def start_engine(cfg: ServingConfig, config_path: str | None, overrides: dict[str, Any], attach: bool = False,
                 reset: bool = False, wait_s: float = 0.0) -> tuple[Engine, TextTokenizer, list]:
    """Tokenizer, agents (started here unless `attach`; attached agents may take `wait_s` to appear),
    attachment, vocabulary check, and the engine running: what the HTTP server and the offline API
    share. Raises one of START_ERRORS."""
    procs: list = []
    try:
        tok = load_tokenizer(resolve_model(cfg.model_path, cfg.model_cfg_path), cfg.tokenizer_path, cfg.chat_template)
        if not attach:
            procs = start_agents(cfg, config_path, overrides)
        clients = connect_agents(cfg, reset=reset, wait_s=wait_s)
        why = vocab_mismatch(cfg, tok.vocab_size, clients[0].info.vocab_size)
        if why:
            for c in clients:
                c.close(detach=True)
            raise AttachError(why)
    except BaseException:
        stop_agents(procs)
        raise
    try:
        engine = Engine(cfg, tok, clients, restart=restarter(cfg, config_path, overrides, procs))
    except HandoverError as exc:  # disaggregated agents started with other dtypes: nothing is served wrong
        for c in clients:
            c.close(detach=True)
        stop_agents(procs)
        raise AttachError(str(exc)) from None
    engine.start()
    return engine, tok, procs
