"""Tensor-parallel groups through the real server: consecutive agent_ports are one model's ranks
(serving_config.tensor_parallel_size), greedy text identical to one rank's and to the float64
reference, a killed rank brings its whole group back, and several groups serve as replicas."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import yaml

from shm.arena import our_segments
from tests.conftest import tiny_model_config
from tests.e2e.clients import GENERATED, concurrent, metric, original_generate, wait_generating
from tests.helpers import ServerProcess, tiny_config
from tests.reference import reference_logits

PROMPTS = ["tensor parallel", "The quick brown fox", "a", "MindSpore serving test prompt"]
NEW = 24


def _ids(url: str, prompt: str) -> list[int]:
    """The prompt's token ids and the greedy output's, as the server's TGI route reports them."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW, "ignore_eos": True, "details": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    prompt_ids = httpx.post(f"{url}/tokenize", json={"inputs": prompt}, timeout=30).json()
    return [t["id"] for t in prompt_ids] + [t["id"] for t in r["details"]["tokens"]]


def reference_greedy(tiny_weights, ids: list[int]) -> list[int]:
    """The float64 reference's greedy tokens for the last NEW of `ids` (one rank gives the same:
    tests/agent/test_model_runner.py; so it is the one-rank text without a one-rank server)."""
    n = len(ids) - NEW
    return [int(t) for t in reference_logits(tiny_model_config(), tiny_weights, ids[:-1])[n - 1:].argmax(-1)]


def test_two_ranks_serve_the_reference_s_text_and_a_sigkill_of_rank_1_restarts_the_group(tmp_path, tiny_model_dir,
                                                                                       tiny_weights):
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, n_agents=2, tensor_parallel_size=2))
    try:
        stats = httpx.get(f"{srv.url}/stats", timeout=10).json()
        assert stats["agents_alive"] == 1 and len(stats["memory"]) == 1  # one replica of two ranks
        for p in PROMPTS:  # overlap on (the default): fed decodes sampled alike on every rank
            ids = _ids(srv.url, p)
            assert ids[-NEW:] == reference_greedy(tiny_weights, ids)
        single = {p: original_generate(srv.url, p, new=60)["generated_text"] for p in PROMPTS}
        pids = srv.agent_pids()
        assert len(pids) == 2
        before = metric(srv.url, GENERATED)
        out, threads = concurrent(srv.url, PROMPTS, 60)
        wait_generating(srv.url, before)  # mid-stream
        rank1 = sorted(pids)[1]  # spawned second
        # Stopped first, so rank 0 waits in a collective with both steps in flight (its reply never
        # comes), then killed: the group's poll must see rank 1 die, not wait out the step timeout.
        os.kill(rank1, signal.SIGSTOP)
        time.sleep(1.0)
        os.kill(rank1, signal.SIGKILL)
        reasons, deadline = [], time.monotonic() + 300
        while time.monotonic() < deadline:
            health = httpx.get(f"{srv.url}/health", timeout=30).json()
            if health["status"] == "recovering":
                reasons.append(health["reason"])
            if health["status"] == "ok" and reasons:
                break
            time.sleep(0.1)
        # seen from the death, not after step_timeout_s ("no reply for 120s (stuck)")
        assert reasons and all("agent died" in r for r in reasons), reasons
        for t in threads:
            t.join(180)
        assert out == single  # recomputed on the restarted group
        assert not set(srv.agent_pids()) & set(pids)  # both ranks are new
        assert metric(srv.url, "llm_serving_agent_restarts_total") == 1
    finally:
        srv.stop()
    assert not [s for s in our_segments() if f"-{srv.proc.pid}-" in s]  # arenas and collective segments


def test_four_agents_at_size_two_are_two_replicas(tmp_path, tiny_model_dir):
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, n_agents=4, tensor_parallel_size=2))
    try:
        # Prompts that share no first block: prefix routing (the default) has nothing to follow, and
        # sends each to the least loaded replica whenever it arrives.
        words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
        out, threads = concurrent(srv.url, [f"{w} replica load" for w in words], 30)
        for t in threads:
            t.join(180)
        assert len(out) == 8
        events = httpx.get(f"{srv.url}/debug/trace", timeout=10).json()["traceEvents"]
        lanes = {e["tid"] for e in events if e["pid"] == 1 and e["name"].startswith(("prefill", "decode"))}
        assert lanes == {0, 1}  # both replicas ran steps
        assert httpx.get(f"{srv.url}/stats", timeout=10).json()["agents_alive"] == 2
    finally:
        srv.stop()


def test_a_launched_group_serves_attached_servers_and_the_agent_client(tmp_path, tiny_model_dir):
    """launch_agents starts the group once; the socket-level client drives it as one model, a
    server attaches to it with the same tokens, and a server expecting single agents is refused."""
    from tests.helpers import Launcher, run_python

    runtime = tmp_path / "run"
    runtime.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLM_SERVING_RUNTIME_DIR": str(runtime)}
    config = tiny_config(tmp_path, tiny_model_dir, n_agents=2, tensor_parallel_size=2)
    launcher = Launcher(config, env)
    try:
        got = run_python("tools/agent_client.py", "--config", str(config), "--prompt", PROMPTS[1], "--max-tokens", "8",
                   "--ignore-eos", "--json", env=env)
        assert got.returncode == 0, got.stderr
        srv = ServerProcess(config, "--attach", env=env)
        try:
            body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 8, "ignore_eos": True, "details": True}}
            r = httpx.post(f"{srv.url}/generate", json=body, timeout=120).json()
            assert [t["id"] for t in r["details"]["tokens"]] == json.loads(got.stdout)["token_ids"]
        finally:
            srv.stop()
        single = tmp_path / "single.yaml"
        doc = yaml.safe_load(config.read_text())
        doc["serving_config"]["tensor_parallel_size"] = 1
        single.write_text(yaml.safe_dump(doc))
        refused = run_python("-m", "llm_serving.serve", "--config", str(single), "--attach", env=env, timeout=120)
        assert refused.returncode == 1 and "tensor-parallel rank 0 of 2, not rank 0 of 1" in refused.stdout + refused.stderr
    finally:
        launcher.proc.send_signal(signal.SIGTERM)
        launcher.proc.wait(30)
    assert not [s for s in our_segments() if f"-{launcher.proc.pid}-" in s]
