"""TGI's API: /generate, /generate_stream, POST / (huggingface_hub's InferenceClient), /info, /tokenize."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.http.frontend import Frontend, primed, sse
from server.http.schemas import GenerateRequest, TokenizeRequest
from server.sampling_params import InvalidRequest, SamplingParams

router = APIRouter(tags=["TGI"])
REASONS = {"eos": "eos_token", "stop": "stop_sequence", "length": "length", "cancelled": "cancelled", "error": "error"}


def _details(reason: str, n: int, params: SamplingParams, toks: list[dict]) -> dict[str, Any]:
    return {"finish_reason": REASONS.get(reason, reason), "generated_tokens": n, "seed": params.seed, "tokens": toks}


def _top_tokens(f: Frontend, d: Any) -> list[dict[str, Any]]:
    """A token's `top_n_tokens` alternatives, as TGI lists them."""
    return [{"id": i, "text": f.tok.decode([i], skip_special=False), "logprob": lp, "special": f.tok.is_special(i)}
            for i, lp in d.top_logprobs]


def _full_text(body: GenerateRequest) -> bool:
    return bool(body.parameters.return_full_text)  # TGI's default: off


@router.post("/generate")
async def generate(body: GenerateRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of)) -> Response:
    params = body.parameters.to_sampling_params(prompt_details=True)
    params.lora = f.check_model(body.parameters.adapter_name())
    ids = await f.prepare(body.inputs, params)
    r = await f.collect(http, ids, params)
    out: dict[str, Any] = {"generated_text": (f.prompt_text(body.inputs, ids) + r.text) if _full_text(body) else r.text}
    if body.parameters.details is not False:  # TGI's default: on
        out["details"] = _details(r.finish_reason, len(r.tokens), params, [f.token_json(t) for t in r.tokens])
        if body.parameters.top_n_tokens:
            out["details"]["top_tokens"] = [_top_tokens(f, t) for t in r.tokens]
        if r.prompt_logprobs is not None:  # decoder_input_details
            out["details"]["prefill"] = [{"id": i, "text": f.tok.decode([i], skip_special=False), "logprob": lp}
                                         for i, lp, _ in r.prompt_logprobs]
    return JSONResponse(out)


@router.post("/generate_stream")
async def generate_stream(body: GenerateRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of)) -> Response:
    params = body.parameters.to_sampling_params()
    params.lora = f.check_model(body.parameters.adapter_name())
    ids = await f.prepare(body.inputs, params)

    async def events() -> AsyncIterator[str]:
        full, n = "", 0
        async for d in f.stream(http, ids, params):
            if d.error:
                yield sse({"error": d.error, "error_type": "generation"})
                return
            full += d.text
            n += d.token_id is not None
            if d.token_id is None and not d.finish_reason:
                continue
            end = d.finish_reason is not None
            event = {"token": f.token_json(d) if d.token_id is not None else {"id": None, "text": d.text,
                                                                              "logprob": None, "special": True},
                     "generated_text": ((f.prompt_text(body.inputs, ids) + full) if _full_text(body)
                                        else full) if end else None,
                     "details": _details(d.finish_reason, n, params, []) if end else None}
            if body.parameters.top_n_tokens:
                event["top_tokens"] = _top_tokens(f, d)
            yield sse(event)

    return StreamingResponse(await primed(events()), media_type="text/event-stream")


@router.post("/")
async def root(body: GenerateRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of)) -> Response:
    """TGI's compat route (what huggingface_hub's InferenceClient posts to): `stream` in the body picks."""
    return await (generate_stream if body.stream else generate)(body, http, f)


@router.get("/info")
async def info(f: Frontend = Depends(Frontend.of)) -> dict[str, Any]:
    return {"model_id": f.cfg.model_name, "model_dtype": f.engine.agent_info().model_dtype,
            "agents": f.engine.memory(), "max_input_tokens": f.cfg.max_model_len - 1,
            "max_total_tokens": f.cfg.max_model_len, "max_concurrent_requests": f.cfg.max_queue,
            "max_batch_total_tokens": f.cfg.token_budget, "router": "llm-serving", "version": "0.1.0",
            "kernels": f.engine.agent_info().kernels,  # ours: the agents' projection paths
            "deterministic": "deterministic:" in f.engine.agent_info().kernels}  # ours: batch-invariant kernels


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, f: Frontend = Depends(Frontend.of)) -> Any:
    text = body.inputs
    try:
        spans = await asyncio.to_thread(f.tok.spans, text)
    except Exception:
        raise InvalidRequest("inputs could not be tokenised (invalid Unicode?)") from None
    return [{"id": i, "text": text[s:e], "start": s, "stop": e} for i, s, e in spans]
