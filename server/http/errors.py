"""The error body every route and middleware answers with: OpenAI's shape under /v1/, the original's
and TGI's (`error`, `error_type`) elsewhere."""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Send = Callable[[dict[str, Any]], Awaitable[None]]


def error_body(path: str, message: str, kind: str, code: int | str) -> dict[str, Any]:
    if path.startswith("/v1/"):
        return {"error": {"message": message, "type": kind, "code": code}}
    return {"error": message, "error_type": kind}


async def send_error(send: Send, path: str, status: int, message: str, kind: str,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """The error as a whole ASGI response, for middleware that answers before any route runs."""
    raw = json.dumps(error_body(path, message, kind, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": raw})
