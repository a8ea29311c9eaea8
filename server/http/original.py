"""The original llm-serving API: /models/{model}/generate, /generate_stream, /models/{model} and the
/serving/* status endpoints, with the original's reply bytes (server/http/original_format.py).

Its defaults differ from TGI's: top_k 3 when sampling, return_protocol "sse", return_full_text on
(its request model's default: a stream ends with a line carrying the whole generated text), details
off, max_new_tokens ORIGINAL_MAX_NEW_TOKENS (applied with the prompt's length known)."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from server.http import original_format as orig
from server.http.frontend import Frontend, primed
from server.http.schemas import GenerateRequest
from server.request import Delta
from server.sampling_params import InvalidRequest

router = APIRouter(tags=["original llm-serving"])
ORIGINAL_TOP_K = 3
ORIGINAL_MAX_NEW_TOKENS = 300


def _item(f: Frontend, d: Delta) -> dict[str, Any]:
    return orig.token_item(d.token_id, d.logprob, f.tok.is_special(d.token_id), d.text)


async def _generate(http: HttpRequest, f: Frontend, body: GenerateRequest, streaming: bool) -> Response:
    p = body.parameters
    if p.top_n_tokens:  # the original's replies have no place for them: said, not dropped
        raise InvalidRequest("parameters.top_n_tokens is not returned by the original API: use TGI's /generate")
    params = p.to_sampling_params(top_k=ORIGINAL_TOP_K)
    params.lora = f.check_model(p.adapter_name())
    ids = await f.prepare(body.inputs, params, ORIGINAL_MAX_NEW_TOKENS)
    if not streaming:
        r = await f.collect(http, ids, params)
        reply = orig.full_reply([_item(f, t) for t in r.tokens], r.text, r.finish_reason)
        return Response(orig.line(reply), media_type="application/json")
    sse_protocol = p.return_protocol == "sse"

    async def lines() -> AsyncIterator[str]:
        out = orig.StreamLines(sse_protocol, p.return_full_text is not False)
        async for d in f.stream(http, ids, params):
            if d.token_id is not None:
                yield out.token(_item(f, d))
            if d.finish_reason and (last := out.end(d.finish_reason, d.error)):
                yield last

    return StreamingResponse(await primed(lines()), media_type="text/event-stream" if sse_protocol else "text/plain")


@router.post("/models/{model}/generate")
async def generate(model: str, body: GenerateRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of)) -> Response:
    return await _generate(http, f, body, False)


@router.post("/models/{model}/generate_stream")
async def generate_stream(model: str, body: GenerateRequest, http: HttpRequest,
                          f: Frontend = Depends(Frontend.of)) -> Response:
    return await _generate(http, f, body, True)


@router.post("/models/{model}")
async def model_route(model: str, body: GenerateRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of)) -> Response:
    """`stream` in the body picks the mode."""
    return await _generate(http, f, body, body.stream)


@router.get("/serving/get_bs")
async def get_bs(f: Frontend = Depends(Frontend.of)) -> Response:
    return Response(orig.status_event(f.engine.stats()["running"]), media_type="text/event-stream")


@router.get("/serving/get_request_numbers")
async def get_request_numbers(f: Frontend = Depends(Frontend.of)) -> Response:
    return Response(orig.status_event(f.engine.stats()["waiting"]), media_type="text/event-stream")


@router.get("/serving/get_serverd_model_info")
async def get_model_info(f: Frontend = Depends(Frontend.of)) -> Response:
    """The original's fields and their derivation (seq_length[-1] x decode_batch_size[-1], ...);
    the device and dtype are the ones in effect."""
    info = {"docker_label": orig.docker_label(), "max_batch_total_tokens": f.cfg.prefill_buckets[-1] * f.cfg.max_running,
            "max_concurrent_requests": f.engine.stats()["waiting"], "max_input_length": f.cfg.prefill_buckets[-1],
            "max_total_tokens": f.cfg.max_running, "model_device_type": f.engine.agent_info().device,
            "model_dtype": f.engine.agent_info().model_dtype, "model_id": f.cfg.model_name,
            "model_pipeline_tag": "text-generation", "version": "2.3"}
    return Response(orig.sse_event(info), media_type="text/event-stream")
