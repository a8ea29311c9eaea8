"""Structured output and tool calls at the API edge: OpenAI's `response_format` and `tools` /
`tool_choice`, TGI's `grammar`, each turned into one llguidance grammar (common/grammar.py) that
the agent's sampler follows token by token, so the output parses by construction. Replies that
carry tool calls are parsed back into OpenAI's `tool_calls` here."""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from common import grammar as G
from server.sampling_params import InvalidRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # always strict here: the grammar admits only what the schema does


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class TgiGrammar(_Strict):
    """TGI's `parameters.grammar`: a JSON schema or a regex the output must match."""
    type: Literal["json", "json_object", "regex"]
    value: Any


def compile_format(rf: ResponseFormat | None) -> str | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return G.any_json_object()
    if rf.json_schema is None:
        raise InvalidRequest("response_format: json_schema needs its json_schema.schema")
    return _g(lambda: G.from_json_schema(rf.json_schema.json_schema, "response_format.json_schema.schema"))


def compile_tgi(g: TgiGrammar | None) -> str | None:
    if g is None:
        return None
    if g.type == "regex":
        return _g(lambda: G.from_regex(g.value))
    return _g(lambda: G.from_json_schema(g.value, "grammar.value"))


def _g(make: Any) -> str:
    try:
        return make()
    except G.GrammarError as exc:
        raise InvalidRequest(str(exc)) from None


def chosen_tools(tools: list[Tool], choice: ToolChoice | None) -> tuple[list[Tool], bool]:
    """The tools the reply may call and whether it must call one (`required` or a named function)."""
    if not tools and choice not in (None, "none", "auto"):
        raise InvalidRequest("tool_choice requires tools")
    if not tools or choice == "none":
        return [], False
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise InvalidRequest(f"tool_choice names {choice.function.name!r}, which is not among tools")
        return named, True
    return tools, choice == "required"


def call_grammar(tools: list[Tool]) -> str:
    """One call as {"name": ..., "arguments": {...}}, the arguments under the function's schema."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters}} for t in tools]
    return _g(lambda: G.from_json_schema(calls[0] if len(calls) == 1 else {"anyOf": calls}, "tools' parameters"))


def tools_system_prompt(tools: list[Tool]) -> str:
    """What a chat template without tool support is told about the tools (Hermes' wording)."""
    listing = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
    return ("You may call one of these functions:\n" + listing + "\nTo call a function, reply with only a JSON "
            'object: {"name": <function name>, "arguments": <arguments object>}.')


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str, tools: list[Tool]) -> list[dict[str, Any]] | None:
    """OpenAI `tool_calls` from a reply that is one call as JSON, or <tool_call> blocks of them; None
    when the reply is not a call of one of `tools`."""
    names = {t.function.name for t in tools}
    parts = _TAGGED.findall(text) or [text.strip()]
    calls = []
    for part in parts:
        try:
            obj = json.loads(part)
        except ValueError:
            return None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(args, dict):
            return None
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args)}})
    return calls


TOOL_TAG = "<tool_call>"


class CallStream:
    """A chat reply while tools may be called (`tool_choice` auto), as vLLM's tool parsers stream
    it: text goes out as it comes until a call can have begun (a `<tool_call>` tag, or a reply that
    opens with `{`: a bare JSON call); from there it is held to the end, then parsed as calls, or
    sent as text if it is none. A tail that could begin the tag waits for the next piece."""

    def __init__(self, tools: list[Tool]):
        self.tools, self.pending, self.held, self.begun = tools, "", None, False

    def feed(self, text: str) -> str:
        """The text to send now."""
        if self.held is not None:
            self.held += text
            return ""
        self.pending += text
        head = self.pending.lstrip()
        if not self.begun and (not head or head.startswith("{")):  # the reply's first text decides
            if head:
                self.held, self.pending = self.pending, ""
            return ""
        self.begun = True
        at = self.pending.find(TOOL_TAG)
        if at >= 0:
            out, self.held, self.pending = self.pending[:at], self.pending[at:], ""
            return out
        keep = next((k for k in range(len(TOOL_TAG) - 1, 0, -1) if self.pending.endswith(TOOL_TAG[:k])), 0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]] | None]:
        """At the reply's end: (text still to send, the calls or None)."""
        calls = parse_tool_calls(self.held, self.tools) if self.held is not None else None
        return ("", calls) if calls else (self.pending + (self.held or ""), None)
