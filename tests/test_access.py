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


def test_idle_and_slow_header_sockets_are_closed_and_service_holds(server):
    pid = server.proc.pid
    httpx.get(f"{server.url}/health", timeout=10)
    base = _fds(pid)
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/generate", json=ROUTES[0][1], headers=_auth(), timeout=60)
    quiet = time.monotonic() - t0
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    idle = [socket.create_connection((host, port)) for _ in range(400)]
    slow = [socket.create_connection((host, port)) for _ in range(40)]
    for s in slow:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    busy_t = []
    for _ in range(3):
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/generate", json=ROUTES[0][1], headers=_auth(), timeout=60)
        busy_t.append(time.monotonic() - t0)
        assert r.status_code == 200
    for s in slow:  # one header byte at a time: never finishing within the header timeout
        s.sendall(b"X")
    deadline = time.monotonic() + 10
    for s in idle + slow:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        data = s.recv(4096)  # EOF once the server closes it (a socket.timeout here fails the test)
        assert data == b"", data[:80]
        s.close()
    assert min(busy_t) < max(0.5, 2 * quiet), (quiet, busy_t)
    time.sleep(0.5)
    assert _fds(pid) <= base + 2, (base, _fds(pid))


def test_oversized_headers_are_refused_at_once(server):
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    with socket.create_connection((host, port)) as s:
        t0 = time.monotonic()
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while we were still sending
        s.settimeout(5)
        reply = b""
        try:
            while chunk := s.recv(4096):
                reply += chunk
        except ConnectionResetError:
            pass
    assert time.monotonic() - t0 < 2
    assert reply == b"" or reply.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), reply[:100]


def _as_nobody_reset(address: str) -> bytes:
    """In a forked child running as uid `nobody`: connect to the agent and send `r`; b"reply" or b"none"."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, then try
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
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
    assert _as_nobody_reset(address) == b"none"
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
        assert time.monotonic() - t0 < 15, r.text
        time.sleep(0.3)
    assert r.json()["generated_text"] == want
    assert server.agent_pids() == [agent]  # the same process: no model reload
