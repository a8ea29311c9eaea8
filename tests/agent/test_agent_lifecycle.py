"""The agent protocol as deployed: `launch_agents` agents outlive the servers that attach to them
(`#`, `e`, `r`), refuse a mismatched server and a second agent on their port, and leave no
process, socket file or shared-memory segment behind. Real processes throughout."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from shm.arena import our_segments
from tests.helpers import Launcher, ServerProcess, free_port, run_python, tiny_config

PROMPT = "agents outlive servers"
NEW = 12
SERVERS: list[int] = []  # pids of every server this module started


def _server(config: Path, *args: str, env: dict[str, str]) -> ServerProcess:
    srv = ServerProcess(config, *args, env=env)
    SERVERS.append(srv.proc.pid)
    return srv


def _generate(url: str) -> list[int]:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "ignore_eos": True, "details": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def _other_http_port(config: Path) -> Path:
    """The same deployment with its own HTTP port: a second server beside a stuck one."""
    doc = yaml.safe_load(config.read_text())
    doc["serving_config"]["server_port"] = free_port()
    path = config.with_name(f"{config.stem}-{doc['serving_config']['server_port']}.yaml")
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("lifecycle")
    runtime = tmp / "run"
    runtime.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLM_SERVING_RUNTIME_DIR": str(runtime)}
    config = tiny_config(tmp, tiny_model_dir, n_agents=2)
    launcher = Launcher(config, env)
    yield config, launcher, env, runtime
    if launcher.proc.poll() is None:
        os.killpg(launcher.proc.pid, signal.SIGKILL)


def test_agents_outlive_servers_and_r_frees_them_from_a_stuck_one(deployment):
    config, launcher, env, _ = deployment
    agents = launcher.agent_pids()
    assert len(agents) == 2
    a = _server(config, "--attach", env=env)
    want = _generate(a.url)
    assert a.stop() in (0, 128 + signal.SIGTERM)  # detaches with `e`
    assert launcher.agent_pids() == agents  # still up, not restarted

    b = _server(config, "--attach", env=env)
    assert _generate(b.url) == want
    os.killpg(b.proc.pid, signal.SIGKILL)  # no `e`: the agents notice the dead pid themselves
    b.proc.wait(10)

    c = _server(config, "--attach", env=env)
    assert _generate(c.url) == want
    os.kill(c.proc.pid, signal.SIGSTOP)  # stuck, alive, still attached
    try:
        other = _other_http_port(config)
        busy = run_python("-m", "llm_serving.serve", "--config", str(other), "--attach", env=env)  # refused, no wait
        assert busy.returncode == 1
        assert f"attached to server pid {c.proc.pid}" in busy.stderr and "send r" in busy.stderr
        d = _server(other, "--attach", "--reset-agents", env=env)  # `r` takes them over
        assert _generate(d.url) == want
        os.kill(c.proc.pid, signal.SIGCONT)  # C wakes up: its next heartbeat finds the agents gone
        deadline = time.monotonic() + 30
        while httpx.get(f"{c.url}/health", timeout=10).json()["status"] == "ok":
            assert time.monotonic() < deadline, "the woken server never noticed"
            time.sleep(0.5)
        assert _generate(d.url) == want  # and it did not kill D's agents
        d.stop()
    finally:
        os.kill(c.proc.pid, signal.SIGCONT)
        c.stop(signal.SIGKILL)
    assert launcher.agent_pids() == agents


def test_each_agent_runs_on_its_own_device_id(deployment):
    """Agent i on device start_device_id + i, as MindSpore itself reports it in that agent."""
    config, _, env, _ = deployment
    srv = _server(config, "--attach", env=env)
    try:
        assert httpx.get(f"{srv.url}/stats", timeout=10).json()["devices"] == ["CPU:0", "CPU:1"]
    finally:
        srv.stop()


def test_agent_client_speaks_the_protocol_with_the_same_tokens(deployment):
    config, _, env, _ = deployment
    got = run_python("tools/agent_client.py", "--config", str(config), "--prompt", PROMPT, "--max-tokens", str(NEW),
               "--ignore-eos", "--json", env=env)
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    assert [s["cmd"] for s in out["steps"]] == ["*"] + ["a"] * (NEW - 1)
    srv = _server(config, "--attach", env=env)  # the client detached with `e`
    try:
        assert _generate(srv.url) == out["token_ids"]
    finally:
        srv.stop()


def test_mismatched_geometry_is_refused_naming_both_values(deployment, tmp_path):
    config, _, env, _ = deployment
    doc = yaml.safe_load(config.read_text())
    doc["pa_config"]["block_size"] = 8
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(doc))
    r = run_python("-m", "llm_serving.serve", "--config", str(other), "--attach", env=env)
    assert r.returncode == 1
    assert "geometry mismatch: server has block_size=8, agent has block_size=4" in r.stderr


def test_a_tokenizer_larger_than_the_model_is_refused(deployment, tmp_path):
    from tokenizers import Tokenizer

    config, _, env, _ = deployment
    doc = yaml.safe_load(config.read_text())
    tok = Tokenizer.from_file(str(Path(doc["model_config"]["model_path"]) / "tokenizer.json"))
    tok.add_special_tokens([f"<extra_{i}>" for i in range(40)])  # 300 ids against the model's 272
    tok.save(str(tmp_path / "tokenizer.json"))
    doc["tokenizer"] = {"vocab_file": str(tmp_path / "tokenizer.json")}
    other = tmp_path / "big-vocab.yaml"
    other.write_text(yaml.safe_dump(doc))
    r = run_python("-m", "llm_serving.serve", "--config", str(other), "--attach", env=env)
    assert r.returncode == 1 and "the tokenizer has 300 ids, the model 272" in r.stderr


def test_a_tcp_agent_port_held_on_this_host_is_refused_before_loading(tmp_path, tiny_model_dir):
    """A launcher whose tcp agent's port another agent of this host holds: one line, exit 1 (its
    ping would otherwise reach the holder and call its own agent ready)."""
    from shm.endpoint import PortLock

    env = {**os.environ, "LLM_SERVING_RUNTIME_DIR": str(tmp_path)}
    port = free_port()
    os.environ["LLM_SERVING_RUNTIME_DIR"] = str(tmp_path)
    try:
        lock = PortLock(port)
    finally:
        del os.environ["LLM_SERVING_RUNTIME_DIR"]
    try:
        config = tiny_config(tmp_path, tiny_model_dir, agent_ip="127.0.0.2", agent_ports=[port])
        r = run_python("-m", "llm_serving.launch", "--config", str(config), "--insecure", env=env)
        assert r.returncode == 1 and f"port {port} in use by pid {os.getpid()}" in r.stderr, r.stderr
        assert "agent0" not in r.stderr  # the launcher's own line: no agent process was started
    finally:
        lock.release()


def test_busy_agent_port_and_http_port_fail_fast(deployment, tmp_path):
    config, launcher, env, _ = deployment
    r = run_python("-m", "llm_serving.launch", "--config", str(config), env=env)
    assert r.returncode == 1 and "weights loaded" not in r.stderr  # refused before any agent loads
    port = yaml.safe_load(config.read_text())["serving_config"]["agent_ports"][0]
    assert f"port {port} in use by pid {launcher.agent_pids()[0]}" in r.stderr

    srv = _server(config, "--attach", env=env)
    try:
        doc = yaml.safe_load(config.read_text())
        doc["serving_config"]["agent_ports"] = [free_port()]  # would start a fresh agent...
        second = tmp_path / "second.yaml"
        second.write_text(yaml.safe_dump(doc))
        r = run_python("-m", "llm_serving.serve", "--config", str(second), env=env)  # ...but its HTTP port is taken
        assert r.returncode == 1 and "weights loaded" not in r.stderr  # refused before any agent loads
        assert f"HTTP port {doc['serving_config']['server_port']}" in r.stderr
        doc["serving_config"]["server_port"] = free_port()
        second.write_text(yaml.safe_dump(doc))
        no_agent = run_python("-m", "llm_serving.serve", "--config", str(second), "--attach", env=env)
        assert no_agent.returncode == 1 and "no agent on port" in no_agent.stderr
    finally:
        srv.stop()


def test_stopping_launch_agents_leaves_nothing_behind(deployment):
    _, launcher, _, runtime = deployment
    agents = launcher.agent_pids()
    os.kill(launcher.proc.pid, signal.SIGTERM)
    launcher.proc.wait(60)
    deadline = time.monotonic() + 60  # a hang's bound: the launcher stopped them before it exited
    while [p for p in agents if Path(f"/proc/{p}").exists()] or list(runtime.iterdir()):  # no socket or lock file
        assert time.monotonic() < deadline, (agents, list(runtime.iterdir()))
        time.sleep(0.1)
    assert len(SERVERS) >= 5
    assert not [s for s in our_segments() if int(s.split("-")[1]) in SERVERS]


def test_agents_of_a_killed_llm_serving_exit_and_clean_up(tmp_path, tiny_model_dir):
    runtime = tmp_path / "run"
    runtime.mkdir()
    env = {**os.environ, "LLM_SERVING_RUNTIME_DIR": str(runtime)}
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir), env=env)
    [agent] = srv.agent_pids()
    assert sorted(p.suffix for p in runtime.iterdir()) == [".lock", ".sock"]
    srv.proc.kill()  # the server alone: its agent notices its launcher is gone
    srv.proc.wait(10)
    deadline = time.monotonic() + 120  # a hang's bound, not a speed: the agent exits when it sees the pid gone
    while Path(f"/proc/{agent}").exists() and "Z" not in Path(f"/proc/{agent}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the agent outlived the server that started it"
        time.sleep(0.1)
    while list(runtime.iterdir()):  # its socket and lock go as it exits
        assert time.monotonic() < deadline, list(runtime.iterdir())
        time.sleep(0.1)


def test_a_dead_launcher_is_unhealthy_at_once_and_a_new_one_is_reattached(tmp_path, tiny_model_dir):
    """SIGKILL of launch_agents: its agent exits and nobody will restart it. The attached server says
    so on /health before its next heartbeat could (heartbeat_s 25: it sees the agent's pid go), fails
    requests with 503 and the reason, and re-attaches by itself when launch_agents is started again
    (no server restart)."""
    runtime = tmp_path / "run"
    runtime.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLM_SERVING_RUNTIME_DIR": str(runtime)}
    config = tiny_config(tmp_path, tiny_model_dir, heartbeat_s=25)
    launcher = Launcher(config, env)
    srv = _server(config, "--attach", env=env)
    relaunched = None
    try:
        want = _generate(srv.url)
        [agent] = launcher.agent_pids()
        os.kill(launcher.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while (health := httpx.get(f"{srv.url}/health", timeout=10)).status_code == 200:
            assert time.monotonic() - killed < 20, "the server waited for a heartbeat to notice"
            time.sleep(0.02)
        assert "launcher" in health.json()["reason"], health.text
        for path, body in (("/generate", {"inputs": "anyone?"}), ("/v1/completions", {"prompt": "x", "stream": True})):
            r = httpx.post(srv.url + path, json=body, timeout=30)
            assert r.status_code == 503 and "launcher" in r.text, r.text
        deadline = time.monotonic() + 10
        while Path(f"/proc/{agent}").exists() and "Z" not in Path(f"/proc/{agent}/stat").read_text().split()[2]:
            assert time.monotonic() < deadline, "the orphaned agent did not exit"
            time.sleep(0.1)
        relaunched = Launcher(config, env)
        deadline = time.monotonic() + 120
        while httpx.get(f"{srv.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the server did not re-attach"
            time.sleep(0.2)
        assert _generate(srv.url) == want
    finally:
        srv.stop()
        for proc in (launcher.proc, relaunched.proc if relaunched else None):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(30)
