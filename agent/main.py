"""Agent process boot: pin, take the port, load the model for this device (its tensor-parallel
rank's share), warm it up, then serve step commands over ZeroMQ (agent/server.py).

Module import stays light (no mindspore) so the launcher can name `agent_process` as a spawn target.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from agent.server import AgentServer
from common.config import ServingConfig
from common.cpu import apply_isa_cap
from shm.curve import INSECURE_ENV, KeyFolder, exposure
from shm.endpoint import PortInUse, PortLock, agent_address

log = logging.getLogger("llm_serving.agent")


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


def _serve(cfg: ServingConfig, index: int, owner_pid: int | None, tp_link: str | None) -> None:
    _pin(index, len(cfg.agent_ports), cfg.agent_cores)
    os.environ["LLM_SERVING_DEVICE"] = cfg.device  # read by the native kernels' switch too
    os.environ["DEVICE_ID"] = str(cfg.start_device_id + index)
    apply_isa_cap()  # before MindSpore's oneDNN first dispatches
    from agent.boot import load_runner  # MindSpore from here on

    runner, info = load_runner(cfg, index, owner_pid, tp_link)
    server = AgentServer(agent_address(cfg.agent_ports[index], cfg.bind_host(index)), runner, info, owner_pid,
                         KeyFolder.find(cfg.curve_keys))
    server.serve()
    if server.failed:
        sys.exit(3)
