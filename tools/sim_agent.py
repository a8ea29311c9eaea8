"""Simulated agents for measuring the server alone (benchmark code, never a product path): each one
the real protocol server (agent/server.py) on its real port, over ZeroMQ and the server's shared-memory
arena, with a runner that answers every sampled row at once with one fixed token. N of them run as
threads of one process, so they take little of the machine the server runs on.

    python -m tools.sim_agent --config X.yaml [--token " the"]   # every agent_ports entry; until SIGTERM
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np

from agent.runner_config import RunnerConfig
from agent.server import AgentServer
from common.config import ServingConfig, load_config
from common.model_files import model_identity, resolve_model
from common.tokenizer import load_tokenizer
from shm.endpoint import PortLock, agent_address
from shm.messages import AgentInfo
from shm.step import StepView


class SimRunner:
    """What AgentServer asks of a model runner; a step costs nothing and samples `token` everywhere."""

    def __init__(self, cfg: ServingConfig, vocab_size: int, token: int):
        self.rc, self.cfg, self.token = RunnerConfig.from_serving(cfg), SimpleNamespace(vocab_size=vocab_size), token
        self.graph_compiles = 0

    def reset(self) -> None:
        pass

    def step(self, v: StepView, free: list[int], grammars: Any = None, histories: Any = None) -> float:
        rows = np.nonzero(v.inputs.sample)[0]
        out = v.outputs
        out.ids[rows], out.logprobs[rows] = self.token, 0.0
        out.top_ids[rows], out.top_logprobs[rows] = self.token, 0.0
        out.drafted[:] = out.accepted[:] = 0
        return 0.0


def agent_info(cfg: ServingConfig, vocab_size: int, eos: list[int]) -> AgentInfo:
    files = resolve_model(cfg.model_path, cfg.model_cfg_path)
    return AgentInfo(vocab_size, eos, cfg.geometry, model_identity(cfg.model_name, files, cfg.lora_modules),
                     kv_cache_dtype="float32", kernels="simulated: no model")


def serve_all(cfg: ServingConfig, token_text: str) -> list[AgentServer]:
    """Every agent_ports entry as a simulated agent on its own thread (its port taken as an agent's)."""
    tok = load_tokenizer(resolve_model(cfg.model_path, cfg.model_cfg_path))
    vocab = max(tok.vocab_size, max(tok.eos_token_ids) + 1)
    token = tok.encode(token_text)[0]
    servers = []
    for port in cfg.agent_ports:
        PortLock(port)  # held for the process's life: the server sees an agent on the port
        server = AgentServer(agent_address(port, cfg.agent_ip), SimRunner(cfg, vocab, token),
                             agent_info(cfg, vocab, list(tok.eos_token_ids)))
        threading.Thread(target=server.serve, name=f"sim-{port}", daemon=True).start()
        servers.append(server)
    return servers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sim_agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--token", default=" the", help="the text whose first token every row samples")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    serve_all(cfg, args.token)
    print(f"{len(cfg.agent_ports)} simulated agents ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
