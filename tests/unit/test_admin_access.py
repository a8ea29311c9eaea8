"""Without API keys, the routes that change the server (drains, adapter loads) answer clients on this
host only: the ASGI middleware called as uvicorn calls it, with the client address it would pass."""
from __future__ import annotations

import asyncio
import json

import pytest

from server.http.api_keys import LocalAdmin


def _call(path: str, host: str) -> tuple[int, dict]:
    sent: list[dict] = []
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "client": (host, 40000)}
    asyncio.run(LocalAdmin(app)(scope, receive, send))
    body = json.loads(sent[1]["body"]) if len(sent) > 1 else {}
    assert bool(reached) == (sent[0]["status"] == 200)
    return sent[0]["status"], body


@pytest.mark.parametrize("path", ["/admin/agents/7001/drain", "/admin/agents/7001/resume", "/v1/load_lora_adapter",
                                  "/v1/unload_lora_adapter"])
def test_admin_routes_answer_this_host_only_without_keys(path):
    for host in ("127.0.0.1", "127.0.0.2", "::1"):
        assert _call(path, host)[0] == 200
    status, body = _call(path, "192.0.2.7")  # a documentation address: nothing is sent anywhere
    assert status == 403 and "--api-key" in json.dumps(body)


def test_other_routes_answer_anyone_without_keys():
    assert _call("/v1/chat/completions", "192.0.2.7")[0] == 200


def test_without_the_chat_page_get_slash_is_not_found():
    """--no-web-ui: GET / is a 404 naming the switch (TGI's POST / alone answered it 405)."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from common.config import ServingConfig
    from server.http.app import build_app

    for web_ui, status in ((False, 404), (True, 200)):
        cfg = ServingConfig(web_ui=web_ui).validate()
        r = TestClient(build_app(SimpleNamespace(), cfg, SimpleNamespace())).get("/")
        assert r.status_code == status and (web_ui or "--no-web-ui" in r.json()["error"]), r.text
