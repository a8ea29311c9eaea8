"""Nobody else in, through real processes on loopback: HTTP API keys, connection limits (idle and
slow-header sockets are closed, oversized headers refused), owner-only agent sockets and segments,
and a server whose agent was taken by `r` attaches to it again instead of reloading it."""
from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import httpx
import openai
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from shm import protocol as P
from shm.arena import our_segments
from tests.helpers import ServerProcess, tiny_config

KEYS = ("k-one", "k-two")
NOBODY = 65534


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("access")
    runtime = tmp / "run"
    runtime.mkdir()
    runtime.chmod(0o755)  # other users may look in, as in /tmp
    env = {"LLM_SERVING_RUNTIME_DIR": str(runtime), "LLM_SERVING_API_KEY": KEYS[1]}
    config = tiny_config(tmp, tiny_model_dir, http_header_timeout_s=1.0, http_keepalive_timeout_s=1.0,
                         max_header_bytes=16384)
    srv = ServerProcess(config, "--api-key", KEYS[0], env=env)
    srv.runtime = runtime
    yield srv
    srv.stop()


def _auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ROUTES = [("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
          ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
          ("/models/tiny/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
          ("/models/tiny/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
          ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
          ("/", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})]


@pytest.mark.parametrize("path, body", ROUTES)
def test_every_generation_route_needs_a_key(server, path, body):
    for headers in ({}, _auth("wrong"), {"Authorization": KEYS[0]}, {"Authorization": f"Basic {KEYS[0]}"}):
        r = httpx.post(server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and "API key" in r.text, (headers, r.text)
        if path.startswith("/v1/"):
            assert r.json()["error"]["type"] == "authentication_error"
    for key in KEYS:  # the flag's and the environment's
        assert httpx.post(server.url + path, json=body, headers=_auth(key), timeout=60).status_code == 200


def test_probes_stay_open_and_models_need_a_key(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=_auth(), timeout=10).status_code == 200
    assert KEYS[0] not in server.log.read_text() and KEYS[1] not in server.log.read_text()  # never logged


def test_the_official_openai_client_streams_with_its_key(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0], max_retries=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.text(max_size=40), st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                       st.sampled_from(["Bearer", "Bearer ", "bearer k-one", "Bearer  k-one", "Bearer k-one ",
                                        "Bearer k-one\t", "Bearer k-onee", "BEARER k-two", "Bearer \x00"])))
def test_fuzzed_authorization_headers_never_500(server, value):
    try:
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": value}, timeout=10)
    except (httpx.LocalProtocolError, UnicodeEncodeError):
        return  # the client itself refuses the header
    assert r.status_code in (200, 400, 401), (value, r.status_code)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mib(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def test_idle_and_slow_header_sockets_are_closed_and_service_holds(server):
    pid = server.proc.pid
    httpx.get(f"{server.url}/health", timeout=10)
    base, rss = _fds(pid), _rss_mib(pid)
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    idle = [socket.create_connection((host, port)) for _ in range(2000)]
    slow = [socket.create_connection((host, port)) for _ in range(200)]
    for s in slow:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    for _ in range(3):  # served beside them
        r = httpx.post(f"{server.url}/generate", json=ROUTES[0][1], headers=_auth(), timeout=60)
        assert r.status_code == 200
    for s in slow:  # one header byte at a time: never finishing within the header timeout
        s.sendall(b"X")
    deadline = time.monotonic() + 120  # a hang's bound, not a speed
    for s in idle + slow:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        data = s.recv(4096)  # EOF once the server closes it (a socket.timeout here fails the test)
        assert data == b"", data[:80]
        s.close()
    while _fds(pid) > base + 2:  # the server closes its ends as it notices
        assert time.monotonic() < deadline, (base, _fds(pid))
        time.sleep(0.1)
    assert _rss_mib(pid) < rss + 64, (rss, _rss_mib(pid))


def test_oversized_headers_are_refused_at_once(server):
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    with socket.create_connection((host, port)) as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while we were still sending
        s.settimeout(60)  # a hang's bound: the server answers or closes at once
        reply = b""
        try:
            while chunk := s.recv(4096):
                reply += chunk
        except ConnectionResetError:
            pass
    assert reply == b"" or reply.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), reply[:100]


def _as_nobody_reset(address: str, segments: list[Path]) -> bytes:
    """In a forked child running as uid `nobody`: open the arena segments (b"opened" if any opens),
    then connect to the agent and send `r`; b"reply" or b"none"."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, then try
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            for seg in segments:
                try:
                    os.close(os.open(seg, os.O_RDWR))
                    os.write(write, b"opened")
                except PermissionError:
                    pass
            s = zmq.Context().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            s.send_multipart(P.encode(P.RESET, {"id": 1}), zmq.NOBLOCK)
            os.write(write, b"reply" if s.poll(2000) else b"none")
        except zmq.Again:
            os.write(write, b"none")  # nothing to connect to: the message cannot even be queued
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        return f.read()


def test_agent_endpoints_are_owner_only_and_another_uid_cannot_take_the_agent(server):
    port = server.config["serving_config"]["agent_ports"][0]
    sock, lock = (server.runtime / f"llm-serving-agent-{port}.{ext}" for ext in ("sock", "lock"))
    address = f"ipc://{sock}"
    for path in (sock, lock):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path, oct(path.stat().st_mode))
    segments = [Path("/dev/shm") / s for s in our_segments() if int(s.split("-")[1]) == server.proc.pid]
    assert segments and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in segments)
    assert _as_nobody_reset(address, segments) == b"none"
    before = server.agent_pids()
    r = httpx.post(f"{server.url}/generate", json=ROUTES[0][1], headers=_auth(), timeout=60)
    assert r.status_code == 200 and server.agent_pids() == before
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


def test_an_agent_taken_by_r_is_attached_again_not_reloaded(server):
    port = server.config["serving_config"]["agent_ports"][0]
    address = f"ipc://{server.runtime}/llm-serving-agent-{port}.sock"
    [agent] = server.agent_pids()
    want = httpx.post(f"{server.url}/generate", json={"inputs": "again", "parameters": {
        "max_new_tokens": 6, "ignore_eos": True}}, headers=_auth(), timeout=60).json()["generated_text"]
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    s.send_multipart(P.encode(P.RESET, {"id": 1}))
    assert s.poll(5000) and P.decode_reply(s.recv_multipart())[0]  # a stranger (same uid) sends `r`
    s.close()
    t0 = time.monotonic()
    while True:  # the next heartbeat (1 s idle ping here) finds it detached; the server attaches again
        r = httpx.post(f"{server.url}/generate", json={"inputs": "again", "parameters": {
            "max_new_tokens": 6, "ignore_eos": True}}, headers=_auth(), timeout=60)
        if r.status_code == 200 and httpx.get(f"{server.url}/metrics", timeout=10).text.count(
                "llm_serving_agent_restarts_total 1.0"):
            break
        assert time.monotonic() - t0 < 120, r.text  # a hang's bound: heartbeats here are 1 s apart
        time.sleep(0.3)
    assert r.json()["generated_text"] == want
    assert server.agent_pids() == [agent]  # the same process: no model reload


def test_curve_agents_serve_their_server_and_ignore_anyone_else(tmp_path, tiny_model_dir):
    """Agents on tcp (127.0.0.2) with CURVE keys: the server holding the listed key serves; a client
    with no key, or with a key the agent does not list, gets no reply to `r`, and the attached server
    goes on untouched."""
    from tests.helpers import Launcher
    from tools.curve_keys import make

    keys = tmp_path / "keys"
    make(keys)
    stranger = tmp_path / "stranger"
    make(stranger)  # a complete, valid keypair set: just not this agent's
    config = tiny_config(tmp_path, tiny_model_dir, agent_ip="127.0.0.2", curve_keys=str(keys))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    launcher = Launcher(config, env)
    srv = ServerProcess(config, "--attach", env=env)
    try:
        body = {"inputs": "secret", "parameters": {"max_new_tokens": 5, "ignore_eos": True}}
        want = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()["generated_text"]
        port = srv.config["serving_config"]["agent_ports"][0]
        for folder in (None, stranger):
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if folder is not None:
                from shm.curve import KeyFolder
                pub, sec = KeyFolder(folder).pair("server")
                s.curve_publickey, s.curve_secretkey = pub, sec
                s.curve_serverkey = KeyFolder(keys).public("agent")  # even knowing the agent's public key
            s.connect(f"tcp://127.0.0.2:{port}")
            s.send_multipart(P.encode(P.RESET, {"id": 1}))
            assert not s.poll(2000), folder
            s.close()
        assert httpx.get(f"{srv.url}/health", timeout=10).json()["status"] == "ok"
        assert httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()["generated_text"] == want
        assert "llm_serving_agent_restarts_total 0.0" in httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        srv.stop()
        launcher.proc.terminate()
        launcher.proc.wait(30)


def test_plain_tcp_beyond_loopback_is_refused_without_insecure(tmp_path, tiny_model_dir):
    """Nothing is sent anywhere: the start stops before an agent binds 0.0.0.0."""
    import subprocess
    import sys

    from shm.curve import exposure
    from tests.helpers import ROOT

    config = tiny_config(tmp_path, tiny_model_dir, agent_ip="0.0.0.0")
    for module in ("llm_serving.launch", "llm_serving.serve"):
        out = subprocess.run([sys.executable, "-m", module, "--config", str(config)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 1 and "not a loopback address" in out.stderr and "--insecure" in out.stderr
    assert exposure("0.0.0.0", None, insecure=True)[1].endswith("serving anyway (--insecure)")
    assert exposure("127.0.0.2", None, insecure=False) == (None, None)
    assert exposure("::1", None, insecure=False) == (None, None)


def test_agent_addresses_from_the_orchestrator(tmp_path, tiny_model_dir):
    """`--agents host:port` (what a Kubernetes Service or LeaderWorkerSet hands over) overrides the
    YAML's ports and attaches; LWS variables name the group's workers; `launch_agents --bind` beyond
    loopback needs keys."""
    import subprocess
    import sys

    import yaml

    from shm.endpoint import lws_agents, parse_agents
    from tests.helpers import ROOT, free_port
    from tests.helpers import Launcher

    assert lws_agents({"LWS_LEADER_ADDRESS": "llm-0.llm.default", "LWS_GROUP_SIZE": "3", "LWS_WORKER_INDEX": "0"},
                      61166) == [("llm-0-1.llm.default", 61166), ("llm-0-2.llm.default", 61166)]
    assert lws_agents({"LWS_LEADER_ADDRESS": "llm-0.llm", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}, 1) is None
    assert parse_agents("10.0.0.5:61166, [::1]:7") == [("10.0.0.5", 61166), ("::1", 7)]
    with pytest.raises(ValueError, match="expected host:port"):
        parse_agents("nohost")

    config = tiny_config(tmp_path, tiny_model_dir, agent_ip="127.0.0.2")
    launcher = Launcher(config, {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = yaml.safe_load(config.read_text())["serving_config"]["agent_ports"][0]
        other = yaml.safe_load(config.read_text())
        other["serving_config"].update(agent_ports=[free_port()], agent_ip="127.0.0.1", server_port=free_port())
        elsewhere = tmp_path / "elsewhere.yaml"
        elsewhere.write_text(yaml.safe_dump(other))
        srv = ServerProcess(elsewhere, "--agents", f"127.0.0.2:{port}")
        try:
            r = httpx.post(f"{srv.url}/generate", json={"inputs": "where", "parameters": {"max_new_tokens": 3}},
                           timeout=60)
            assert r.status_code == 200 and "agents: 127.0.0.2:" in srv.log.read_text()
        finally:
            srv.stop()
        assert launcher.proc.poll() is None  # attached, not started: the agent stays with its launcher
    finally:
        launcher.proc.terminate()
        launcher.proc.wait(30)
    out = subprocess.run([sys.executable, "-m", "llm_serving.launch", "--config", str(config), "--bind", "0.0.0.0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "agent_ip 0.0.0.0 is not a loopback address" in out.stderr
