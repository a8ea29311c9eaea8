"""The original llm-serving API: /models/{model}/generate, /generate_stream, /models/{model} and the
/serving/* status endpoints, with the original's reply bytes (server/original_format.py)."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from server.http import original_format as orig
from server.request import Delta
from server.http.frontend import Frontend, primed
from server.http.schemas import GenerateRequest, as_dict
from server.http.params import ORIGINAL_MAX_NEW_TOKENS, original_params, to_bool


def router(f: Frontend) -> APIRouter:
    router = APIRouter(tags=["original llm-serving"])

    def original_item(d: Delta) -> dict[str, Any]:
        return orig.token_item(d.token_id, d.logprob, f.tok.is_special(d.token_id), d.text)

    async def original(http: HttpRequest, b: dict[str, Any], force_stream: bool | None) -> Response:
        params, opts = original_params(b.get("parameters"))
        streaming = force_stream if force_stream is not None else to_bool(b.get("stream", False), "stream")
        ids = await f.prepare(b.get("inputs"), params, ORIGINAL_MAX_NEW_TOKENS)
        if not streaming:
            r = await f.collect(http, ids, params)
            reply = orig.full_reply([original_item(t) for t in r.tokens], r.text, r.finish_reason)
            return Response(orig.line(reply), media_type="application/json")
        sse_protocol = opts["return_protocol"] == "sse"

        async def lines() -> AsyncIterator[str]:
            out = orig.StreamLines(sse_protocol, opts["return_full_text"])
            async for d in f.stream(http, ids, params):
                if d.token_id is not None:
                    yield out.token(original_item(d))
                if d.finish_reason and (last := out.end(d.finish_reason, d.error)):
                    yield last

        return StreamingResponse(await primed(lines()),
                                 media_type="text/event-stream" if sse_protocol else "text/plain")

    @router.post("/models/{model}/generate")
    async def orig_generate(model: str, body: GenerateRequest, http: HttpRequest) -> Response:
        return await original(http, as_dict(body), False)

    @router.post("/models/{model}/generate_stream")
    async def orig_generate_stream(model: str, body: GenerateRequest, http: HttpRequest) -> Response:
        return await original(http, as_dict(body), True)

    @router.post("/models/{model}")
    async def orig_model(model: str, body: GenerateRequest, http: HttpRequest) -> Response:
        """`stream` in the body picks the mode."""
        return await original(http, as_dict(body), None)

    @router.get("/serving/get_bs")
    async def get_bs() -> Response:
        return Response(orig.status_event(f.engine.stats()["running"]), media_type="text/event-stream")

    @router.get("/serving/get_request_numbers")
    async def get_request_numbers() -> Response:
        return Response(orig.status_event(f.engine.stats()["waiting"]), media_type="text/event-stream")

    @router.get("/serving/get_serverd_model_info")
    async def get_model_info() -> Response:
        """The original's fields and their derivation (seq_length[-1] x decode_batch_size[-1], ...);
        the device and dtype are the ones in effect."""
        info = {"docker_label": orig.docker_label(), "max_batch_total_tokens": f.cfg.prefill_buckets[-1] * f.cfg.max_running,
                "max_concurrent_requests": f.engine.stats()["waiting"], "max_input_length": f.cfg.prefill_buckets[-1],
                "max_total_tokens": f.cfg.max_running, "model_device_type": f.engine.agent_info("device", "CPU"),
                "model_dtype": f.engine.agent_info("model_dtype", "float32"), "model_id": f.cfg.model_name, "model_pipeline_tag": "text-generation",
                "version": "2.3"}
        return Response(orig.sse_event(info), media_type="text/event-stream")

    return router
