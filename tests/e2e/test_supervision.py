"""Supervision through real processes: a killed, stopped or idle agent never leaves a request hanging;
the agent comes back and its requests finish with the text an undisturbed run gives."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx

from shm.arena import our_segments
from tests.helpers import ServerProcess, tiny_config
from tests.e2e.clients import GENERATED, concurrent, metric, original_generate, server_idle, wait_generating

PROMPTS = [f"prompt number {i}" for i in range(4)]
NEW = 60


def _disturbed_run_matches_undisturbed(srv: ServerProcess, disturb) -> list[str]:
    """Undisturbed texts first; then the same requests with `disturb(agent_pid)` mid-stream.
    Returns the /health statuses seen until the server is ok again."""
    single = {p: original_generate(srv.url, p, new=NEW)["generated_text"] for p in PROMPTS}
    [pid] = srv.agent_pids()
    before = metric(srv.url, GENERATED)
    out, threads = concurrent(srv.url, PROMPTS, NEW)
    wait_generating(srv.url, before)  # mid-stream
    disturb(pid)
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        health = httpx.get(f"{srv.url}/health", timeout=5)
        seen.append(health.json()["status"])
        if seen[-1] == "ok" and "recovering" in seen:
            break
        time.sleep(0.1)
    for t in threads:
        t.join(120)
    assert out == single  # recomputed on the restarted agent from the tokens generated so far
    assert srv.agent_pids() != [pid]
    assert metric(srv.url, "llm_serving_agent_restarts_total") == 1
    return seen


def test_sigkill_of_the_only_agent_mid_stream_restarts_it(tmp_path, tiny_model_dir):
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir))
    try:
        seen = _disturbed_run_matches_undisturbed(srv, lambda pid: os.kill(pid, signal.SIGKILL))
        assert seen[-1] == "ok" and "recovering" in seen
    finally:
        srv.stop()


def test_sigstopped_agent_is_killed_after_step_timeout_and_restarted(tmp_path, tiny_model_dir):
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, step_timeout_s=3))
    try:
        seen = _disturbed_run_matches_undisturbed(srv, lambda pid: os.kill(pid, signal.SIGSTOP))
        assert seen[-1] == "ok"
    finally:
        srv.stop()


def test_idle_remote_agent_outlives_its_idle_limit(tmp_path, tiny_model_dir):
    """A tcp agent exits after LLM_SERVING_REMOTE_IDLE_S without a message: heartbeats keep it."""
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, agent_ip="127.0.0.2", heartbeat_s=0.5),
                        env={"LLM_SERVING_REMOTE_IDLE_S": "2"})
    try:
        first = original_generate(srv.url, "idle test", new=8)["generated_text"]
        pids = srv.agent_pids()
        time.sleep(5)
        assert original_generate(srv.url, "idle test", new=8)["generated_text"] == first
        assert srv.agent_pids() == pids and metric(srv.url, "llm_serving_agent_restarts_total") == 0
    finally:
        srv.stop()


def test_cancels_during_an_agent_restart_leak_nothing(tmp_path, tiny_model_dir):
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir))
    rng = random.Random(0)
    ended: list[str] = []

    def one(i: int) -> None:
        body = {"inputs": f"request {i}", "parameters": {"max_new_tokens": 40, "ignore_eos": True}}
        cancel_after = rng.choice([None, 0, 2, 10])
        with httpx.stream("POST", f"{srv.url}/generate_stream", json=body, timeout=120) as r:
            for n, line in enumerate(r.iter_lines()):
                if cancel_after is not None and n >= cancel_after:
                    ended.append("cancelled")
                    return
                if '"generated_text":"' in line.replace(" ", "") or '"error"' in line:
                    ended.append("finished")
                    return
        ended.append("finished")

    try:
        [pid] = srv.agent_pids()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
        for i, t in enumerate(threads):
            t.start()
            if i == 20:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        for t in threads:
            t.join(150)
        assert len(ended) == 50 and not any(t.is_alive() for t in threads)
        info = server_idle(srv.url, timeout_s=60)  # no running or waiting request, no KV block in use
        assert info["agents_alive"] == 1
        agents = srv.agent_pids()
    finally:
        srv.stop()
    assert not any(os.path.exists(f"/proc/{p}") for p in agents)
    assert not [s for s in our_segments() if f"-{srv.proc.pid}-" in s]


def test_an_agent_over_its_memory_plan_degrades_health_and_keeps_serving(tmp_path, tiny_model_dir):
    """The plan counts 1 MiB of runtime (`runtime_memory`), so the agent is resident over it by far
    more than `memory_margin`: /health says degraded (200) naming the agent, its RSS and its plan,
    /metrics has both, the log warns once, and requests are still served."""
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, runtime_memory="1MiB", memory_margin=0.0))
    try:
        assert original_generate(srv.url, PROMPTS[0], new=4)["generated_text"]
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "agent 0 holds" in health.json()["reason"] and "memory_margin" in health.json()["reason"]
        rss, planned = (metric(srv.url, f"llm_serving_agent_{k}_bytes") for k in ("resident", "planned"))
        assert rss > planned > 0
        assert original_generate(srv.url, PROMPTS[1], new=4)["generated_text"]
        assert srv.log.read_text().count("/health says degraded") == 1
    finally:
        srv.stop()
