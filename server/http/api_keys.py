"""HTTP API keys: with keys configured (`llm-serving --api-key`, or `LLM_SERVING_API_KEY`, several
separated by commas), every request needs `Authorization: Bearer <key>` (what OpenAI clients send),
else 401 JSON in its dialect's error shape. `/health` stays open for probes, `/metrics` too
unless `--metrics-auth`, and the chat page's files (GET: they hold no key; the page asks for one). Keys are compared in constant time and never logged.
Without keys, the routes that change the server (draining agents, loading adapters: ADMIN_PATHS) answer
clients on this host only (loopback), 403 to others: an open port is not an open admin."""
from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable

from server.http.errors import send_error
from server.http.web import ASSETS

Message = dict[str, Any]
OPEN_PATHS = ("/health",)
ADMIN_PATHS = ("/admin/", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # prefixes


def parse_keys(values: list[str] | None, env: str | None) -> list[str]:
    """Keys from the flags (each may hold several, comma-separated) and the environment."""
    raw = [*(values or []), *([env] if env else [])]
    return [k.strip() for v in raw for k in v.split(",") if k.strip()]


class ApiKeys:
    def __init__(self, app: Any, keys: list[str], metrics_open: bool = True):
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open = OPEN_PATHS + (("/metrics",) if metrics_open else ())

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        ok = False
        for key in self.keys:  # every key compared, in constant time: no timing tells which one nearly matched
            ok |= hmac.compare_digest(token.strip(), key)
        return scheme.lower() == b"bearer" and ok

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        page = scope.get("method") == "GET" and scope["path"] in ASSETS  # the chat page holds no key; its calls need one
        if scope["type"] != "http" or scope["path"] in self.open or page or self.allowed(scope.get("headers", [])):
            await self.app(scope, receive, send)
            return
        await send_error(send, scope["path"], 401, "missing or wrong API key: send Authorization: Bearer <key>",
                         "authentication_error", ((b"www-authenticate", b"Bearer"),))


def loopback(host: str | None) -> bool:
    return host is not None and (host.startswith("127.") or host in ("::1", "localhost"))


class LocalAdmin:
    """Without API keys: ADMIN_PATHS from another host get 403 naming --api-key."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        client = scope.get("client") or (None, 0)
        if scope["type"] == "http" and scope["path"].startswith(ADMIN_PATHS) and not loopback(client[0]):
            await send_error(send, scope["path"], 403, "admin routes answer clients on this host only while the server "
                             "has no API keys: start it with --api-key to reach them from elsewhere", "permission_error")
            return
        await self.app(scope, receive, send)
