"""OpenAI's API: /v1/completions, /v1/chat/completions (stream, usage, logprobs), /v1/models."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.http.frontend import Frontend, primed, sse
from server.http.schemas import ChatRequest, CompletionRequest
from server.http.structured import parse_tool_calls
from server.request import Delta
from server.sampling_params import InvalidRequest, SamplingParams

router = APIRouter(tags=["OpenAI"])


def _logprobs(f: Frontend, tokens: list[Delta], chat: bool) -> dict[str, Any]:
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
            "top_logprobs": [{f.tok.decode([i], skip_special=False): lp for i, lp in t.top_logprobs} for t in tokens],
            "text_offset": offs}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _reason(reason: str) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, "abort")


async def _prompt(f: Frontend, body: CompletionRequest | ChatRequest) -> Any:
    if isinstance(body, CompletionRequest):
        prompt = body.prompt
        return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) else prompt
    native = f.tok.template_has_tools
    tools = [t.model_dump(exclude_none=True) for t in body.callable_tools] if native else None
    try:
        return await asyncio.to_thread(f.tok.apply_chat_template, body.chat(native), True, tools or None)
    except Exception as exc:  # a template may raise on unexpected roles or order
        raise InvalidRequest(f"the chat template rejected the messages: {exc}") from None


def _message(body: CompletionRequest | ChatRequest, text: str, reason: str) -> tuple[dict[str, Any], str]:
    """The reply's message and finish reason: tool calls where the text is a call of the request's tools."""
    calls = parse_tool_calls(text, body.callable_tools) if isinstance(body, ChatRequest) and body.callable_tools else None
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, _reason(reason)


async def _complete(http: HttpRequest, f: Frontend, body: CompletionRequest | ChatRequest) -> Response:
    f.check_model(body.model)
    chat = isinstance(body, ChatRequest)
    params = body.to_sampling_params()
    prompt = await _prompt(f, body)
    ids = await f.prepare(prompt, params)
    echo = f.prompt_text(prompt, ids) if body.echo else ""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    obj = "chat.completion" if chat else "text_completion"
    base = {"id": rid, "object": obj, "created": int(time.time()), "model": body.model or f.cfg.model_name}
    if body.stream:
        head = {**base, "object": obj + ".chunk" if chat else obj}
        return StreamingResponse(await primed(_chunks(http, f, body, ids, params, head, echo)),
                                 media_type="text/event-stream")
    r = await f.collect(http, ids, params)
    choice: dict[str, Any] = {"index": 0, "finish_reason": _reason(r.finish_reason),
                              "logprobs": _logprobs(f, r.tokens, chat) if params.logprobs else None}
    if chat:
        choice["message"], choice["finish_reason"] = _message(body, r.text, r.finish_reason)
    else:
        choice["text"] = echo + r.text
    return JSONResponse({**base, "choices": [choice], "usage": _usage(len(ids), len(r.tokens))})


async def _chunks(http: HttpRequest, f: Frontend, body: CompletionRequest | ChatRequest, ids: list[int],
                  params: SamplingParams, head: dict[str, Any], echo: str) -> AsyncIterator[str]:
    """The stream. With tools to call, a chat reply's text is held to its end: then it goes as one
    `tool_calls` delta (index, id, name, the whole arguments), or as content if it is no call."""
    chat, want_lp = isinstance(body, ChatRequest), params.logprobs > 0
    hold = chat and bool(body.callable_tools)
    held, n = [], 0
    if chat:
        yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None, "logprobs": None}]})
    elif echo:
        yield sse({**head, "choices": [{"index": 0, "text": echo, "finish_reason": None, "logprobs": None}]})
    async for d in f.stream(http, ids, params):
        if d.error:
            yield sse({"error": {"message": d.error, "type": "server_error", "code": 500}})
            break
        n += d.token_id is not None
        toks = [d] if d.token_id is not None else []
        if hold:
            held.append(d.text)
            if not d.finish_reason:
                continue
            msg, reason = _message(body, "".join(held), d.finish_reason)
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]} \
                if msg.get("tool_calls") else {"content": msg["content"]}
            yield sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]})
            continue
        if not d.text and not d.finish_reason and not (want_lp and toks):
            continue
        choice = {"index": 0, "finish_reason": _reason(d.finish_reason) if d.finish_reason else None,
                  "logprobs": _logprobs(f, toks, chat) if want_lp and toks else None}
        if chat:
            choice["delta"] = {"content": d.text} if d.text else {}
        else:
            choice["text"] = d.text
        yield sse({**head, "choices": [choice]})
    if body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": _usage(len(ids), n)})
    yield "data: [DONE]\n\n"


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of)) -> Response:
    return await _complete(http, f, body)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of)) -> Response:
    return await _complete(http, f, body)


@router.get("/v1/models")
async def models(f: Frontend = Depends(Frontend.of)) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llm-serving",
                                        "max_model_len": f.cfg.max_model_len} for name in f.served_names]}
