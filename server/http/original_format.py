"""Reply bodies of the original llm-serving API, byte for byte (its examples/server_app_post.py):
key order, `json.dumps(..., ensure_ascii=False)` spacing, newline-terminated lines, the one-element
`data` list its stream lines carry (a trailing comma in the original made it a tuple; its contest
client reads `data[0]`), and SSE framing only on the `/serving/*` status endpoints.

Our extras, only where the original has no field: an `{"event": "error", ...}` line when a
request fails mid-stream (the original hung), and error replies as HTTP 4xx/5xx JSON.
"""
from __future__ import annotations

import json
from typing import Any

RETRY_MS = 30000
# The original's `generate_result` reasons: "eos" (the token is an end token), "length"
# (max_new_tokens), "predict_failed" (the agent failed). Ours where it had none: "stop" (a stop
# string or stop token id, which it ignored) and "abort" (the client went away; it never noticed).
FINISH_REASON = {"eos": "eos", "length": "length", "error": "predict_failed", "stop": "stop", "cancelled": "abort"}


def line(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def token_item(token_id: int, logprob: float, special: bool, text: str) -> dict[str, Any]:
    return {"id": token_id, "logprob": logprob, "special": special, "text": text}


def full_reply(tokens: list[dict[str, Any]], text: str, reason: str) -> dict[str, Any]:
    """`/generate` (and `/models/{model}` without stream): all tokens in one object."""
    first = tokens[:1]
    return {"generated_text": text, "finish_reason": FINISH_REASON.get(reason, reason),
            "generated_tokens": len(tokens), "prefill": first, "seed": 0, "tokens": tokens,
            "top_tokens": [first], "details": None}


def stream_item(token: dict[str, Any]) -> dict[str, Any]:
    return {"details": None, "generated_text": token["text"], "tokens": token, "top_tokens": [token]}


def final_item(tokens: list[dict[str, Any]], text: str, reason: str) -> dict[str, Any]:
    """The last stream object with `return_full_text`: the whole generated text (never the prompt)."""
    return {"details": None, **{k: v for k, v in full_reply(tokens, text, reason).items() if k != "details"}}


class StreamLines:
    """The lines of one original stream: a line per token, then its ending. With `full_text`
    (return_full_text, on by default) the last line carries the whole generated text and the
    finish reason, as the original's; a failure ends with that line (predict_failed) plus an
    `error` field, or without full_text with an `{"event": "error"}` line whose `data[0]` still has
    the `generated_text` key its clients read."""

    def __init__(self, sse: bool, full_text: bool):
        self.sse, self.full_text = sse, full_text
        self.items: list[dict[str, Any]] = []
        self.text = ""

    def token(self, item: dict[str, Any]) -> str:
        self.items.append(item)
        self.text += item["text"]
        return self._line(stream_item(item))

    def end(self, reason: str, error: str | None = None) -> str | None:
        if not self.full_text:
            if error is None:
                return None
            return line({"event": "error", "data": [{"error": error, "finish_reason": FINISH_REASON["error"],
                                                      "generated_text": ""}]})
        last = final_item(self.items, self.text, reason) if self.sse else full_reply(self.items, self.text, reason)
        return self._line({**last, "error": error} if error is not None else last)

    def _line(self, item: dict[str, Any]) -> str:
        return line(event(item)) if self.sse else plain_line(item)


def event(item: dict[str, Any]) -> dict[str, Any]:
    """A stream line of the default `return_protocol: sse`."""
    return {"event": "message", "retry": RETRY_MS, "data": [item]}


def plain_line(item: dict[str, Any]) -> str:
    """A stream line of any other `return_protocol`: `data:` + the bare object."""
    return "data:" + line(item)


def status_event(data: Any) -> str:
    """`/serving/get_bs` and `/serving/get_request_numbers`: one server-sent event."""
    return sse_event({"event": "message", "retry": RETRY_MS, "data": data})


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\r\n\r\n"


def docker_label() -> str:
    """The container id as the original found it (`grep /docker /proc/self/cgroup | cut -d/ -f3`), or ""."""
    try:
        rows = [r for r in open("/proc/self/cgroup").read().splitlines() if "/docker" in r]
    except OSError:
        return ""
    parts = rows[0].split("/") if rows else []
    return parts[2] if len(parts) > 2 else ""
