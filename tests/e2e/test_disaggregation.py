"""Prefill/decode disaggregation through real processes (serving_config.agent_roles): a prefill agent
runs the prompts, hands each one's KV over shared memory to a decode agent, and every text equals
what one agent serving both gives, with a slow hand-over, and with either agent killed mid-run. A
drain moves running sequences between tcp agents (their KV as frames)."""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from shm.endpoint import holder
from tests.e2e.clients import metric, wait_generating
from tests.helpers import ServerProcess, tiny_config

SIZES = dict(decode_seq_length=256, max_generate_length=256, num_blocks=200)
NEW = 24
# Prompts of 1 to 6 steps' tokens (the step budget is 32): some end in one step, others in chunks.
PROMPTS = [f"request {i}: " + "abcdefghij" * (i * 3) for i in range(6)]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
EXTRAS = {"penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.5},  # the decode agent needs the prompt
          "grammar": {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                      "ignore_eos": False},
          "logprobs": {"logprobs": 2},
          "n": {"n": 3, "temperature": 0.8, "seed": 7}}  # three samples of one prompt, each its own hand-over


@dataclass
class Answer:
    """A completion's text and its top logprobs, equal to another's within float rounding (steps of
    other shapes round a logit's last bits otherwise)."""
    text: str
    top: list[dict[str, float]]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Answer) and self.text == other.text and [a.keys() for a in self.top] == [
                b.keys() for b in other.top] and all(abs(a[t] - b[t]) < 1e-3 for a, b in zip(self.top, other.top) for t in a))


def _complete(url: str, prompt: str, **extra) -> Answer:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if r.status_code != 200:
        return Answer(f"HTTP {r.status_code}: {r.text}", [])
    choices = r.json()["choices"]
    return Answer(" | ".join(c["text"] for c in choices),
                  choices[0]["logprobs"]["top_logprobs"] if choices[0].get("logprobs") else [])


def _all_at_once(url: str) -> dict[str, Answer]:
    """Every prompt plain, and the first with each extra, all in flight together."""
    jobs = {p: (p, {}) for p in PROMPTS} | {k: (PROMPTS[3], v) for k, v in EXTRAS.items()}
    out: dict[str, Answer] = {}
    threads = [threading.Thread(target=lambda k=k, p=p, e=e: out.__setitem__(k, _complete(url, p, **e)))
               for k, (p, e) in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(out) == len(jobs) and not any(v.text.startswith("HTTP") for v in out.values()), out
    return out


@pytest.fixture(scope="module")
def dp(tmp_path_factory, tiny_model_dir):
    """Two agents doing both (data parallel), on tcp: what a drain moves goes as frames."""
    srv = ServerProcess(tiny_config(tmp_path_factory.mktemp("dp"), tiny_model_dir, 2, agent_ip="127.0.0.2", **SIZES))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def undisturbed(dp) -> dict[str, Answer]:
    return _all_at_once(dp.url)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_model_dir):
    """A prefill agent and a decode agent; every export made slow (a hand-over that takes a while),
    and pools a quarter of what the requests want at once (preemption on both agents: a decode
    agent hands what it preempts back to be computed again)."""
    cfg = tiny_config(tmp_path_factory.mktemp("pd"), tiny_model_dir, 2, agent_roles=["prefill", "decode"],
                      **{**SIZES, "num_blocks": 70})
    srv = ServerProcess(cfg, env={"LLM_SERVING_HANDOVER_DELAY_S": "0.02"})
    yield srv
    srv.stop()


def test_disaggregated_texts_equal_agents_serving_both(pd, undisturbed):
    before = metric(pd.url, "llm_serving_kv_handovers_total")
    assert _all_at_once(pd.url) == undisturbed
    # each request once, and again after each preemption on the decode agent
    assert metric(pd.url, "llm_serving_kv_handovers_total") - before >= len(undisturbed)
    assert metric(pd.url, "llm_serving_kv_handover_bytes_total") > 0
    stats = pd.stats_until(lambda s: s["running"] == 0 and s["waiting"] == 0)
    assert stats["kv_usage"][1] == 0.0  # the decode agent's blocks all freed (the prefill agent's stay cached)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_killed_agent_of_either_role_loses_no_request(pd, undisturbed, role):
    port = pd.config["serving_config"]["agent_ports"][["prefill", "decode"].index(role)]
    pid = holder(port)
    restarts = metric(pd.url, "llm_serving_agent_restarts_total")
    before = metric(pd.url, "llm_serving_generation_tokens_total")
    out: dict[str, Answer] = {}
    runner = threading.Thread(target=lambda: out.update(_all_at_once(pd.url)))
    runner.start()
    wait_generating(pd.url, before)  # decodes under way, later prompts still coming
    os.kill(pid, signal.SIGKILL)
    runner.join(300)
    assert out == undisturbed  # recomputed from the tokens so far: the same greedy text
    deadline = time.monotonic() + 120
    while holder(port) in (None, pid) or httpx.get(f"{pd.url}/health", timeout=5).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the killed agent did not come back"
        time.sleep(0.1)
    assert metric(pd.url, "llm_serving_agent_restarts_total") == restarts + 1


def test_an_agent_no_other_could_replace_is_not_drained(pd):
    for role in ("prefill", "decode"):
        port = pd.config["serving_config"]["agent_ports"][["prefill", "decode"].index(role)]
        r = httpx.post(f"{pd.url}/admin/agents/{port}/drain", timeout=60)
        assert r.status_code == 409 and "no other live agent" in r.text, r.text
    assert httpx.post(f"{pd.url}/admin/agents/1/drain", timeout=60).status_code == 404


def test_a_drain_moves_running_streams_with_their_kv(dp, undisturbed):
    """Agent 0 of two drained while its streams run (the agents paused from before the requests to
    after the drain began, so it holds some whatever the machine's speed): every text as
    undisturbed, no KV computed again."""
    srv, port = dp, dp.config["serving_config"]["agent_ports"][0]
    try:
        out: dict[str, Answer] = {}
        runner = threading.Thread(target=lambda: out.update(_all_at_once(srv.url)))
        answers: list[dict] = []
        drainers = [threading.Thread(target=lambda: answers.append(
            httpx.post(f"{srv.url}/admin/agents/{port}/drain", timeout=300).json())) for _ in range(2)]
        # A request on agent 0 (its prefix is cached there) just before the pause: its idle heartbeat
        # is then heartbeat_s away, so none is in flight to a stopped agent, holding every step back.
        _complete(srv.url, PROMPTS[3])
        with srv.agents_paused():
            runner.start()
            srv.stats_until(lambda s: s["running"] > 0)
            for drainer in drainers:  # two at once: both answer, with one result
                drainer.start()
            srv.stats_until(lambda s: s["drains_waiting"] == 2)
            health = httpx.get(f"{srv.url}/health", timeout=10).json()
            assert health["draining"] == [port] and f"draining: port {port}" in health["reason"], health
        for drainer in drainers:
            drainer.join(300)
        runner.join(300)
        assert len(answers) == 2 and answers[0] == answers[1], answers
        assert answers[0]["moved"] > 0 and answers[0]["draining"] and "note" not in answers[0], answers
        assert out == undisturbed
        assert metric(srv.url, "llm_serving_kv_tokens_discarded_total") == 0
        assert httpx.get(f"{srv.url}/stats", timeout=10).json()["kv_usage"][0] == 0.0  # it holds nothing
        assert _all_at_once(srv.url) == undisturbed  # served by agent 1 alone now
        _a_resume_ends_a_drain_under_way(srv, port)
    finally:
        assert httpx.post(f"{srv.url}/admin/agents/{port}/resume", timeout=60).json() == {"port": port, "draining": False}



def test_a_drained_agent_takes_work_again_once_restarted(dp, undisturbed):
    """README: a drained agent takes work again when it restarts (a drain's purpose); /health says so."""
    port = dp.config["serving_config"]["agent_ports"][0]
    assert httpx.post(f"{dp.url}/admin/agents/{port}/drain", timeout=300).json()["draining"]
    assert httpx.get(f"{dp.url}/health", timeout=10).json()["draining"] == [port]
    pid = holder(port)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while holder(port) in (None, pid) or httpx.get(f"{dp.url}/health", timeout=5).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the killed agent did not come back"
        time.sleep(0.1)
    assert httpx.get(f"{dp.url}/health", timeout=10).json()["draining"] == []
    assert not dp.stats_until(lambda s: True)["draining"][0]
    assert _all_at_once(dp.url) == undisturbed

def _a_resume_ends_a_drain_under_way(srv: ServerProcess, port: int) -> None:
    """A resume while a drain still moves sequences: the drain answers that it was resumed (not that
    the agent went down), and the agent schedules again."""
    assert httpx.post(f"{srv.url}/admin/agents/{port}/resume", timeout=60).status_code == 200
    out: dict[str, Answer] = {}
    runner = threading.Thread(target=lambda: out.update(_all_at_once(srv.url)))
    answer: dict = {}
    drainer = threading.Thread(target=lambda: answer.update(
        httpx.post(f"{srv.url}/admin/agents/{port}/drain", timeout=300).json()))
    with srv.agents_paused():
        runner.start()
        srv.stats_until(lambda s: s["running"] > 0)
        drainer.start()
        srv.stats_until(lambda s: s["draining"][0])
        assert httpx.post(f"{srv.url}/admin/agents/{port}/resume", timeout=60).json() == {"port": port, "draining": False}
        drainer.join(300)
    runner.join(300)
    assert len(out) == len(PROMPTS) + len(EXTRAS)
    assert not answer["draining"] and answer["state"] == "live" and "resumed" in answer["note"], answer
    assert httpx.get(f"{srv.url}/health", timeout=10).json()["draining"] == []
