"""End to end through real processes: llm-serving (HTTP + engine) and spawned MindSpore agents."""
from __future__ import annotations

import json
import re
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import tiny_model_config
from tests.reference import reference_logits
from tests.e2e.clients import original_generate, server_idle, stream_tgi
from tests.helpers import ServerProcess, tiny_config

PROMPTS = ["hello world", "The quick brown fox", "a", "MindSpore serving test prompt"]
NEW = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("e2e")
    srv = ServerProcess(tiny_config(tmp, tiny_model_dir, request_log=str(tmp / "requests.jsonl")))
    yield srv
    srv.stop()


def stream_original(url: str, prompt: str) -> str:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW, "do_sample": "False", "ignore_eos": "True"},
            "stream": "True"}
    with httpx.stream("POST", f"{url}/models/tiny", json=body, timeout=120) as r:
        items = [json.loads(line)["data"][0] for line in r.iter_lines() if line]
    # return_full_text is on unless the client says otherwise (the original's default): a last line
    # with the whole generated text follows the token lines
    text = "".join(item["generated_text"] for item in items[:-1])
    assert items[-1]["finish_reason"] == "length" and items[-1]["generated_text"] == text
    return text


def stream_openai(url: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in out if c.choices)


def test_concurrent_streams_on_three_apis_equal_single_requests(server):
    single = {p: original_generate(server.url, p)["generated_text"] for p in PROMPTS}
    results: dict[tuple[str, str], str] = {}
    errors: list[BaseException] = []

    def run(kind: str, fn, prompt: str) -> None:
        try:
            results[(kind, prompt)] = fn(server.url, prompt)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k, fn, p)) for p in PROMPTS
               for k, fn in (("orig", stream_original), ("tgi", stream_tgi), ("openai", stream_openai))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    for (kind, prompt), text in results.items():
        assert text == single[prompt], (kind, prompt)
    assert len(results) == 3 * len(PROMPTS)


ORIGINAL_KEYS = ["generated_text", "finish_reason", "generated_tokens", "prefill", "seed", "tokens", "top_tokens",
                 "details"]


def test_original_non_stream_shape_and_last_token(server):
    r = original_generate(server.url, "hello", new=5, return_full_text="True")
    assert list(r) == ORIGINAL_KEYS  # the original's fields, in its order
    assert r["generated_tokens"] == 5 and r["finish_reason"] == "length"
    # return_full_text never prepends the prompt in the original API; the last token is included
    assert "".join(t["text"] for t in r["tokens"]) == r["generated_text"]
    assert r["prefill"] == r["tokens"][:1] and r["top_tokens"] == [r["tokens"][:1]] and r["details"] is None
    assert all(t["logprob"] <= 0 for t in r["tokens"])


def test_original_stream_as_the_contest_client_reads_it(server):
    body = {"inputs": "contest", "parameters": {"max_new_tokens": 6, "do_sample": "False", "ignore_eos": "True",
                                                "return_full_text": "True"}}
    with httpx.stream("POST", f"{server.url}/models/llama2/generate_stream", json=body, timeout=60) as r:
        texts = [json.loads(line)["data"][0]["generated_text"] for line in r.iter_lines() if line]
    assert len(texts) == 7 and texts[-1] == "".join(texts[:-1])  # the last line: the whole generated text
    plain = {**body, "parameters": {**body["parameters"], "return_protocol": "raw"}}
    with httpx.stream("POST", f"{server.url}/models/llama2/generate_stream", json=plain, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data:{") for line in lines)
    assert json.loads(lines[-1][5:])["generated_text"] == texts[-1]


def test_original_endings_name_the_originals_reasons(server):
    """A stop string ends with our "stop" (the original ignored stops); without return_full_text
    the stream is its token lines alone; the default (on) ends with the reason."""
    text = original_generate(server.url, "stop here", new=10)["generated_text"]
    stop = text[3:5]
    r = original_generate(server.url, "stop here", new=10, stop=[stop])
    assert r["finish_reason"] == "stop" and r["generated_text"] == text[:text.index(stop)]
    body = {"inputs": "stop here", "parameters": {"max_new_tokens": 10, "do_sample": "False", "ignore_eos": "True",
                                                  "stop": [stop]}}
    with httpx.stream("POST", f"{server.url}/models/tiny/generate_stream", json=body, timeout=60) as s:
        items = [json.loads(line)["data"][0] for line in s.iter_lines() if line]
    assert items[-1]["finish_reason"] == "stop" and items[-1]["generated_text"] == r["generated_text"]
    body["parameters"]["return_full_text"] = "False"
    with httpx.stream("POST", f"{server.url}/models/tiny/generate_stream", json=body, timeout=60) as s:
        items = [json.loads(line)["data"][0] for line in s.iter_lines() if line]
    assert "finish_reason" not in items[-1] and "".join(i["generated_text"] for i in items) == r["generated_text"]


def test_original_default_length_is_capped_by_max_generate_length(server):
    """No max_new_tokens: the original's 300, cut where prompt + output reach max_generate_length (128)."""
    body = {"inputs": "x" * 100, "parameters": {"ignore_eos": "True"}}
    r = httpx.post(f"{server.url}/models/tiny/generate", json=body, timeout=120).json()
    assert r["generated_tokens"] == 128 - 100 and r["finish_reason"] == "length"


def test_original_status_endpoints_are_server_sent_events(server):
    for path, key in (("/serving/get_bs", "data"), ("/serving/get_request_numbers", "data")):
        r = httpx.get(f"{server.url}{path}", timeout=10)
        assert r.headers["content-type"].startswith("text/event-stream") and r.text.endswith("\r\n\r\n")
        ev = json.loads(r.text.removeprefix("data: "))
        assert ev["event"] == "message" and ev["retry"] == 30000 and isinstance(ev[key], int)
    info = json.loads(httpx.get(f"{server.url}/serving/get_serverd_model_info", timeout=10).text.removeprefix("data: "))
    assert list(info) == ["docker_label", "max_batch_total_tokens", "max_concurrent_requests", "max_input_length",
                          "max_total_tokens", "model_device_type", "model_dtype", "model_id", "model_pipeline_tag",
                          "version"]
    assert info["model_id"] == "tiny" and info["max_input_length"] == 32 and info["model_device_type"] == "CPU"


def test_openai_chat_with_official_client(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 6 and full.choices[0].finish_reason == "length"
    lp = full.choices[0].logprobs.content
    assert len(lp) == 6 and all(len(t.top_logprobs) == 3 for t in lp)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in lp)  # greedy picks the top token
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_tgi_root_route_with_huggingface_inference_client(server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.url)
    plain = client.text_generation("hello", max_new_tokens=5, do_sample=False)
    detailed = client.text_generation("hello", max_new_tokens=5, details=True, do_sample=False)
    assert detailed.generated_text == plain and detailed.details.generated_tokens == 5
    assert detailed.details.finish_reason == "length" and len(detailed.details.tokens) == 5
    events = list(client.text_generation("hello", max_new_tokens=5, stream=True, details=True, do_sample=False))
    assert len(events) == 5 and all(e.token.id is not None for e in events)  # no trailing null token
    assert "".join(e.token.text for e in events) == plain and events[-1].generated_text == plain


def test_tgi_top_n_tokens_come_back_per_token(server):
    """TGI's `top_n_tokens`: each generated token's alternatives in `details.top_tokens` (/generate)
    and each stream event's `top_tokens`; the greedy token is the most likely one. The original API
    has nowhere to put them and says so."""
    params = {"max_new_tokens": 4, "top_n_tokens": 3, "details": True}
    r = httpx.post(f"{server.url}/generate", json={"inputs": "hello", "parameters": params}, timeout=60).json()
    tops = r["details"]["top_tokens"]
    assert len(tops) == 4 and all(len(t) == 3 for t in tops)
    for top, tok in zip(tops, r["details"]["tokens"]):
        assert top[0]["id"] == tok["id"] and abs(top[0]["logprob"] - tok["logprob"]) < 1e-6
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"] and {"text", "special"} <= top[0].keys()
    with httpx.stream("POST", f"{server.url}/generate_stream", json={"inputs": "hello", "parameters": params},
                      timeout=60) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert [e["top_tokens"] for e in events] == tops
    r = httpx.post(f"{server.url}/models/tiny/generate", json={"inputs": "hello", "parameters": params}, timeout=60)
    assert r.status_code == 400 and "top_n_tokens" in r.text


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    args = dict(model="tiny", messages=[{"role": "user", "content": "the sea and the sky " * 4}], max_tokens=2,
                temperature=0)
    first, again = (client.chat.completions.create(**args).usage for _ in range(2))
    assert first.prompt_tokens_details.cached_tokens < first.prompt_tokens
    assert 0 < again.prompt_tokens_details.cached_tokens < again.prompt_tokens
    streamed = [c.usage for c in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
                if c.usage]
    assert streamed[0].prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens


def test_chat_content_parts_and_roles(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    as_text = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi there"}],
                                             max_tokens=4, temperature=0)
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    as_parts = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                              max_tokens=4, temperature=0)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    for msgs in ([{"role": "wizard", "content": "hi"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": msgs}, timeout=30)
        assert r.status_code == 400, r.text


def test_seeded_sampling_is_reproducible_over_http(server):
    """The same seed gives the same text; other seeds give other texts (so `seed` is not ignored:
    with it ignored the first half would pass as well)."""
    def text(seed: int) -> str:
        body = {"model": "tiny", "prompt": "seed me", "max_tokens": 8, "temperature": 1.0, "seed": seed,
                "ignore_eos": True}
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    assert text(7) == text(7)
    assert {text(s) for s in (8, 9, 10)} != {text(7)}


@pytest.mark.parametrize("path, body, named", [
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens must be >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens must be >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 3},
     "temperature must be in [0, 2]"),
    ("/v1/completions", {"prompt": "x", "temperature": 100}, "temperature must be in [0, 2]"),
])
def test_a_refusal_names_the_field_the_client_sent(server, path, body, named):
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, body, raw", [
    ("/v1/completions", None, b"{not json"),
    ("/v1/completions", None, b'{"prompt": "\xff\xfe"}'),
    ("/v1/completions", {"prompt": ""}, None),
    ("/v1/completions", {"prompt": "x" * 400}, None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, None),
    ("/v1/completions", {"prompt": "x", "n": 17}, None),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, None),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, None),
    ("/v1/chat/completions", {"messages": []}, None),
    ("/generate", {"inputs": "x", "parameters": {"do_sample": "maybe"}}, None),
    ("/models/tiny/generate", {"inputs": 5}, None),
    ("/models/tiny/generate_stream", {"inputs": "x", "parameters": {"top_k": -3, "do_sample": True}}, None),
])
def test_bad_input_gets_4xx_json(server, path, body, raw):
    r = httpx.post(server.url + path, json=body, timeout=30) if raw is None else \
        httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert (err["message"] if isinstance(err, dict) else err)


def test_client_disconnect_cancels_and_frees_blocks(server):
    """The client leaves while its request runs: the agent is paused first, so the request is
    running (blocks held, its first step in flight) when the stream closes, however slow the machine."""
    body = json.dumps({"inputs": "cancel me", "parameters": {"max_new_tokens": 100, "ignore_eos": True}}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with server.agents_paused():
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:  # headers come with the first token
            sock.sendall(b"POST /generate_stream HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            info = server.stats_until(lambda s: s["running"] == 1)
            assert info["kv_usage"][0] > 0
    server_idle(server.url)
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'llm_serving_requests_finished_total{reason="cancelled"} 1.0' in metrics


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_prefix_cache_computes_only_the_new_tokens(server, tiny_weights):
    """A second prompt sharing a 40-token prefix (10 full blocks of 4) computes 3 tokens, not 43, and
    its greedy tokens are the float64 reference's."""
    prefix = list(range(60, 100))
    httpx.post(f"{server.url}/generate", json={"inputs": prefix, "parameters": {"max_new_tokens": 4}}, timeout=60)
    before = _counter(server.url, "llm_serving_prefill_tokens_computed_total")
    ids = prefix + [5, 6, 7]
    r = httpx.post(f"{server.url}/generate", json={"inputs": ids, "parameters": {
        "max_new_tokens": 4, "ignore_eos": True, "details": True}}, timeout=60).json()
    assert _counter(server.url, "llm_serving_prefill_tokens_computed_total") - before == 3
    want = list(ids)
    for _ in range(4):
        want.append(int(np.argmax(reference_logits(tiny_model_config(), tiny_weights, want)[-1])))
    assert [t["id"] for t in r["details"]["tokens"]] == want[len(ids):]


def test_penalties_see_the_prompt_a_prefix_cache_hit_skipped(server):
    """Repetition and frequency penalties read every prompt token: a second request whose prompt the
    cache holds (the agent computes 1 token of 43) samples as the first did."""
    ids = [7, 8, 9, 10] * 10 + [3, 2, 1]
    params = {"max_new_tokens": 16, "ignore_eos": True, "repetition_penalty": 2.0, "frequency_penalty": 1.0,
              "details": True}
    first, again = (httpx.post(f"{server.url}/generate", json={"inputs": ids, "parameters": params}, timeout=60).json()
                    for _ in range(2))
    before = _counter(server.url, "llm_serving_prefill_tokens_computed_total")
    third = httpx.post(f"{server.url}/generate", json={"inputs": ids, "parameters": params}, timeout=60).json()
    assert _counter(server.url, "llm_serving_prefill_tokens_computed_total") - before < len(ids)  # a hit
    ids_of = lambda r: [t["id"] for t in r["details"]["tokens"]]  # noqa: E731 (logprobs differ in float rounding)
    assert ids_of(first) == ids_of(again) == ids_of(third)


LIFECYCLE = ("llm_serving_request_waiting_seconds", "llm_serving_request_scheduling_to_inference_seconds",
             "llm_serving_request_inference_seconds", "llm_serving_time_to_first_token_seconds",
             "llm_serving_e2e_request_latency_seconds")


def _histograms(url: str) -> dict[str, tuple[float, float]]:
    return {name: (_counter(url, name + "_count"), _counter(url, name + "_sum")) for name in LIFECYCLE}


def test_lifecycle_metrics_and_request_log(server):
    before = _histograms(server.url)
    threads = [threading.Thread(target=original_generate, args=(server.url, f"life {i}", 8)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = _histograms(server.url)
    counts = {n: after[n][0] - before[n][0] for n in LIFECYCLE}
    waiting, to_inference, inference, ttft, latency = (after[n][1] - before[n][1] for n in LIFECYCLE)
    assert set(counts.values()) == {4}, counts
    assert latency >= waiting + to_inference + inference and inference >= 0 and to_inference >= 0
    assert latency >= ttft >= waiting
    log = Path(server.config["serving_config"]["request_log"]).read_text().splitlines()
    for rec in map(json.loads, log[-4:]):
        assert rec["output_tokens"] == 8 and rec["finish_reason"] == "length"
        assert rec["arrival"] <= rec["first_scheduled"] <= rec["inference_begin"] <= rec["first_token"]
        assert rec["first_token"] <= rec["inference_end"] <= rec["finished"]
        assert rec["latency_s"] >= rec["inference_s"] >= 0 and rec["latency_s"] >= rec["ttft_s"] >= 0


def test_http10_client_gets_a_framed_stream(server):
    """HTTP/1.0 has no chunked encoding: a streamed reply comes whole with its Content-Length."""
    import socket

    body = json.dumps({"inputs": "old client", "parameters": {"max_new_tokens": 4, "ignore_eos": True}}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /generate_stream HTTP/1.0\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    headers = head.decode().lower()
    assert "transfer-encoding" not in headers and f"content-length: {len(payload)}" in headers
    assert payload.count(b"data:") == 4


def test_openapi_describes_every_request_body(server):
    spec = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    posts = {path: ops["post"] for path, ops in spec["paths"].items() if "post" in ops}
    assert {"/", "/generate", "/generate_stream", "/tokenize", "/v1/completions", "/v1/chat/completions",
            "/models/{model}/generate", "/models/{model}/generate_stream", "/models/{model}"} <= set(posts)
    admin = {"/admin/agents/{port}/drain", "/admin/agents/{port}/resume"}  # commands on a path: no body
    assert admin <= set(posts) and all("requestBody" in op for path, op in posts.items() if path not in admin)
    params = spec["components"]["schemas"]["GenerationParameters"]["properties"]
    assert {"do_sample", "max_new_tokens", "return_full_text", "return_protocol"} <= set(params)


def test_console_carries_only_our_lines(server):
    """MindSpore's own C++ warnings go to the agent's log file, not to the user's console."""
    ours = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (agent\d+|llm_serving[\w.]*) [A-Z]+ |^llm-serving ready at ")
    foreign = [line for line in server.log.read_text().splitlines() if line and not ours.match(line)]
    assert foreign == []


def test_health_and_status_endpoints(server):
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    assert httpx.get(f"{server.url}/info", timeout=10).json()["max_total_tokens"] == 128
    toks = httpx.post(f"{server.url}/tokenize", json={"inputs": "ab"}, timeout=10).json()
    assert [t["text"] for t in toks] == ["a", "b"]
    assert "traceEvents" in httpx.get(f"{server.url}/debug/trace", timeout=10).json()
    mem = httpx.get(f"{server.url}/stats", timeout=10).json()["memory"][0]
    assert 0 < mem["rss_bytes"] < mem["planned_bytes"]  # the plan holds (its runtime: 600 MiB)


def test_kv_exhaustion_preempts_and_every_request_completes(tmp_path, tiny_model_dir):
    # 12 blocks of 4 tokens (11 usable: one 40-token sequence) cannot hold 4 sequences of 8 + 24 tokens at once.
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, num_blocks=12, block_size=4, decode_seq_length=40))
    try:
        prompts = ["abcdefgh", "ijklmnop", "qrstuvwx", "yzabcdef"]
        single = {p: original_generate(srv.url, p, new=24)["generated_text"] for p in prompts}
        out: dict[str, str] = {}
        threads = [threading.Thread(target=lambda p=p: out.__setitem__(
            p, original_generate(srv.url, p, new=24)["generated_text"])) for p in prompts]
        with srv.agents_paused():  # all four admitted before a step ends: they run together, however slow the machine
            for t in threads:
                t.start()
            srv.stats_until(lambda s: s["running"] + s["waiting"] == 4)
        for t in threads:
            t.join(180)
        assert out == single
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        preempted = [float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("llm_serving_preemptions_total")]
        assert preempted and preempted[0] > 0
    finally:
        srv.stop()


def test_queue_bound_gives_503_with_retry_after(tmp_path, tiny_model_dir):
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, max_queue=1, num_blocks=12, block_size=4,
                                    decode_seq_length=40))
    try:
        codes: list[int] = []
        bodies: list[httpx.Response] = []

        start = threading.Barrier(12)

        def one() -> None:
            with httpx.Client(timeout=120) as client:  # connected first: the 12 posts leave together
                client.get(f"{srv.url}/health")
                start.wait()
                r = client.post(f"{srv.url}/generate", json={"inputs": "abcdefgh", "parameters": {
                    "max_new_tokens": 24, "ignore_eos": True}})
            codes.append(r.status_code)
            bodies.append(r)

        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert sorted(set(codes)) == [200, 503]
        refused = next(r for r in bodies if r.status_code == 503)
        assert int(refused.headers["retry-after"]) >= 1 and "overloaded" in refused.json()["error"]
    finally:
        srv.stop()


def test_agent_sigkill_requests_move_to_live_agent_then_fail_cleanly(tmp_path, tiny_model_dir):
    """With restarts off (max_agent_restarts: 0) a dead agent stays dead: its requests move to the
    live one, and when none is left requests fail with a reason instead of hanging."""
    srv = ServerProcess(tiny_config(tmp_path, tiny_model_dir, n_agents=2, max_agent_restarts=0))
    try:
        prompts = [f"prompt number {i}" for i in range(6)]
        # Long enough to be in flight at the kill now that warm-up leaves nothing to compile.
        single = {p: original_generate(srv.url, p, new=80)["generated_text"] for p in prompts}
        out: dict[str, str] = {}
        threads = [threading.Thread(target=lambda p=p: out.__setitem__(
            p, original_generate(srv.url, p, new=80)["generated_text"])) for p in prompts]
        for t in threads:
            t.start()
        time.sleep(0.5)
        victim, survivor = srv.agent_pids()
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(180)
        assert out == single  # re-run on the live agent from the tokens generated so far
        deadline = time.monotonic() + 5  # the pid/socket monitor sees a SIGKILL within ~2 s
        while (health := httpx.get(f"{srv.url}/health", timeout=10)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health.status_code == 503 and "dead" in health.json()["reason"]
        os.kill(survivor, signal.SIGKILL)
        time.sleep(1.0)
        r = httpx.post(f"{srv.url}/generate", json={"inputs": "anyone?"}, timeout=30)
        assert r.status_code >= 500 and "agent" in r.json()["error"]
    finally:
        srv.stop()


def _graph_compiles(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("llm_serving_graph_compiles_total")))


def test_no_graph_is_built_after_ready(server):
    """Every graph is built before ready: a burst of prompts of 1 to max_model_len - max_tokens
    tokens, mixed with decodes of the ones already running, adds no compile."""
    before = _graph_compiles(server.url)
    assert before == 5  # one graph per token bucket of the tiny config: 1, 4, 8, 16, 32
    lengths = [1, 104, 2, 57, 9, 33, 17, 3, 80, 31, 64, 5]
    errors: list[str] = []

    def run(i: int, n: int) -> None:
        body = {"model": "tiny", "prompt": [(7 * i + j) % 250 + 3 for j in range(n)], "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=180)
        if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 24:
            errors.append(r.text)

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(lengths)]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.05 * (i % 3))  # staggered: new prompts join steps that are decoding
    for t in threads:
        t.join(240)
    assert not errors, errors
    assert _graph_compiles(server.url) == before
    # The engine launches the next step as soon as a reply is in: it slept 200 ms on its inbox
    # between steps (a third of an all-at-once benchmark).
    steps = httpx.get(f"{server.url}/debug/trace", timeout=30).json()["traceEvents"][-60:]
    gaps = sorted(b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(steps, steps[1:]))
    assert gaps[len(gaps) // 2] < 50e3, gaps  # microseconds
