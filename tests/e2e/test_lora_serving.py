"""LoRA adapters served over HTTP by real processes (serving_config.lora_modules): two random adapters of
the tiny model beside the base, picked by OpenAI `model`, TGI `adapter_id` and the original API's
`adapter`. Requests for the base and the adapters interleaved in the same steps each give the text the
same request gives alone; a prompt whose blocks the base cached is computed afresh for an adapter (no KV
shared across adapters); the names are listed with their parent; a name not served is a 404 naming it."""
from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.conftest import TINY
from tests.helpers import ServerProcess, tiny_config
from tools.lora_adapter import random_adapter

# longer than a KV block (4 tokens here): the base caches its blocks before an adapter asks for them
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("lora")
    adapters = {"ft-a": str(random_adapter(tmp / "a", TINY, rank=8, seed=1)),
                "ft-b": str(random_adapter(tmp / "b", TINY, rank=16, modules=("q_proj", "v_proj", "down_proj"), seed=2))}
    srv = ServerProcess(tiny_config(tmp, tiny_model_dir, lora_modules=adapters, max_loras=3))
    yield srv
    srv.stop()


def _openai(url: str, model: str, prompt: str = PROMPT, computed_in_full: bool = False) -> str:
    """A greedy completion's text; `computed_in_full`: with the prompt's logprobs (echo), which no
    cached block can give, so the whole prompt is computed under this model."""
    scored = {"echo": True, "logprobs": 1} if computed_in_full else {}
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0, **scored}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"].removeprefix(prompt if computed_in_full else "")


def test_each_adapter_gives_its_own_text_alone_and_interleaved(server):
    names = ["tiny", "ft-a", "ft-b"]
    base = _openai(server.url, "tiny")  # caches the prompt's blocks for the base model
    full = {n: _openai(server.url, n, computed_in_full=True) for n in ("ft-a", "ft-b")}
    alone = {"tiny": base, **{n: _openai(server.url, n) for n in ("ft-a", "ft-b")}}
    assert alone == {"tiny": base, **full}  # an adapter's request never ran on the base's cached KV
    assert len(set(alone.values())) == 3  # each adapter changes the model

    order, out = names * 3, {}
    threads = [threading.Thread(target=lambda i=i, n=n: out.__setitem__(i, _openai(server.url, n)))
               for i, n in enumerate(order)]
    with server.agents_paused():  # all nine admitted before a step ends: they share steps, however slow the machine
        for t in threads:
            t.start()
        server.stats_until(lambda s: s["running"] + s["waiting"] == len(order))
    for t in threads:
        t.join(180)
    assert [out[i] for i in range(len(order))] == [alone[n] for n in order]


def test_tgi_and_original_name_adapters_and_models_lists_them(server):
    want = _openai(server.url, "ft-b")
    r = httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": {
        "adapter_id": "ft-b", "max_new_tokens": 12, "do_sample": False}}, timeout=120)
    assert r.status_code == 200 and r.json()["generated_text"] == want
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("ft-a", "tiny"), ("ft-b", "tiny")]
    r = httpx.post(f"{server.url}/models/tiny/generate", json={"inputs": PROMPT, "parameters": {
        "adapter": "ft-b", "max_new_tokens": 12, "do_sample": False}}, timeout=120)
    assert r.status_code == 200 and r.json()["generated_text"] == want  # the original API's `adapter`
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "ft-x", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and "ft-x" in r.text
    r = httpx.post(f"{server.url}/generate", json={"inputs": "hi", "parameters": {"adapter_id": "nope"}}, timeout=30)
    assert r.status_code == 404 and "nope" in json.dumps(r.json())
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'llm_serving_lora_requests_finished_total{adapter="ft-b",reason="length"}' in metrics
    assert 'llm_serving_lora_generation_tokens_total{adapter="ft-b"}' in metrics


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_adapters_loaded_and_unloaded_at_run_time_and_after_an_agent_restart(server):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a folder loaded into the free slot
    serves what the same folder loaded at start serves, and again after its agent is SIGKILLed and
    restarted (the server loads it again); an unloaded name is a 404 while a request already running
    on it finishes on its weights; a full table, a name served, a folder that is not an adapter are
    400s naming why."""
    url, folder_b = server.url, server.config["serving_config"]["lora_modules"]["ft-b"]
    want_b, want_a = _openai(url, "ft-b"), _openai(url, "ft-a")
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "ft-b2", "lora_path": folder_b})
    assert r.status_code == 200 and "ft-b2" in r.text
    assert _openai(url, "ft-b2") == want_b
    assert "ft-b2" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    for body, says in (({"lora_name": "ft-c", "lora_path": folder_b}, "max_loras"),
                       ({"lora_name": "ft-a", "lora_path": folder_b}, "already served")):
        r = _post(url, "/v1/load_lora_adapter", body)
        assert r.status_code == 400 and says in r.text, r.text
    [pid] = server.agent_pids()
    os.kill(pid, signal.SIGKILL)
    server.stats_until(lambda s: s["agents_alive"] == 1 and server.agent_pids() not in ([], [pid]), timeout_s=180)
    assert _openai(url, "ft-b2") == want_b  # loaded again into the restarted agent's slot

    out: dict[str, str] = {}
    running = threading.Thread(target=lambda: out.setdefault("a", _openai(url, "ft-a")))
    with server.agents_paused():
        running.start()
        server.stats_until(lambda s: s["running"] + s["waiting"] == 1)
        assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "ft-a"}).status_code == 200
    running.join(120)
    assert out["a"] == want_a  # admitted before the unload: it ran on ft-a to its end
    assert httpx.post(f"{url}/v1/completions", json={"model": "ft-a", "prompt": "hi"}, timeout=30).status_code == 404
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "ft-a"}).status_code == 404
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "ft-x", "lora_path": str(server.config_path)})
    assert r.status_code == 400 and "adapter_config.json" in r.text  # not a PEFT folder
    folder_a = server.config["serving_config"]["lora_modules"]["ft-a"]
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "ft-a", "lora_path": folder_a}).status_code == 200
    assert _openai(url, "ft-a") == want_a  # its freed slot taken again


def test_the_offline_api_picks_adapters_by_name(server, tmp_path, tiny_model_dir):
    """`LLM.generate(..., lora=name)` runs the adapter the server serves under that name (the same
    folders, greedy: the same text); an unknown name is a ValueError naming the ones there are."""
    from llm_serving import LLM, SamplingParams

    adapters = server.config["serving_config"]["lora_modules"]
    with LLM(str(tiny_config(tmp_path, tiny_model_dir, lora_modules=adapters, max_loras=3))) as llm:
        params = SamplingParams(max_new_tokens=12)
        got = {n: llm.generate(PROMPT, params, progress=False, lora=n)[0].text for n in adapters}
        with pytest.raises(ValueError, match="ft-a"):
            llm.generate(PROMPT, params, progress=False, lora="nope")
    assert got == {n: _openai(server.url, n) for n in adapters}
