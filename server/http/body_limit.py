"""Request bodies over `max_body_bytes` get 413 before anything parses them: by the declared
Content-Length, or while a chunked upload streams in."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from server.http.errors import send_error

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
        await send_error(send, scope["path"], 413, f"request body is larger than {self.max_bytes} bytes",
                         "payload_too_large")


class BodyTooLarge(Exception):
    pass
