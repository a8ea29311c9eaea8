"""HTTP/1.0 clients: that protocol has no chunked encoding, and uvicorn chunks every body sent
without a length (a streamed reply). For a 1.0 request the body is collected and sent with its
Content-Length, so a stream arrives whole at its end instead of as bytes a 1.0 client cannot frame."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


class Http10Buffering:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]], send: Send) -> None:
        if scope["type"] != "http" or scope.get("http_version") != "1.0":
            await self.app(scope, receive, send)
            return
        start: Message = {}
        chunks: list[bytes] = []

        async def buffered(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    body = b"".join(chunks)
                    headers = [(k, v) for k, v in start.get("headers", [])
                               if k.lower() not in (b"content-length", b"transfer-encoding")]
                    await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
            else:
                await send(message)

        await self.app(scope, receive, buffered)
