"""LoRA adapters served over HTTP by real processes (serving_config.lora_modules): three random adapters
of the tiny model (two PEFT folders, one llama.cpp GGUF) beside the base, in two slots (swapped in as requests want them), picked by OpenAI
`model`, TGI `adapter_id` and the original API's `adapter`. Requests for the base and the adapters interleaved in the same steps each give the text the
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
from tools.lora_adapter import random_adapter, write_gguf_adapter

# longer than a KV block (4 tokens here): the base caches its blocks before an adapter asks for them
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("lora")
    adapters = {"ft-a": str(random_adapter(tmp / "a", TINY, rank=8, seed=1)),
                "ft-b": str(random_adapter(tmp / "b", TINY, rank=16, modules=("q_proj", "v_proj", "down_proj"), seed=2)),
                "ft-c": str(write_gguf_adapter(random_adapter(tmp / "c", TINY, rank=4, seed=3), str(tiny_model_dir),
                                               tmp / "c.gguf"))}  # as llama.cpp converts one
    # three adapters, two slots: the agents start with ft-a and ft-b, ft-c is swapped in when asked for
    srv = ServerProcess(tiny_config(tmp, tiny_model_dir, lora_modules=adapters, max_loras=2))
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
    names = ["tiny", "ft-a", "ft-b", "ft-c"]
    base = _openai(server.url, "tiny")  # caches the prompt's blocks for the base model
    full = {n: _openai(server.url, n, computed_in_full=True) for n in names[1:]}
    alone = {"tiny": base, **{n: _openai(server.url, n) for n in names[1:]}}
    assert alone == {"tiny": base, **full}  # an adapter's request never ran on the base's cached KV
    assert len(set(alone.values())) == 4  # each adapter changes the model

    order = names * 3  # all admitted before a step ends: they share steps (ft-c's wait for a slot), however slow the machine
    assert _burst(server, order) == [alone[n] for n in order]


def test_tgi_and_original_name_adapters_and_models_lists_them(server):
    want = _openai(server.url, "ft-b")
    r = httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": {
        "adapter_id": "ft-b", "max_new_tokens": 12, "do_sample": False}}, timeout=120)
    assert r.status_code == 200 and r.json()["generated_text"] == want
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("ft-a", "tiny"), ("ft-b", "tiny"),
                                                            ("ft-c", "tiny")]
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


def _burst(server, names: list[str]) -> list[str]:
    """Greedy texts of requests for `names`, all admitted before a step ends."""
    out: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i, n=n: out.__setitem__(i, _openai(server.url, n)))
               for i, n in enumerate(names)]
    with server.agents_paused():
        for t in threads:
            t.start()
        server.stats_until(lambda s: s["running"] + s["waiting"] == len(names))
    for t in threads:
        t.join(180)
    return [out[i] for i in range(len(names))]


def test_adapters_loaded_and_unloaded_at_run_time_and_after_an_agent_restart(server):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter with more adapters than the agents'
    max_loras 2 slots: a folder loaded at run time takes the least recently used slot and serves
    what the same folder loaded at start serves, and again after its agent is SIGKILLed and restarted
    (the server loads it again); requests for three adapters at once each give their text alone (the
    adapters swapped in as slots free); a load while every slot's adapter runs, a name served, a
    folder that is not an adapter are 400s naming why; an unloaded name is a 404 while a request
    already running on it finishes on its weights."""
    url, folder_b = server.url, server.config["serving_config"]["lora_modules"]["ft-b"]
    want_b, want_a = _openai(url, "ft-b"), _openai(url, "ft-a")
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "ft-b2", "lora_path": folder_b})
    assert r.status_code == 200 and "ft-b2" in r.text  # into the slot used least recently
    assert _openai(url, "ft-b2") == want_b
    assert "ft-b2" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    [pid] = server.agent_pids()
    os.kill(pid, signal.SIGKILL)
    server.stats_until(lambda s: s["agents_alive"] == 1 and server.agent_pids() not in ([], [pid]), timeout_s=180)
    assert _openai(url, "ft-b2") == want_b  # loaded again into the restarted agent's slot
    assert _openai(url, "ft-b") == want_b  # swapped in again
    assert _burst(server, ["ft-a", "ft-b", "ft-b2"] * 2) == [want_a, want_b, want_b] * 2

    _openai(url, "ft-a"), _openai(url, "ft-b2")  # the two in the slots
    out: dict[str, str] = {}
    running = [threading.Thread(target=lambda n=n: out.setdefault(n, _openai(url, n))) for n in ("ft-a", "ft-b2")]
    with server.agents_paused():
        for t in running:
            t.start()
        server.stats_until(lambda s: s["running"] + s["waiting"] == 2)
        for body, says in (({"lora_name": "ft-d", "lora_path": folder_b}, "running requests use"),
                           ({"lora_name": "ft-a", "lora_path": folder_b}, "already served")):
            r = _post(url, "/v1/load_lora_adapter", body)
            assert r.status_code == 400 and says in r.text, r.text
        assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "ft-a"}).status_code == 200
    for t in running:
        t.join(120)
    assert out == {"ft-a": want_a, "ft-b2": want_b}  # admitted before the unload: it ran on ft-a to its end
    assert httpx.post(f"{url}/v1/completions", json={"model": "ft-a", "prompt": "hi"}, timeout=30).status_code == 404
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "ft-a"}).status_code == 404
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "ft-x", "lora_path": str(server.config_path)})
    assert r.status_code == 400 and "adapter_config.json" in r.text  # not a PEFT folder
    for name in ("../../etc/passwd", "c1,c2", "x" * 5000):  # names become model names and metric labels
        r = _post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(server.config_path)})
        assert r.status_code == 400 and "a LoRA adapter's name is" in r.text, r.text
    folder_a = server.config["serving_config"]["lora_modules"]["ft-a"]
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "ft-a", "lora_path": folder_a}).status_code == 200
    assert _openai(url, "ft-a") == want_a  # into the slot of the unloaded ft-a, free first


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
