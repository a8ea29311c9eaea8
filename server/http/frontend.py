"""What every HTTP dialect shares: reading a bounded JSON body, tokenising off the event loop,
submitting to the engine and awaiting its events (cancelling on disconnect), and the error type
handlers turn into 4xx/5xx JSON."""
from __future__ import annotations

import asyncio
import functools
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request as HttpRequest

from common import grammar
from common.config import ServingConfig
from server.engine.engine import Engine, QueueFull
from server.request import Delta, PromptToken, Request, Sink
from server.prompts import encode_prompt
from server.sampling_params import InvalidRequest, LoraRef, SamplingParams
from common.tokenizer import TextTokenizer

DISCONNECT_POLL_S = 0.5


@dataclass
class Result:
    text: str
    tokens: list[Delta]
    finish_reason: str
    prompt_tokens: int
    prompt_logprobs: list[PromptToken] | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers or {}
        self.code = code or status


class Frontend:
    def __init__(self, engine: Engine, cfg: ServingConfig, tok: TextTokenizer):
        self.engine, self.cfg, self.tok = engine, cfg, tok
        self._ll_lock = threading.Lock()

    @functools.cached_property
    def _ll_tokenizer(self) -> Any:
        return grammar.ll_tokenizer(self.tok)  # ~0.2 s: built at the first constrained request

    @property
    def served_names(self) -> list[str]:
        """The base model's names, then its LoRA adapters' (server/engine/lora.py)."""
        return [self.cfg.model_name, *self.cfg.model_aliases, *self.engine.adapters.names]

    def check_model(self, name: str | None) -> LoraRef | None:
        """A request's `model` (or adapter): absent, or a name this server serves (OpenAI's 404
        otherwise). Returns its LoRA adapter (None: the base model)."""
        if name is None or name == self.cfg.model_name or name in self.cfg.model_aliases:
            return None
        lora = self.engine.adapters.resolve(name)
        if lora is None:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves {self.served_names}",
                           code="model_not_found")
        return lora

    @staticmethod
    def of(http: HttpRequest) -> "Frontend":
        """The app's frontend: the routers' FastAPI dependency (`Depends(Frontend.of)`)."""
        return http.app.state.frontend

    async def prepare(self, text: Any, params: SamplingParams, default_new: int | None = None) -> list[int]:
        """Tokenise off the event loop: other clients and /health answer while a huge prompt is read
        (and a grammar is checked against the tokenizer)."""
        if params.grammar:
            await asyncio.to_thread(self._check_grammar, params.grammar)
        return await asyncio.to_thread(encode_prompt, self.tok, self.cfg, text, params, default_new)

    def _check_grammar(self, text: str) -> None:
        with self._ll_lock:
            tok = self._ll_tokenizer
        try:
            grammar.check(text, tok)
        except grammar.GrammarError as exc:
            raise InvalidRequest(f"the grammar cannot be used: {exc}") from None

    def prompt_text(self, prompt: Any, ids: list[int]) -> str:
        """The prompt as text, for return_full_text (token-id prompts are decoded)."""
        return prompt if isinstance(prompt, str) else self.tok.decode(ids)

    async def stream(self, http: HttpRequest, ids: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | None] = asyncio.Queue()  # None: the client disconnected
        rid = uuid.uuid4().hex
        req = Request(rid, ids, params, sink=Sink(loop, queue))
        try:
            self.engine.submit(req)
        except QueueFull as exc:
            raise ApiError(503, f"server overloaded: {exc}", "overloaded",
                           {"Retry-After": str(self.engine.requests.retry_after_s())}) from None
        finished = False

        async def watch_disconnect() -> None:  # one watcher per request, not a timeout per token
            while not await http.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            queue.put_nowait(None)

        watcher = asyncio.create_task(watch_disconnect())
        try:
            first = True
            while True:
                d = await queue.get()
                if d is None:  # the client went away
                    return
                if d.finish_reason:
                    finished = True
                if first and d.error and d.status == 503:  # no agent: a 503 before any byte of a stream
                    raise ApiError(503, d.error, "unavailable")
                first = False
                yield d
                if finished:
                    return
        finally:
            watcher.cancel()
            if not finished:  # client went away or the generator was closed: free its blocks
                self.engine.abort(rid)

    async def collect(self, http: HttpRequest, ids: list[int], params: SamplingParams) -> Result:
        return (await self.collect_all(http, ids, [params]))[0]

    async def collect_all(self, http: HttpRequest, ids: list[int], params: list[SamplingParams]) -> list[Result]:
        """One Result per choice (`fan_out`)."""
        out = [Result("", [], "cancelled", len(ids)) for _ in params]
        async for i, d in self.fan_out(http, ids, params):
            r = out[i]
            if d.prompt_logprobs is not None:
                r.prompt_logprobs = d.prompt_logprobs
            if d.token_id is not None:
                r.tokens.append(d)
            r.text += d.text
            if d.finish_reason:
                r.finish_reason = d.finish_reason
                if d.error:
                    raise ApiError(d.status, d.error, "server_error" if d.status == 500 else "unavailable")
        return out

    async def fan_out(self, http: HttpRequest, ids: list[int], params: list[SamplingParams]
                      ) -> AsyncIterator[tuple[int, Delta]]:
        """The events of one request per parameter set (OpenAI's `n` choices), tagged with their index.
        The first runs alone until its first event, so its prompt's KV blocks are in the prefix cache
        when the others start: the prompt is prefilled once."""
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        async def run(i: int) -> None:
            try:
                async for d in self.stream(http, ids, params[i]):
                    await queue.put((i, d))
                await queue.put((i, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put((i, exc))

        tasks, ended = [asyncio.create_task(run(0))], 0
        try:
            while ended < len(params):
                i, item = await queue.get()
                if len(tasks) == 1 and len(params) > 1:
                    tasks += [asyncio.create_task(run(k)) for k in range(1, len(params))]
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    ended += 1
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def token_json(self, d: Delta) -> dict[str, Any]:
        return {"id": d.token_id, "logprob": d.logprob, "special": self.tok.is_special(d.token_id or -1), "text": d.text}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def primed(gen: AsyncIterator[str]) -> AsyncIterator[str]:
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
