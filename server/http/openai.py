"""OpenAI's API: /v1/completions, /v1/chat/completions (stream, usage, logprobs), /v1/models."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.request import Delta
from server.http.frontend import Frontend, primed, sse
from server.http.schemas import ChatRequest, CompletionRequest, as_dict
from server.http.params import chat_messages, openai_params, to_bool
from server.sampling_params import InvalidRequest


def router(f: Frontend) -> APIRouter:
    router = APIRouter(tags=["OpenAI"])

    def openai_logprobs(tokens: list[Delta], chat: bool) -> dict[str, Any]:
        if chat:
            return {"content": [{"token": f.tok.id_to_token(t.token_id), "logprob": t.logprob,
                                 "bytes": list(t.text.encode()),
                                 "top_logprobs": [{"token": f.tok.id_to_token(i), "logprob": lp,
                                                   "bytes": list(f.tok.decode([i]).encode())} for i, lp in t.top_logprobs]}
                                for t in tokens]}
        offs, pos = [], 0
        for t in tokens:
            offs.append(pos)
            pos += len(t.text)
        # Legacy completions name tokens by their text (vLLM's convention), not byte-level pieces ("Ġthe").
        return {"tokens": [f.tok.decode([t.token_id], skip_special=False) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{f.tok.decode([i], skip_special=False): lp for i, lp in t.top_logprobs}
                                 for t in tokens],
                "text_offset": offs}

    def unsupported(b: dict[str, Any], chat: bool, logprobs: bool) -> None:
        """OpenAI fields this server cannot honour get a 400, never silence."""
        if b.get("logit_bias"):  # {} and null change nothing
            raise InvalidRequest("logit_bias is not supported")
        if to_bool(b.get("echo", False), "echo") and (chat or logprobs):
            raise InvalidRequest("echo is supported only by /v1/completions without logprobs "
                                 "(prompt logprobs are not computed)")

    def usage(prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def oa_reason(reason: str) -> str:
        return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, "abort")

    async def openai(http: HttpRequest, b: dict[str, Any], chat: bool) -> Response:
        params = openai_params(b, chat)
        unsupported(b, chat, params.logprobs > 0)
        if chat:
            msgs = chat_messages(b.get("messages"))
            try:
                prompt: Any = await asyncio.to_thread(f.tok.apply_chat_template, msgs, True)
            except Exception as exc:  # a template may raise on unexpected roles or order
                raise InvalidRequest(f"the chat template rejected the messages: {exc}") from None
        else:
            prompt = b.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
        ids = await f.prepare(prompt, params)
        echo = "" if chat or not to_bool(b.get("echo", False), "echo") else f.prompt_text(prompt, ids)
        want_lp = params.logprobs > 0 or (chat and to_bool(b.get("logprobs", False), "logprobs"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created, model = int(time.time()), b.get("model") or f.cfg.model_name
        obj = "chat.completion" if chat else "text_completion"
        if not to_bool(b.get("stream", False), "stream"):
            r = await f.collect(http, ids, params)
            choice: dict[str, Any] = {"index": 0, "finish_reason": oa_reason(r.finish_reason),
                                      "logprobs": openai_logprobs(r.tokens, chat) if want_lp else None}
            if chat:
                choice["message"] = {"role": "assistant", "content": r.text}
            else:
                choice["text"] = echo + r.text
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
            elif echo:
                yield sse({**base, "choices": [{"index": 0, "text": echo, "finish_reason": None, "logprobs": None}]})
            async for d in f.stream(http, ids, params):
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

        return StreamingResponse(await primed(chunks()), media_type="text/event-stream")

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        return await openai(http, as_dict(body), chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HttpRequest) -> Response:
        return await openai(http, as_dict(body), chat=True)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": f.cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "llm-serving", "max_model_len": f.cfg.max_model_len}]}

    return router
