"""TGI's API: /generate, /generate_stream, POST / (huggingface_hub's InferenceClient), /info, /tokenize."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.http.frontend import Frontend, primed, sse
from server.http.schemas import GenerateRequest, TokenizeRequest, as_dict
from server.http.params import tgi_params, to_bool
from server.sampling_params import InvalidRequest, SamplingParams


def router(f: Frontend) -> APIRouter:
    router = APIRouter(tags=["TGI"])

    tgi_reason = {"eos": "eos_token", "stop": "stop_sequence", "length": "length", "cancelled": "cancelled",
                  "error": "error"}

    def tgi_details(r_reason: str, n: int, params: SamplingParams, toks: list[dict]) -> dict[str, Any]:
        return {"finish_reason": tgi_reason.get(r_reason, r_reason), "generated_tokens": n, "seed": params.seed,
                "tokens": toks}

    @router.post("/generate")
    async def tgi_generate_route(body: GenerateRequest, http: HttpRequest) -> Response:
        return await tgi_generate(http, as_dict(body))

    async def tgi_generate(http: HttpRequest, b: dict[str, Any]) -> Response:
        params, opts = tgi_params(b.get("parameters"))
        ids = await f.prepare(b.get("inputs"), params)
        r = await f.collect(http, ids, params)
        out: dict[str, Any] = {"generated_text": (f.prompt_text(b["inputs"], ids) + r.text)
                               if opts["return_full_text"] else r.text}
        if opts["details"]:
            out["details"] = tgi_details(r.finish_reason, len(r.tokens), params, [f.token_json(t) for t in r.tokens])
        return JSONResponse(out)

    @router.post("/generate_stream")
    async def tgi_generate_stream_route(body: GenerateRequest, http: HttpRequest) -> Response:
        return await tgi_generate_stream(http, as_dict(body))

    async def tgi_generate_stream(http: HttpRequest, b: dict[str, Any]) -> Response:
        params, opts = tgi_params(b.get("parameters"))
        ids = await f.prepare(b.get("inputs"), params)

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
                yield sse({"token": f.token_json(d) if d.token_id is not None else {"id": None, "text": d.text,
                                                                                   "logprob": None, "special": True},
                           "generated_text": ((f.prompt_text(b["inputs"], ids) + full) if opts["return_full_text"]
                                              else full) if end else None,
                           "details": tgi_details(d.finish_reason, n, params, []) if end else None})

        return StreamingResponse(await primed(events()), media_type="text/event-stream")

    @router.post("/")
    async def tgi_root(body: GenerateRequest, http: HttpRequest) -> Response:
        """TGI's compat route (what huggingface_hub's InferenceClient posts to): `stream` in the body picks."""
        b = as_dict(body)
        return await (tgi_generate_stream if to_bool(b.get("stream", False), "stream") else tgi_generate)(http, b)

    @router.get("/info")
    async def info() -> dict[str, Any]:
        return {"model_id": f.cfg.model_name, "model_dtype": f.engine.agent_info("model_dtype", "float32"), "agents": f.engine.memory(),
                "max_input_tokens": f.cfg.max_model_len - 1,
                "max_total_tokens": f.cfg.max_model_len, "max_concurrent_requests": f.cfg.max_queue,
                "max_batch_total_tokens": f.cfg.token_budget, "router": "llm-serving", "version": "0.1.0",
                "kernels": f.engine.agent_info("kernels")}  # ours: the agents' projection paths

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        text = body.inputs
        try:
            enc = await asyncio.to_thread(lambda: f.tok.tok.encode_batch([text], add_special_tokens=False)[0])
        except Exception:
            raise InvalidRequest("inputs could not be tokenised (invalid Unicode?)") from None
        return [{"id": i, "text": text[s:e], "start": s, "stop": e} for i, (s, e) in zip(enc.ids, enc.offsets)]

    return router
