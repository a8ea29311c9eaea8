"""HTTP front-end: one FastAPI app with a router per dialect (original llm-serving, TGI, OpenAI and
its Responses API, operations) over a shared Frontend. Handlers only parse, tokenize and await engine events; the
engine runs in its own thread."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.config import ServingConfig
from server.http import lora, openai, ops, original, responses, tgi, web
from server.http.api_keys import ApiKeys, LocalAdmin
from server.http.body_limit import BodyLimit
from server.http.errors import error_body
from server.engine.engine import Engine
from server.http.frontend import ApiError, Frontend
from server.http.responses_store import ResponseStore
from server.http.http10 import Http10Buffering
from server.sampling_params import InvalidRequest
from common.tokenizer import TextTokenizer


def build_app(engine: Engine, cfg: ServingConfig, tok: TextTokenizer, api_keys: list[str] | None = None,
              metrics_open: bool = True) -> FastAPI:
    """`api_keys`: when given, every route but /health (and /metrics if `metrics_open`) needs one."""
    app = FastAPI(title="llm-serving")
    app.add_middleware(Http10Buffering)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    if api_keys:  # outermost: nothing else runs for a request without a key
        app.add_middleware(ApiKeys, keys=api_keys, metrics_open=metrics_open)
    else:
        app.add_middleware(LocalAdmin)

    @app.exception_handler(ApiError)
    async def _api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, exc.message, exc.kind, exc.code), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: HttpRequest, exc: InvalidRequest) -> JSONResponse:
        return await _api_error(request, ApiError(400, str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's own errors (a body that is not JSON or not UTF-8, an unknown path) in our format."""
        return await _api_error(request, ApiError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(RequestValidationError)
    async def _schema(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        """A body that does not match its schema: 400 naming each field (FastAPI's default is 422)."""
        why = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
        return await _api_error(request, ApiError(400, f"invalid request: {why}"))

    app.state.frontend = Frontend(engine, cfg, tok)  # what the routers' `Depends(Frontend.of)` returns

    async def _lag_probe() -> None:  # runs for the app's life: its task ends with the loop
        app.state.lag_probe = asyncio.get_running_loop().create_task(ops.watch_loop_lag(app.state.frontend))

    app.router.on_startup.append(_lag_probe)
    app.state.responses = ResponseStore(cfg.responses_store_size, cfg.responses_ttl_s)
    for module in (original, tgi, openai, responses, ops, lora):
        app.include_router(module.router)
    app.include_router(web.router if cfg.web_ui else web.off)
    return app
