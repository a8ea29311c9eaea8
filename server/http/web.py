"""The chat page at `/` (server/http/web/: plain HTML, CSS and JS shipped in the package, no build
step, nothing from elsewhere): it talks to this server's own /v1/models and /v1/chat/completions.
`serving_config.web_ui: false` (`--no-web-ui`) leaves it out. The page and its assets need no API
key (they hold none); the API calls they make do."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from server.http.frontend import ApiError

WEB = Path(__file__).parent / "web"
ASSETS = {"/": ("index.html", "text/html; charset=utf-8"), "/web/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
          "/web/chat.css": ("chat.css", "text/css; charset=utf-8"), "/web/icon.svg": ("icon.svg", "image/svg+xml")}
# Only this server's own scripts, styles and API: nothing injected into a reply can load or send elsewhere.
HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'", "X-Content-Type-Options": "nosniff",
           "Cache-Control": "no-cache"}

router = APIRouter(tags=["chat page"])
off = APIRouter()  # web_ui false: `/` is not found (TGI's POST / alone would make a GET a 405)


def _asset(path: str) -> Response:
    name, media = ASSETS[path]
    return Response((WEB / name).read_bytes(), media_type=media, headers=HEADERS)


@router.get("/", include_in_schema=False)
async def page() -> Response:
    return _asset("/")


@router.get("/web/chat.js", include_in_schema=False)
async def script() -> Response:
    return _asset("/web/chat.js")


@router.get("/web/chat.css", include_in_schema=False)
async def style() -> Response:
    return _asset("/web/chat.css")


@router.get("/web/icon.svg", include_in_schema=False)
async def icon() -> Response:
    return _asset("/web/icon.svg")


@off.get("/", include_in_schema=False)
async def no_page() -> Response:
    raise ApiError(404, "the chat page is off here (serving_config.web_ui: false, --no-web-ui)")
