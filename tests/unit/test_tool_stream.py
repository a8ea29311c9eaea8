"""A chat reply streamed while tools may be called (server/http/structured.py CallStream): text goes
out as it comes, and only what follows the point a call can begin is held."""
from __future__ import annotations

import json

from server.http.structured import CallStream, Tool

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}})]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _stream(pieces: list[str]) -> tuple[list[str], str, list | None]:
    watch = CallStream(TOOLS)
    sent = [watch.feed(p) for p in pieces]
    tail, calls = watch.finish()
    return [s for s in sent if s], tail, calls


def test_text_before_a_tagged_call_streams_and_the_call_is_parsed():
    text = f"Let me check. <tool_call>{CALL}</tool_call>"
    for pieces in ([text], list(text)):  # whole, and a character at a time (the tag split over pieces)
        sent, tail, calls = _stream(pieces)
        assert "".join(sent) == "Let me check. " and tail == ""
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [("get_weather", {"city": "Paris"})]
    assert len(_stream(list(text))[0]) == len("Let me check. ")  # one event a character, not one at the end


def test_a_reply_that_opens_with_json_is_held_and_parsed():
    sent, tail, calls = _stream(["  ", CALL[:10], CALL[10:]])
    assert sent == [] and tail == "" and calls[0]["function"]["name"] == "get_weather"


def test_what_is_no_call_is_text_in_the_end():
    sent, tail, calls = _stream(["Hello", " <tool", "box> and ", "<tool_call>not json</tool_call>"])
    assert sent == ["Hello", " ", "<toolbox> and "] and calls is None
    assert tail == "<tool_call>not json</tool_call>"
    sent, tail, calls = _stream(['{"colour": ', '"red"}'])  # JSON, but no call of a tool: text at the end
    assert sent == [] and tail == '{"colour": "red"}' and calls is None


def test_function_tools_are_strict_unless_they_say_not():
    """The Responses API's function tools default to strict: every object of the parameters closed
    and its properties required, where the schema does not say otherwise; strict false keeps it."""
    from server.http.responses_schema import FunctionTool

    params = {"type": "object", "properties": {"city": {"type": "string"},
                                               "at": {"type": "object", "properties": {"lat": {"type": "number"}}}},
              "required": ["city"]}
    strict = FunctionTool(type="function", name="f", parameters=params).chat()["function"]["parameters"]
    assert strict["additionalProperties"] is False and strict["required"] == ["city"]
    assert strict["properties"]["at"] == {"type": "object", "properties": {"lat": {"type": "number"}},
                                          "additionalProperties": False, "required": ["lat"]}
    loose = FunctionTool(type="function", name="f", parameters=params, strict=False).chat()["function"]["parameters"]
    assert loose == params
