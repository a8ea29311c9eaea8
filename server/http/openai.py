"""OpenAI's API: /v1/completions, /v1/chat/completions (stream, usage, logprobs), /v1/models."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.http.frontend import Frontend, primed, sse
from server.http.schemas import ChatRequest, CompletionRequest
from server.http.structured import CallStream
from server.request import Delta, PromptToken
from server.sampling_params import InvalidRequest, SamplingParams

router = APIRouter(tags=["OpenAI"])


def _logprobs(f: Frontend, tokens: list[Delta], chat: bool, prompt: list[PromptToken] | None = None) -> dict[str, Any]:
    if chat:
        return {"content": [{"token": f.tok.id_to_token(t.token_id), "logprob": t.logprob,
                             "bytes": list(t.text.encode()),
                             "top_logprobs": [{"token": f.tok.id_to_token(i), "logprob": lp,
                                               "bytes": list(f.tok.decode([i]).encode())} for i, lp in t.top_logprobs]}
                            for t in tokens]}
    # Legacy completions name tokens by their text (vLLM's convention), not byte-level pieces ("Ġthe");
    # with echo the prompt's tokens come first, the first of them without a logprob.
    piece = functools.partial(_piece, f)
    rows = [(piece(i), lp, None if lp is None else {piece(k): v for k, v in top}) for i, lp, top in prompt or []]
    rows += [(piece(t.token_id), t.logprob, {piece(k): v for k, v in t.top_logprobs}) for t in tokens]
    texts = [r[0] for r in rows[:len(prompt or [])]] + [t.text for t in tokens]
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [r[2] for r in rows], "text_offset": list(itertools.accumulate(map(len, texts[:-1]), initial=0))
            if texts else []}


def _piece(f: Frontend, token: int) -> str:
    return f.tok.decode([token], skip_special=False)


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage; `cached`: the prompt tokens the prefix cache served (the first choice's)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _reason(reason: str) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, "abort")


async def request_prompt(f: Frontend, body: CompletionRequest | ChatRequest) -> Any:
    if isinstance(body, CompletionRequest):
        prompt = body.prompt
        return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) else prompt
    native = f.tok.template_has_tools
    tools = [t.model_dump(exclude_none=True) for t in body.callable_tools] if native else None
    try:
        return await asyncio.to_thread(f.tok.apply_chat_template, body.chat(native), True, tools or None)
    except Exception as exc:  # a template may raise on unexpected roles or order
        raise InvalidRequest(f"the chat template rejected the messages: {exc}") from None


def reply_message(body: CompletionRequest | ChatRequest, text: str, reason: str) -> tuple[dict[str, Any], str]:
    """The reply's message and finish reason: tool calls where the text calls the request's tools
    (the text before a call, if any, its content: what a stream of it sends)."""
    if isinstance(body, ChatRequest) and body.callable_tools:
        watch = CallStream(body.callable_tools)
        before = watch.feed(text)
        _, calls = watch.finish()
        if calls:
            return {"role": "assistant", "content": before or None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, _reason(reason)


def _choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    """`n` choices: each its own seed stream where a seed is given (else the sampler's own generator)."""
    # The prompt's logprobs are the same for every choice: the first computes them.
    return [dataclasses.replace(params, seed=None if params.seed is None else (params.seed + i) % 2**63,
                                prompt_logprobs=params.prompt_logprobs if i == 0 else None) for i in range(n)]


async def _complete(http: HttpRequest, f: Frontend, body: CompletionRequest | ChatRequest) -> Response:
    lora = f.check_model(body.model)
    chat = isinstance(body, ChatRequest)
    params = body.to_sampling_params()
    params.lora = lora
    prompt = await request_prompt(f, body)
    ids = await f.prepare(prompt, params)
    echo = f.prompt_text(prompt, ids) if body.echo else ""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    obj = "chat.completion" if chat else "text_completion"
    base = {"id": rid, "object": obj, "created": int(time.time()), "model": body.model or f.cfg.model_name}
    plist = _choices(params, body.n)
    if body.stream:
        head = {**base, "object": obj + ".chunk" if chat else obj}
        return StreamingResponse(await primed(_chunks(http, f, body, ids, plist, head, echo)),
                                 media_type="text/event-stream")
    choices = []
    results = await f.collect_all(http, ids, plist)
    for i, r in enumerate(results):
        choice: dict[str, Any] = {"index": i, "finish_reason": _reason(r.finish_reason),
                                  "logprobs": _logprobs(f, r.tokens, chat, results[0].prompt_logprobs)
                                  if params.logprobs else None}
        if chat:
            choice["message"], choice["finish_reason"] = reply_message(body, r.text, r.finish_reason)
        else:
            choice["text"] = echo + r.text
        choices.append(choice)
    cached = (results[0].tokens[0].cached_tokens or 0) if results[0].tokens else 0
    return JSONResponse({**base, "choices": choices, "usage": _usage(len(ids), sum(len(r.tokens) for r in results), cached)})


class _ChoiceStream:
    """One choice's events in a stream: its opening (the role, or the echo), the echo with the prompt's
    logprobs at its first event, then its text and logprob deltas; with tools to call, a chat reply's
    text streams until a call can begin (structured.CallStream), and what follows is held to its end
    and goes as one `tool_calls` delta (index, id, name, the whole arguments), or as content if it is
    no call."""

    def __init__(self, index: int, f: Frontend, body: CompletionRequest | ChatRequest, head: dict[str, Any],
                 echo: str, want_lp: bool, echo_lp: bool):
        self.index, self.f, self.body, self.head, self.echo = index, f, body, head, echo
        self.chat = isinstance(body, ChatRequest)
        self.calls = CallStream(body.callable_tools) if self.chat and body.callable_tools else None
        self.want_lp, self.echo_lp, self.echoed = want_lp, echo_lp, False

    def _event(self, **choice: Any) -> str:
        return sse({**self.head, "choices": [{"index": self.index, **choice}]})

    def opening(self) -> list[str]:
        if self.chat:
            return [self._event(delta={"role": "assistant", "content": ""}, finish_reason=None, logprobs=None)]
        if self.echo and not self.echo_lp:
            return [self._event(text=self.echo, finish_reason=None, logprobs=None)]
        return []

    def events(self, d: Delta, prompt_lp: list[PromptToken] | None) -> list[str]:
        out = []
        if self.echo_lp and not self.echoed:
            self.echoed = True
            lp = _logprobs(self.f, [], False, prompt_lp)
            out.append(self._event(text=self.echo, finish_reason=None, logprobs=lp))
        if self.calls:
            return out + self._watched(d)
        toks = [d] if d.token_id is not None else []
        if not d.text and not d.finish_reason and not (self.want_lp and toks):
            return out
        choice = {"finish_reason": _reason(d.finish_reason) if d.finish_reason else None,
                  "logprobs": _logprobs(self.f, toks, self.chat) if self.want_lp and toks else None}
        if self.chat:
            choice["delta"] = {"content": d.text} if d.text else {}
        else:
            choice["text"] = d.text
        return out + [self._event(**choice)]

    def _watched(self, d: Delta) -> list[str]:
        """Text while no call can have begun; at the end, the held rest as calls or as text."""
        text = self.calls.feed(d.text)
        if not d.finish_reason:
            return [self._event(delta={"content": text}, finish_reason=None, logprobs=None)] if text else []
        tail, calls = self.calls.finish()
        text += tail
        if not calls:
            return [self._event(delta={"content": text} if text else {}, finish_reason=_reason(d.finish_reason),
                                logprobs=None)]
        out = [self._event(delta={"content": text}, finish_reason=None, logprobs=None)] if text else []
        delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
        return out + [self._event(delta=delta, finish_reason="tool_calls", logprobs=None)]


async def _chunks(http: HttpRequest, f: Frontend, body: CompletionRequest | ChatRequest, ids: list[int],
                  plist: list[SamplingParams], head: dict[str, Any], echo: str) -> AsyncIterator[str]:
    """The stream: each choice's events (_ChoiceStream) interleaved by `index`, then usage and [DONE]."""
    echo_lp = bool(echo) and plist[0].prompt_logprobs is not None  # with logprobs, echoed at the first event
    streams = [_ChoiceStream(i, f, body, head, echo, plist[0].logprobs > 0, echo_lp) for i in range(len(plist))]
    for event in (e for s in streams for e in s.opening()):
        yield event
    prompt_lp, n, cached = None, 0, None
    async for i, d in f.fan_out(http, ids, plist):
        if d.error:
            yield sse({"error": {"message": d.error, "type": "server_error", "code": 500}})
            break
        prompt_lp = prompt_lp or d.prompt_logprobs  # the first choice's first event carries them
        n += d.token_id is not None
        cached = d.cached_tokens if cached is None and i == 0 else cached
        for event in streams[i].events(d, prompt_lp):
            yield event
    if body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": _usage(len(ids), n, cached or 0)})
    yield "data: [DONE]\n\n"


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of)) -> Response:
    return await _complete(http, f, body)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of)) -> Response:
    return await _complete(http, f, body)


@router.get("/v1/models")
async def models(f: Frontend = Depends(Frontend.of)) -> dict[str, Any]:
    base = f.cfg.model_name  # a LoRA adapter names its base as `parent` (vLLM's field)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llm-serving",
                                        "max_model_len": f.cfg.max_model_len,
                                        **({"parent": base} if f.engine.adapters.resolve(name) else {})}
                                       for name in f.served_names]}
