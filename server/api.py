"""HTTP front-end: one FastAPI app with a router per dialect (original llm-serving, TGI, OpenAI,
operations) over a shared Frontend. Handlers only parse, tokenize and await engine events; the
engine runs in its own thread."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse

from common.config import ServingConfig
from server import routes_openai, routes_ops, routes_original, routes_tgi
from server.engine import Engine
from server.frontend import ApiError, Frontend
from server.http10 import Http10Buffering
from server.sampling_params import InvalidRequest
from server.tokenizer import TextTokenizer


def build_app(engine: Engine, cfg: ServingConfig, tok: TextTokenizer) -> FastAPI:
    app = FastAPI(title="llm-serving")
    app.add_middleware(Http10Buffering)

    @app.exception_handler(ApiError)
    async def _api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        if request.url.path.startswith("/v1/"):
            body: dict[str, Any] = {"error": {"message": exc.message, "type": exc.kind, "code": exc.status}}
        else:
            body = {"error": exc.message, "error_type": exc.kind}
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: HttpRequest, exc: InvalidRequest) -> JSONResponse:
        return await _api_error(request, ApiError(400, str(exc)))

    front = Frontend(engine, cfg, tok)
    for module in (routes_original, routes_tgi, routes_openai, routes_ops):
        app.include_router(module.router(front))
    return app
