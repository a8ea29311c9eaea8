"""Request bodies over `max_body_bytes` get 413 before anything parses them: by the declared
Content-Length, or while a chunked upload streams in."""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Message = dict[str, Any]


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, send)
            return
        seen, over = 0, False

        async def counted() -> Message:
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                over = True
                raise BodyTooLarge
            return message

        async def unless_over(message: Message) -> None:
            # FastAPI turns an error while reading the body into its own 400: ours is the answer.
            if not over:
                await send(message)

        try:
            await self.app(scope, counted, unless_over)
        except BodyTooLarge:
            pass
        if over:
            await self._refuse(scope, send)

    async def _refuse(self, scope: dict[str, Any], send: Callable[[Message], Awaitable[None]]) -> None:
        message = f"request body is larger than {self.max_bytes} bytes"
        body = ({"error": {"message": message, "type": "payload_too_large", "code": 413}}
                if scope["path"].startswith("/v1/") else {"error": message, "error_type": "payload_too_large"})
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})


class BodyTooLarge(Exception):
    pass
