"""The original's start commands: `python examples/start_agent.py --config X` (our launch_agents),
`python examples/server_app_post.py --config X` (llm-serving --attach) and `python examples/start.py
--config X` (llm-serving), through real processes, serving the same tokens."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.helpers import ROOT, ServerProcess, tiny_config


def _tokens(url: str) -> list[int]:
    body = {"inputs": "the original's scripts", "parameters": {"max_new_tokens": 6, "ignore_eos": True,
                                                               "details": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def test_the_original_start_scripts_start_our_processes(tmp_path, tiny_model_dir):
    runtime = tmp_path / "run"
    runtime.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLM_SERVING_RUNTIME_DIR": str(runtime)}
    config = tiny_config(tmp_path, tiny_model_dir)
    log = tmp_path / "start_agent.log"
    agents = subprocess.Popen([sys.executable, "examples/start_agent.py", "--config", str(config)], cwd=ROOT,
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "all agents started" not in log.read_text():  # the original launcher's ready line
            assert agents.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        server = ServerProcess(config, env=env, script="examples/server_app_post.py")
        try:
            attached = _tokens(server.url)
        finally:
            server.stop()
        assert agents.poll() is None  # the agents outlive the server, as launch_agents' do
    finally:
        agents.send_signal(signal.SIGTERM)
        assert agents.wait(30) in (0, 128 + signal.SIGTERM)
    assert list(runtime.iterdir()) == []  # no socket or lock file left

    both = ServerProcess(config, env=env, script="examples/start.py")
    try:
        assert _tokens(both.url) == attached
        assert len(both.agent_pids()) == 1  # it started its own agent
    finally:
        both.stop()
    assert list(runtime.iterdir()) == []
