"""Tensor-parallel groups through the real server: consecutive agent_ports are one model's ranks
(serving_config.tensor_parallel_size), greedy text identical to one rank's and to the float64
reference, a killed rank brings its whole group back, and several groups serve as replicas."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from shm.arena import our_segments
from tests.conftest import tiny_model_config
from tests.e2e.test_server_e2e import original_generate
from tests.e2e.test_supervision import _concurrent, _metric
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


@pytest.fixture(scope="module")
def one_rank_ids(tmp_path_factory, tiny_model_dir) -> dict[str, list[int]]:
    srv = ServerProcess(tiny_config(tmp_path_factory.mktemp("tp1"), tiny_model_dir))
    try:
        return {p: _ids(srv.url, p) for p in PROMPTS}
    finally:
        srv.stop()


def test_two_ranks_serve_one_rank_s_greedy_text(tmp_path, tiny_model_dir, tiny_weights, one_rank_ids):
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, n_agents=2, tensor_parallel_size=2))
    try:
        stats = httpx.get(f"{srv.url}/stats", timeout=10).json()
        assert stats["agents_alive"] == 1 and len(stats["memory"]) == 1  # one replica of two ranks
        got = {p: _ids(srv.url, p) for p in PROMPTS}
        assert got == one_rank_ids  # overlap on (the default): fed decodes sampled alike on every rank
        cfg = tiny_model_config()
        for p, ids in got.items():  # and the float64 reference's greedy tokens
            n = len(ids) - NEW
            want = reference_logits(cfg, tiny_weights, ids[:-1])[n - 1:].argmax(-1)
            assert ids[n:] == [int(t) for t in want]
    finally:
        srv.stop()
    assert not [s for s in our_segments() if f"-{srv.proc.pid}-" in s]


def test_sigkill_of_rank_1_mid_stream_restarts_the_group(tmp_path, tiny_model_dir):
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, n_agents=2, tensor_parallel_size=2))
    try:
        single = {p: original_generate(srv.url, p, new=60)["generated_text"] for p in PROMPTS}
        pids = srv.agent_pids()
        assert len(pids) == 2
        out, threads = _concurrent(srv.url, PROMPTS, 60)
        time.sleep(0.5)  # mid-stream
        os.kill(sorted(pids)[1], signal.SIGKILL)  # rank 1 (spawned second)
        seen, deadline = [], time.monotonic() + 180
        while time.monotonic() < deadline:
            seen.append(httpx.get(f"{srv.url}/health", timeout=5).json()["status"])
            if seen[-1] == "ok" and "recovering" in seen:
                break
            time.sleep(0.1)
        for t in threads:
            t.join(180)
        assert out == single  # recomputed on the restarted group
        assert not set(srv.agent_pids()) & set(pids)  # both ranks are new
        assert _metric(srv.url, "llm_serving_agent_restarts_total") == 1
    finally:
        srv.stop()
    assert not [s for s in our_segments() if f"-{srv.proc.pid}-" in s]  # arenas and collective segments


def test_four_agents_at_size_two_are_two_replicas(tmp_path, tiny_model_dir):
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, n_agents=4, tensor_parallel_size=2))
    try:
        out, threads = _concurrent(srv.url, [f"replica load {i}" for i in range(8)], 30)
        for t in threads:
            t.join(180)
        assert len(out) == 8
        events = httpx.get(f"{srv.url}/debug/trace", timeout=10).json()["traceEvents"]
        lanes = {e["tid"] for e in events if e["pid"] == 1 and e["name"].startswith(("prefill", "decode"))}
        assert lanes == {0, 1}  # both replicas ran steps
        assert httpx.get(f"{srv.url}/stats", timeout=10).json()["agents_alive"] == 2
    finally:
        srv.stop()
