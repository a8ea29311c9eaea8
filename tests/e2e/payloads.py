"""Request payloads the end-to-end tests share: a JSON schema with its validity check, and tools
for function calling."""
from __future__ import annotations


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["colour", "ok", "n"],
          "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                         "properties": {"city": {"enum": ["Paris", "Lima"]}, "unit": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}}}}}]


def valid(obj: dict) -> bool:
    return (set(obj) == {"colour", "ok", "n"} and obj["colour"] in ("red", "green", "blue")
            and isinstance(obj["ok"], bool) and isinstance(obj["n"], int) and 0 <= obj["n"] <= 999)
