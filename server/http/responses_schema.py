"""The OpenAI Responses API's request body (`POST /v1/responses`), turned into the chat request the
chat path already serves: `input` (text or items) and `instructions` become messages, function tools
and `tool_choice` their chat forms, `text.format` a `response_format`. What this server cannot
honour is a 400 naming it: built-in tools (web search, file search, ...), reasoning items, image and
file inputs, and every field no model here declares."""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from server.http.schemas import Float, Int, ChatRequest
from server.sampling_params import InvalidRequest

# Fields clients send that ask for no action here (OpenAI's end-user id and the like).
IGNORED = frozenset({"user", "safety_identifier", "prompt_cache_key", "service_tier"})
TEXT_PARTS = ("input_text", "output_text", "text")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None and k not in IGNORED} if isinstance(data, dict) else data


class FunctionTool(_Body):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = True  # the Responses API's default: the arguments follow the schema, no other keys

    @field_validator("type")
    @classmethod
    def _function_only(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f"tool type {kind!r} is not supported (only function tools)")
        return kind

    def chat(self) -> dict[str, Any]:
        if not self.name:
            raise InvalidRequest("tools: a function tool needs a name")
        schema = self.parameters or {"type": "object", "properties": {}}
        fn = {"name": self.name, "parameters": strict_schema(schema) if self.strict else schema}
        return {"type": "function", "function": {**fn, **({"description": self.description} if self.description else {})}}


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat = TextFormat()
    verbosity: Literal["medium"] | None = None  # the only one a model without the knob honours

    def response_format(self) -> dict[str, Any] | None:
        f = self.format
        if f.type == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": f.name, "schema": f.json_schema or {"type": "object"}}}
        return {"type": "json_object"} if f.type == "json_object" else None


class ResponsesRequest(_Body):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Int | None = None
    temperature: Float = 1.0
    top_p: Float = 1.0
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] = {}
    text: TextConfig = TextConfig()
    tools: list[FunctionTool] = []
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    truncation: Literal["disabled"] = "disabled"

    def items(self, history: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """`input` as chat messages (consecutive function calls are one assistant turn), each call
        naming a tool of this request with JSON arguments, each output answering a call before it
        (in `input` or the stored `history`)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        calls = {c["id"] for m in history for c in m.get("tool_calls", [])}
        for i, item in enumerate(self.input):
            msg = input_message(item, f"input[{i}]")
            check_call_item(msg, f"input[{i}]", {t.name for t in self.tools}, calls)
            if msg.get("tool_calls") and out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"] += msg["tool_calls"]
            else:
                out.append(msg)
        return out

    def chat_request(self, history: list[dict[str, Any]]) -> ChatRequest:
        """The chat request this is, after the stored conversation `history` (previous_response_id)."""
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequest("max_output_tokens must be >= 1")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {"model": self.model, "messages": system + history + self.items(history),
                                "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
                                "response_format": self.text.response_format()}
        if self.tools:
            body["tools"] = [t.chat() for t in self.tools]
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else _named(self.tool_choice)
        elif self.tool_choice != "auto":
            raise InvalidRequest("tool_choice needs tools")
        try:
            return ChatRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:  # what the chat form refuses, named in this request's terms
            e = exc.errors()[0]
            where = ".".join(str(x) for x in e["loc"]).replace("messages", "input (with instructions and history)")
            raise InvalidRequest(f"invalid request: {where}: {e['msg']}") from None


def strict_schema(schema: Any) -> Any:
    """A function's parameters as OpenAI's strict mode reads them: every object closed
    (`additionalProperties: false`) and its properties required, where the schema does not say."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
        out.setdefault("required", list(out.get("properties", {})))
    return out


def _named(choice: dict[str, Any]) -> dict[str, Any]:
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) - {"type", "name"}:
        raise InvalidRequest('tool_choice: "none", "auto", "required" or {"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


def input_message(item: dict[str, Any], where: str) -> dict[str, Any]:
    """One input item as a chat message: a message (text content), a function call or its output."""
    kind = item.get("type", "message")
    if kind == "function_call":
        _keys(item, {"type", "call_id", "name", "arguments", "id", "status"}, where)
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": str(item.get("call_id", "")), "type": "function",
             "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}]}
    if kind == "function_call_output":
        _keys(item, {"type", "call_id", "output", "id", "status"}, where)
        return {"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": _text(item, "output", where)}
    if kind != "message":
        raise InvalidRequest(f"{where}: item type {kind!r} is not supported (message, function_call, "
                             "function_call_output)")
    _keys(item, {"type", "role", "content", "id", "status"}, where)
    content = item.get("content", "")
    if isinstance(content, list):
        bad = [p.get("type") for p in content if not isinstance(p, dict) or p.get("type") not in TEXT_PARTS]
        if bad:
            raise InvalidRequest(f"{where}.content: part type {bad[0]!r} is not supported (text parts only)")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise InvalidRequest(f"{where}.content: text or a list of text parts")
    return {"role": item.get("role"), "content": content}


def check_call_item(msg: dict[str, Any], where: str, tools: set[str | None], calls: set[str]) -> None:
    """A function_call names one of `tools` with a JSON object of arguments (its call_id joins
    `calls`); a function_call_output answers one of `calls`. OpenAI answers 400 to the others."""
    for call in msg.get("tool_calls", []):
        fn = call["function"]
        if fn["name"] not in tools:
            raise InvalidRequest(f"{where}.name: {fn['name']!r} is not a function tool of this request")
        try:
            if not isinstance(json.loads(fn["arguments"]), dict):
                raise ValueError
        except ValueError:
            raise InvalidRequest(f"{where}.arguments: a JSON object is required") from None
        calls.add(call["id"])
    if msg["role"] == "tool" and msg["tool_call_id"] not in calls:
        raise InvalidRequest(f"{where}.call_id: no function_call with call_id {msg['tool_call_id']!r} comes before it")


def _keys(item: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise InvalidRequest(f"{where}: unknown field {extra[0]!r}")


def _text(item: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise InvalidRequest(f"{where}.{key}: a string is required")
    return item[key]
