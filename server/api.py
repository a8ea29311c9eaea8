"""HTTP front-end: original llm-serving, TGI and OpenAI APIs, health and metrics.

Handlers only parse, tokenize and await engine events; the engine runs in its own thread.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.config import ServingConfig
from server.engine import Delta, Engine, QueueFull, Request, Sink
from server.http10 import Http10Buffering
from server import original_format as orig
from server.params import (ORIGINAL_MAX_NEW_TOKENS, chat_messages, openai_params, original_params, parse_json,
                           tgi_params, to_bool)
from server.sampling_params import InvalidRequest, SamplingParams
from server.prompts import encode_prompt
from server.tokenizer import TextTokenizer

DISCONNECT_POLL_S = 0.5


@dataclass
class Result:
    text: str
    tokens: list[Delta]
    finish_reason: str
    prompt_tokens: int


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers or {}


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

    # ------------------------------------------------------------ core
    async def prepare(text: Any, params: SamplingParams, default_new: int | None = None) -> list[int]:
        """Tokenise off the event loop: other clients and /health answer while a huge prompt is read."""
        return await asyncio.to_thread(encode_prompt, tok, cfg, text, params, default_new)

    def prompt_text(prompt: Any, ids: list[int]) -> str:
        """The prompt as text, for return_full_text (token-id prompts are decoded)."""
        return prompt if isinstance(prompt, str) else tok.decode(ids)

    async def stream(http: HttpRequest, ids: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | None] = asyncio.Queue()  # None: the client disconnected
        rid = uuid.uuid4().hex
        req = Request(rid, ids, params, sink=Sink(loop, queue))
        try:
            engine.submit(req)
        except QueueFull as exc:
            raise ApiError(503, f"server overloaded: {exc}", "overloaded",
                           {"Retry-After": str(engine.retry_after_s())}) from None
        finished = False

        async def watch_disconnect() -> None:  # one watcher per request, not a timeout per token
            while not await http.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            queue.put_nowait(None)

        watcher = asyncio.create_task(watch_disconnect())
        try:
            while True:
                d = await queue.get()
                if d is None:  # the client went away
                    return
                if d.finish_reason:
                    finished = True
                yield d
                if finished:
                    return
        finally:
            watcher.cancel()
            if not finished:  # client went away or the generator was closed: free its blocks
                engine.abort(rid)

    async def collect(http: HttpRequest, ids: list[int], params: SamplingParams) -> Result:
        tokens, text, reason = [], "", "cancelled"
        async for d in stream(http, ids, params):
            if d.token_id is not None:
                tokens.append(d)
            text += d.text
            if d.finish_reason:
                reason = d.finish_reason
                if d.error:
                    raise ApiError(500, d.error, "server_error")
        return Result(text, tokens, reason, len(ids))

    async def body_of(http: HttpRequest) -> dict[str, Any]:
        too_big = ApiError(413, f"request body is larger than {cfg.max_body_bytes} bytes", "payload_too_large")
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cfg.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise too_big
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    def token_json(d: Delta) -> dict[str, Any]:
        return {"id": d.token_id, "logprob": d.logprob, "special": tok.is_special(d.token_id or -1), "text": d.text}

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    # ------------------------------------------------------------ original llm-serving API
    def original_item(d: Delta) -> dict[str, Any]:
        return orig.token_item(d.token_id, d.logprob, tok.is_special(d.token_id), d.text)

    async def original(http: HttpRequest, model: str, force_stream: bool | None) -> Response:
        b = await body_of(http)
        params, opts = original_params(b.get("parameters"))
        streaming = force_stream if force_stream is not None else to_bool(b.get("stream", False), "stream")
        ids = await prepare(b.get("inputs"), params, ORIGINAL_MAX_NEW_TOKENS)
        if not streaming:
            r = await collect(http, ids, params)
            reply = orig.full_reply([original_item(t) for t in r.tokens], r.text, r.finish_reason)
            return Response(orig.line(reply), media_type="application/json")
        sse_protocol = opts["return_protocol"] == "sse"

        async def lines() -> AsyncIterator[str]:
            items, full = [], ""
            async for d in stream(http, ids, params):
                if d.error:
                    yield orig.line({"event": "error", "data": [{"error": d.error}]})
                    return
                if d.token_id is not None:
                    items.append(original_item(d))
                    full += d.text
                    item = orig.stream_item(items[-1])
                    yield orig.line(orig.event(item)) if sse_protocol else orig.plain_line(item)
                if d.finish_reason and opts["return_full_text"]:
                    if sse_protocol:
                        yield orig.line(orig.event(orig.final_item(items, full, d.finish_reason)))
                    else:
                        yield orig.plain_line(orig.full_reply(items, full, d.finish_reason))

        return StreamingResponse(await _primed(lines()),
                                 media_type="text/event-stream" if sse_protocol else "text/plain")

    @app.post("/models/{model}/generate")
    async def orig_generate(model: str, http: HttpRequest) -> Response:
        return await original(http, model, False)

    @app.post("/models/{model}/generate_stream")
    async def orig_generate_stream(model: str, http: HttpRequest) -> Response:
        return await original(http, model, True)

    @app.post("/models/{model}")
    async def orig_model(model: str, http: HttpRequest) -> Response:
        return await original(http, model, None)

    # ------------------------------------------------------------ TGI
    tgi_reason = {"stop": "eos_token", "length": "length", "cancelled": "cancelled", "error": "error"}

    def tgi_details(r_reason: str, n: int, params: SamplingParams, toks: list[dict]) -> dict[str, Any]:
        return {"finish_reason": tgi_reason.get(r_reason, r_reason), "generated_tokens": n, "seed": params.seed,
                "tokens": toks}

    @app.post("/generate")
    async def tgi_generate_route(http: HttpRequest) -> Response:
        return await tgi_generate(http, await body_of(http))

    async def tgi_generate(http: HttpRequest, b: dict[str, Any]) -> Response:
        params, opts = tgi_params(b.get("parameters"))
        ids = await prepare(b.get("inputs"), params)
        r = await collect(http, ids, params)
        out: dict[str, Any] = {"generated_text": (prompt_text(b["inputs"], ids) + r.text)
                               if opts["return_full_text"] else r.text}
        if opts["details"]:
            out["details"] = tgi_details(r.finish_reason, len(r.tokens), params, [token_json(t) for t in r.tokens])
        return JSONResponse(out)

    @app.post("/generate_stream")
    async def tgi_generate_stream_route(http: HttpRequest) -> Response:
        return await tgi_generate_stream(http, await body_of(http))

    async def tgi_generate_stream(http: HttpRequest, b: dict[str, Any]) -> Response:
        params, opts = tgi_params(b.get("parameters"))
        ids = await prepare(b.get("inputs"), params)

        async def events() -> AsyncIterator[str]:
            full, n = "", 0
            async for d in stream(http, ids, params):
                if d.error:
                    yield sse({"error": d.error, "error_type": "generation"})
                    return
                full += d.text
                n += d.token_id is not None
                if d.token_id is None and not d.finish_reason:
                    continue
                end = d.finish_reason is not None
                yield sse({"token": token_json(d) if d.token_id is not None else {"id": None, "text": d.text,
                                                                                   "logprob": None, "special": True},
                           "generated_text": ((prompt_text(b["inputs"], ids) + full) if opts["return_full_text"]
                                              else full) if end else None,
                           "details": tgi_details(d.finish_reason, n, params, []) if end else None})

        return StreamingResponse(await _primed(events()), media_type="text/event-stream")

    @app.post("/")
    async def tgi_root(http: HttpRequest) -> Response:
        """TGI's compat route (what huggingface_hub's InferenceClient posts to): `stream` in the body picks."""
        b = await body_of(http)
        return await (tgi_generate_stream if to_bool(b.get("stream", False), "stream") else tgi_generate)(http, b)

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return {"model_id": cfg.model_name, "model_dtype": "float32", "max_input_tokens": cfg.max_model_len - 1,
                "max_total_tokens": cfg.max_model_len, "max_concurrent_requests": cfg.max_queue,
                "max_batch_total_tokens": cfg.token_budget, "router": "llm-serving", "version": "0.1.0"}

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest) -> Any:
        b = await body_of(http)
        text = b.get("inputs")
        if not isinstance(text, str):
            raise InvalidRequest("inputs must be a string")
        try:
            enc = await asyncio.to_thread(lambda: tok.tok.encode_batch([text], add_special_tokens=False)[0])
        except Exception:
            raise InvalidRequest("inputs could not be tokenised (invalid Unicode?)") from None
        return [{"id": i, "text": text[s:e], "start": s, "stop": e} for i, (s, e) in zip(enc.ids, enc.offsets)]

    # ------------------------------------------------------------ OpenAI
    def openai_logprobs(tokens: list[Delta], chat: bool) -> dict[str, Any]:
        if chat:
            return {"content": [{"token": tok.id_to_token(t.token_id), "logprob": t.logprob,
                                 "bytes": list(t.text.encode()),
                                 "top_logprobs": [{"token": tok.id_to_token(i), "logprob": lp,
                                                   "bytes": list(tok.decode([i]).encode())} for i, lp in t.top_logprobs]}
                                for t in tokens]}
        offs, pos = [], 0
        for t in tokens:
            offs.append(pos)
            pos += len(t.text)
        return {"tokens": [tok.id_to_token(t.token_id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{tok.id_to_token(i): lp for i, lp in t.top_logprobs} for t in tokens],
                "text_offset": offs}

    def usage(prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def oa_reason(reason: str) -> str:
        return reason if reason in ("stop", "length") else "abort"

    async def openai(http: HttpRequest, chat: bool) -> Response:
        b = await body_of(http)
        params = openai_params(b, chat)
        if chat:
            msgs = chat_messages(b.get("messages"))
            try:
                prompt: Any = await asyncio.to_thread(tok.apply_chat_template, msgs, True)
            except Exception as exc:  # a template may raise on unexpected roles or order
                raise InvalidRequest(f"the chat template rejected the messages: {exc}") from None
        else:
            prompt = b.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
        ids = await prepare(prompt, params)
        want_lp = params.logprobs > 0 or (chat and to_bool(b.get("logprobs", False), "logprobs"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created, model = int(time.time()), b.get("model") or cfg.model_name
        obj = "chat.completion" if chat else "text_completion"
        if not to_bool(b.get("stream", False), "stream"):
            r = await collect(http, ids, params)
            choice: dict[str, Any] = {"index": 0, "finish_reason": oa_reason(r.finish_reason),
                                      "logprobs": openai_logprobs(r.tokens, chat) if want_lp else None}
            if chat:
                choice["message"] = {"role": "assistant", "content": r.text}
            else:
                choice["text"] = r.text
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                                 "choices": [choice], "usage": usage(len(ids), len(r.tokens))})
        options = b.get("stream_options") or {}
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object")
        include_usage = to_bool(options.get("include_usage", False), "stream_options.include_usage")

        async def chunks() -> AsyncIterator[str]:
            n = 0
            base = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created, "model": model}
            if chat:
                yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": None}]})
            async for d in stream(http, ids, params):
                if d.error:
                    yield sse({"error": {"message": d.error, "type": "server_error", "code": 500}})
                    break
                n += d.token_id is not None
                toks = [d] if d.token_id is not None else []
                if not d.text and not d.finish_reason and not (want_lp and toks):
                    continue
                lp = openai_logprobs(toks, chat) if want_lp and toks else None
                body = {"index": 0, "finish_reason": oa_reason(d.finish_reason) if d.finish_reason else None,
                        "logprobs": lp}
                if chat:
                    body["delta"] = {"content": d.text} if d.text else {}
                else:
                    body["text"] = d.text
                yield sse({**base, "choices": [body]})
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(len(ids), n)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(await _primed(chunks()), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await openai(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Response:
        return await openai(http, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "llm-serving", "max_model_len": cfg.max_model_len}]}

    # ------------------------------------------------------------ operations
    @app.get("/health")
    async def health() -> JSONResponse:
        status, why = engine.health()
        return JSONResponse({"status": status, "reason": why}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """Live counters for operators and benchmarks (the original's /serving/* keep their shapes)."""
        return {"model_name": cfg.model_name, "max_model_len": cfg.max_model_len, "block_size": cfg.block_size,
                "num_blocks": cfg.num_blocks, "agents": len(cfg.agent_ports), **engine.stats()}

    @app.get("/debug/trace")
    async def trace() -> dict[str, Any]:
        return engine.chrome_trace()

    @app.get("/serving/get_bs")
    async def get_bs() -> Response:
        return Response(orig.status_event(engine.stats()["running"]), media_type="text/event-stream")

    @app.get("/serving/get_request_numbers")
    async def get_request_numbers() -> Response:
        return Response(orig.status_event(engine.stats()["waiting"]), media_type="text/event-stream")

    @app.get("/serving/get_serverd_model_info")
    async def get_model_info() -> Response:
        """The original's fields and their derivation (seq_length[-1] x decode_batch_size[-1], ...);
        the device and dtype are the ones in effect."""
        info = {"docker_label": orig.docker_label(), "max_batch_total_tokens": cfg.prefill_buckets[-1] * cfg.max_running,
                "max_concurrent_requests": engine.stats()["waiting"], "max_input_length": cfg.prefill_buckets[-1],
                "max_total_tokens": cfg.max_running, "model_device_type": engine.device_type(),
                "model_dtype": "float32", "model_id": cfg.model_name, "model_pipeline_tag": "text-generation",
                "version": "2.3"}
        return Response(orig.sse_event(info), media_type="text/event-stream")

    return app


async def _primed(gen: AsyncIterator[str]) -> AsyncIterator[str]:
    """Run a stream until its first item before the 200 is sent, so errors raised on submission
    (queue full) still become proper 4xx/5xx responses instead of a broken stream."""
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        first = ""

    async def rest() -> AsyncIterator[str]:
        if first:
            yield first
        async for item in gen:
            yield item

    return rest()
