"""OpenAI's Responses API through real processes and the official client: a response is the chat
completion of the same conversation (greedy: the same text), streamed as typed events, parsed into
a pydantic model, calling functions and continued by `previous_response_id`; what it cannot honour
is a 400 naming it."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from tests.e2e.payloads import TOOLS
from tests.helpers import ServerProcess, tiny_config

WEATHER = [{"type": "function", **TOOLS[0]["function"]}]  # the Responses API's flat function tool


class Answer(pydantic.BaseModel):
    colour: Literal["red", "green", "blue"]
    ok: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("responses")
    srv = ServerProcess(tiny_config(tmp, tiny_model_dir, num_blocks=512, block_size=4, decode_seq_length=1024,
                                    max_generate_length=1024))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, messages: list[dict], n: int) -> str:
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=n,
                                          temperature=0).choices[0].message.content


def test_a_response_is_the_chat_completion_of_its_conversation(client):
    r = client.responses.create(model="tiny", input="hello", instructions="be brief", max_output_tokens=12,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"  # the message it cut, as the response
    assert r.output_text == _chat(client, [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "hello"}], 12)
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    assert client.responses.retrieve(r.id).output_text == r.output_text
    # continued: the stored conversation (without its instructions), then the new input
    follow = client.responses.create(model="tiny", input="and then?", previous_response_id=r.id,
                                     max_output_tokens=6, temperature=0)
    assert follow.output_text == _chat(client, [{"role": "user", "content": "hello"},
                                                {"role": "assistant", "content": r.output_text},
                                                {"role": "user", "content": "and then?"}], 6)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="x", previous_response_id=r.id)


def test_a_streamed_response_sends_the_typed_events(client):
    args = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                max_output_tokens=10, temperature=0, store=False)
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert events[-2].item.status == events[-1].response.output[0].status == "incomplete"
    assert len(deltas) > 2 and "".join(deltas) == client.responses.create(**args).output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.NotFoundError):  # store false: nothing kept
        client.responses.retrieve(events[-1].response.id)


def test_a_repeated_prompt_counts_its_cached_tokens(client):
    args = dict(model="tiny", input="tell me about the sea " * 20, max_output_tokens=2, temperature=0, store=False)
    first = client.responses.create(**args)
    again = client.responses.create(**args)
    assert first.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens
    streamed = [e for e in client.responses.create(**args, stream=True) if e.type == "response.incomplete"]
    assert streamed[0].response.usage.input_tokens_details.cached_tokens == again.usage.input_tokens_details.cached_tokens


def test_parse_into_a_pydantic_model(client):
    r = client.responses.parse(model="tiny", input="a colour", text_format=Answer, max_output_tokens=300)
    assert isinstance(r.output_parsed, Answer)


def test_a_function_call_round_trip(client):
    r = client.responses.create(model="tiny", input="weather in Paris?", tools=WEATHER, tool_choice="required",
                                max_output_tokens=300)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    answer = client.responses.create(model="tiny", previous_response_id=r.id, tools=WEATHER, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
                                     max_output_tokens=5, temperature=0)
    assert answer.output[0].type == "message" and answer.output_text
    streamed = [e for e in client.responses.create(model="tiny", input="weather in Paris?", tools=WEATHER,
                                                   tool_choice="required", max_output_tokens=300, stream=True)]
    done = [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and set(json.loads(done[0])) == {"city", "unit"}


@pytest.mark.parametrize("body,named", [
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input_image"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "reasoning"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}}, "nope"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "21 C"}], "tools": WEATHER},
     "no function_call with call_id 'call_9'"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "21 C"}], "tools": WEATHER}, "call_2"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "rm_rf", "arguments": "{}"}], "tools": WEATHER},
     "'rm_rf' is not a function tool"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "not json"}],
      "tools": WEATHER}, "input[0].arguments: a JSON object"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens must be >= 1"),
    ({"input": "x", "temperature": 3}, "temperature must be in [0, 2]"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, body, named):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text
