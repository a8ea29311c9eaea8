"""Structured output and tool calls through real processes: the tiny model has random weights, so
whatever parses was made to parse by the grammar, not by the model. Also: every dialect refuses a
field it does not honour, and a model name the server does not serve is a 404."""
from __future__ import annotations

import json
import re
import threading
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from tests.e2e.payloads import SCHEMA, TOOLS, valid
from tests.helpers import ServerProcess, tiny_config

PROMPTS = ["hello", "the weather please", "x y z", "what now"]


class Answer(pydantic.BaseModel):
    colour: Literal["red", "green", "blue"]
    ok: bool
    n: int = pydantic.Field(ge=0, le=999)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("structured")
    srv = ServerProcess(tiny_config(tmp, tiny_model_dir, num_blocks=512, block_size=4, decode_seq_length=1024,
                                    max_generate_length=1024,
                                    model_aliases=["tiny-alias"]))
    yield srv
    srv.stop()


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _parses(text: str) -> bool:
    try:
        return valid(json.loads(text))
    except ValueError:
        return False


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_holds_on_a_random_model(server, temperature):
    c = _client(server)
    for p in PROMPTS:
        r = c.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": p}], response_format=Answer,
                                     max_tokens=300, temperature=temperature, seed=7)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert valid(r.choices[0].message.parsed.model_dump())


def test_json_object_and_tgi_regex_and_json(server):
    c = _client(server)
    free = [c.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0).choices[0].text for p in PROMPTS]
    r = c.completions.create(model="tiny-alias", prompt="hello", max_tokens=300, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    assert _parses(r.choices[0].text)
    assert not any(_parses(t) for t in free)  # unconstrained, the random model writes no such JSON
    for p in PROMPTS:
        body = {"inputs": p, "parameters": {"max_new_tokens": 20, "grammar": {"type": "regex", "value": "[0-9]{3}-[a-c]{2}"}}}
        out = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
        assert re.fullmatch("[0-9]{3}-[a-c]{2}", out["generated_text"]), out
        body["parameters"].update(grammar={"type": "json", "value": SCHEMA}, max_new_tokens=300, do_sample=True, seed=3)
        out = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
        assert valid(json.loads(out["generated_text"])), out


def test_required_tool_calls_parse_and_stream_the_same(server):
    c = _client(server)
    for p in PROMPTS:
        args = dict(model="tiny", messages=[{"role": "user", "content": p}], tools=TOOLS, tool_choice="required",
                    max_tokens=300, temperature=0)
        r = c.chat.completions.create(**args)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        [call] = r.choices[0].message.tool_calls
        spec = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        assert set(json.loads(call.function.arguments)) == set(spec["required"])
        streamed = [d for ch in c.chat.completions.create(**args, stream=True) for d in (ch.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, d.function.arguments) for d in streamed] == \
            [(0, call.function.name, call.function.arguments)]
    named = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "sum"}], tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=300)
    assert named.choices[0].message.tool_calls[0].function.name == "add"
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = c.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


def test_auto_tool_choice_streams_text_as_it_comes(server):
    """tool_choice auto (the default with tools): a reply that is no call streams its text as it
    comes, as without tools (not as one chunk at the end), and equals the reply unstreamed."""
    c = _client(server)
    args = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], tools=TOOLS, max_tokens=24,
                temperature=0, extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**args).choices[0].message
    chunks = [ch.choices[0].delta.content for ch in c.chat.completions.create(**args, stream=True)
              if ch.choices and ch.choices[0].delta.content]
    assert whole.tool_calls is None and "".join(chunks) == whole.content and len(chunks) > 8


def test_constrained_rows_beside_others_through_preemption(tmp_path, tiny_model_dir):
    """Four constrained and two free requests at once on a pool that holds about one: sequences are
    preempted and recomputed (their grammars rebuilt from their outputs so far on the agent), fed
    decodes run overlapped, and every constrained reply still parses; greedy ones equal alone."""
    server = ServerProcess(tiny_config(tmp_path, tiny_model_dir, num_blocks=66, block_size=4, decode_seq_length=256,
                                         max_generate_length=256))
    try:
        _preempted(server)
    finally:
        server.stop()


def _preempted(server: ServerProcess) -> None:
    c = _client(server)
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    alone = {p: c.completions.create(model="tiny", prompt=p, max_tokens=220, temperature=0,
                                     extra_body=fmt).choices[0].text for p in PROMPTS}
    out: dict[str, str] = {}

    def one(p: str, constrained: bool) -> None:
        out[p + str(constrained)] = c.completions.create(model="tiny", prompt=p, max_tokens=220, temperature=0,
                                                         extra_body=fmt if constrained else {}).choices[0].text

    threads = [threading.Thread(target=one, args=(p, True)) for p in PROMPTS]
    threads += [threading.Thread(target=one, args=(p, False)) for p in PROMPTS[:2]]
    with server.agents_paused():  # all admitted before a step ends: they run together however slow the machine
        for t in threads:
            t.start()
        server.stats_until(lambda s: s["running"] + s["waiting"] == len(threads))
    for t in threads:
        t.join(300)
    assert {p: out[p + "True"] for p in PROMPTS} == alone
    assert all(_parses(v) for v in alone.values())
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("llm_serving_preemptions_total")][0] > 0


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "audio": 1}]}, "audio"),
    ("/generate", {"inputs": "x", "parameters": {"typo_p": 0.5}}, "typo_p"),
    ("/generate", {"inputs": "x", "parameters": {"watermark": True}}, "watermark"),
    ("/models/tiny/generate", {"inputs": "x", "parameters": {}, "extra": 1}, "extra"),
])
def test_a_field_no_dialect_honours_is_a_400_naming_it(server, path, body, field):
    r = httpx.post(server.url + path, json={**body, "model": "tiny"} if path.startswith("/v1") else body, timeout=60)
    assert r.status_code == 400 and field in r.text, r.text


def test_ignored_fields_and_model_names(server):
    c = _client(server)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, user="u1",
                                  metadata={"k": "v"}, store=False)
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]


@pytest.mark.parametrize("fmt,why", [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}, "foo"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {f"k{i}": {"type": "string", "description": "d" * 64} for i in range(2000)}}}},
     "characters"),
])
def test_bad_schemas_are_400_and_the_server_goes_on(server, fmt, why):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "x"}], "response_format": fmt}, timeout=60)
    assert r.status_code == 400 and why in r.text, r.text
    bad = httpx.post(f"{server.url}/generate", json={"inputs": "x", "parameters": {
        "grammar": {"type": "regex", "value": "[a-"}}}, timeout=60)
    assert bad.status_code == 400 and "regex" in bad.text
    both = httpx.post(f"{server.url}/generate", json={"inputs": "x", "parameters": {
        "ignore_eos": True, "grammar": {"type": "regex", "value": "a"}}}, timeout=60)
    assert both.status_code == 400 and "ignore_eos" in both.text
    assert httpx.post(f"{server.url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}},
                      timeout=60).status_code == 200


def test_n_choices_share_one_prefill(server):
    """n=4: four choices, each its own seed stream; the prompt is computed once and the other three
    take its blocks from the prefix cache. Streamed, the same choices come interleaved by index."""
    c = _client(server)

    def computed() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith("llm_serving_prefill_tokens_computed_total"))

    prompt = "a prompt long enough to fill several KV blocks of four tokens each"
    before = computed()
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=4, temperature=1.0, extra_body={"ignore_eos": True}, seed=11)
    n_prompt = r.usage.prompt_tokens
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and len({ch.text for ch in r.choices}) > 1
    assert r.usage.completion_tokens == 32
    assert computed() - before < 2 * n_prompt  # once in full, then only each choice's last partial block
    alone = [c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True}, seed=11 + i).choices[0].text
             for i in range(4)]
    assert [ch.text for ch in r.choices] == alone
    streamed = ["", "", "", ""]
    for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=4, temperature=1.0, extra_body={"ignore_eos": True}, seed=11, stream=True):
        for choice in ch.choices:
            streamed[choice.index] += choice.text
    assert streamed == alone


def test_prompt_logprobs_are_the_model_s_own_next_token_logprobs(server):
    """echo + logprobs: a prompt whose tail the model generated itself (greedy) must score that tail
    with the logprobs it was generated with, the top alternative being the token itself: that pins
    every position (an off-by-one fails). The prompt is scored in chunks of at most max_running (8)
    tokens: a prefix scored alone agrees. Streamed, n=2 and TGI's decoder_input_details agree."""
    c = _client(server)
    head = [t["id"] for t in httpx.post(f"{server.url}/tokenize", json={"inputs": "the weather in Lima"},
                                        timeout=30).json()]
    gen = httpx.post(f"{server.url}/generate", json={"inputs": "the weather in Lima", "parameters": {
        "max_new_tokens": 24, "details": True, "ignore_eos": True}}, timeout=60).json()["details"]["tokens"]
    ids = head + [t["id"] for t in gen]
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=1, logprobs=1, echo=True)
    lp, n = r.choices[0].logprobs, len(ids)
    assert r.usage.prompt_tokens == n and len(lp.tokens) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[n - 24:n] == pytest.approx([t["logprob"] for t in gen], abs=2e-3)
    assert all(list(lp.top_logprobs[k]) == [lp.tokens[k]] for k in range(n - 24, n))
    short = c.completions.create(model="tiny", prompt=ids[:15], max_tokens=1, logprobs=3, echo=True).choices[0]
    assert short.logprobs.token_logprobs[:15] == pytest.approx(lp.token_logprobs[:15], abs=2e-3)
    assert all(1 <= len(t) <= 3 for t in short.logprobs.top_logprobs[1:15])  # pieces may share a text ("\ufffd")
    streamed = list(c.completions.create(model="tiny", prompt=ids, max_tokens=1, logprobs=1, echo=True, stream=True))
    assert streamed[0].choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n], abs=1e-6)
    two = c.completions.create(model="tiny", prompt=ids, max_tokens=1, logprobs=1, echo=True, n=2, temperature=1.0)
    assert [ch.logprobs.token_logprobs[:n] for ch in two.choices] == [pytest.approx(lp.token_logprobs[:n], abs=1e-6)] * 2
    tgi = httpx.post(f"{server.url}/generate", json={"inputs": "the weather in Lima", "parameters": {
        "max_new_tokens": 1, "decoder_input_details": True}}, timeout=60).json()
    assert [p["logprob"] for p in tgi["details"]["prefill"]] == pytest.approx(lp.token_logprobs[:len(head)], abs=2e-3)
    refused = httpx.post(f"{server.url}/generate_stream", json={"inputs": "x", "parameters": {
        "decoder_input_details": True}}, timeout=60)
    assert refused.status_code == 400 and "decoder_input_details" in refused.text
