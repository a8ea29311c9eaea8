"""OpenAI's Responses API: `POST /v1/responses` (plain, or streamed as its typed events), `GET` and
`DELETE /v1/responses/{id}`. A request runs as the chat request it is (responses_schema.py); its
reply becomes output items: a message with the text, then a `function_call` item per call (parsed
and streamed by the chat path's rule, structured.CallStream)."""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from server.http.frontend import ApiError, Frontend, primed
from server.http.openai import reply_message, request_prompt
from server.http.responses_schema import ResponsesRequest
from server.http.responses_store import ResponseStore
from server.http.schemas import ChatRequest
from server.http.structured import CallStream
from server.sampling_params import InvalidRequest, SamplingParams

router = APIRouter(tags=["OpenAI Responses"])


def store_of(http: HttpRequest) -> ResponseStore:
    return http.app.state.responses


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def item_status(reason: str) -> str:
    """A message item cut by max_output_tokens is incomplete, as its response is."""
    return "incomplete" if reason == "length" else "completed"


def call_item(call: dict[str, Any], status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


class Turn:
    """One response being made: its request, id, and the object it is at each stage."""

    def __init__(self, f: Frontend, body: ResponsesRequest, chat: ChatRequest, history: list[dict[str, Any]],
                 n_prompt: int):
        self.f, self.body, self.chat, self.history, self.n_prompt = f, body, chat, history, n_prompt
        self.id, self.created = _new_id("resp_"), int(time.time())
        self.cached = 0  # prompt tokens the prefix cache served (the first token's event says)

    def response(self, status: str, output: list[dict[str, Any]], n_output: int = 0,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        usage = None if status == "in_progress" else {
            "input_tokens": self.n_prompt, "input_tokens_details": {"cached_tokens": self.cached}, "output_tokens": n_output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": self.n_prompt + n_output}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "model": b.model or self.f.cfg.model_name, "output": output,
                "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": b.previous_response_id,
                "store": b.store, "temperature": b.temperature, "top_p": b.top_p,
                "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": b.tool_choice, "tools": [t.model_dump(exclude_none=True) for t in b.tools],
                "truncation": b.truncation, "metadata": b.metadata, "usage": usage}

    def finish(self, store: ResponseStore, text: str, calls: list[dict[str, Any]], reason: str, n_output: int,
               output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final object, kept (with the conversation it ends) unless `store` is false."""
        obj = self.response("incomplete" if reason == "length" else "completed", output, n_output)
        if self.body.store:
            said = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
            store.put(obj, self.history + self.body.items(self.history) + [said])
        return obj


@router.post("/v1/responses")
async def create(body: ResponsesRequest, http: HttpRequest, f: Frontend = Depends(Frontend.of),
                 store: ResponseStore = Depends(store_of)) -> Any:
    lora = f.check_model(body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id:
        kept = store.get(body.previous_response_id)
        if kept is None:
            raise InvalidRequest(f"previous_response_id: no response {body.previous_response_id!r} is stored here "
                                 "(made with store false, deleted, expired, or made by another server)")
        history = kept.conversation
    chat = body.chat_request(history)
    params = chat.to_sampling_params()
    params.lora = lora
    ids = await f.prepare(await request_prompt(f, chat), params)
    turn = Turn(f, body, chat, history, len(ids))
    if body.stream:
        return StreamingResponse(await primed(_events(http, turn, store, ids, params)), media_type="text/event-stream")
    [r] = await f.collect_all(http, ids, [params])
    turn.cached = r.tokens[0].cached_tokens or 0 if r.tokens else 0
    msg, _ = reply_message(chat, r.text, r.finish_reason)
    calls = msg.get("tool_calls") or []
    text = msg["content"] or ""
    output = ([message_item(_new_id("msg_"), text, item_status(r.finish_reason))] if text else []) + [
        call_item(c) for c in calls]
    return turn.finish(store, text, calls, r.finish_reason, len(r.tokens), output)


async def _events(http: HttpRequest, turn: Turn, store: ResponseStore, ids: list[int],
                  params: SamplingParams) -> AsyncIterator[str]:
    """The typed event stream: created, in_progress, the message's item, part and text deltas as
    they come, each call's item and arguments, then completed (or incomplete, or failed)."""
    seq = itertools.count()

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **data})}\n\n"

    yield event("response.created", response=turn.response("in_progress", []))
    yield event("response.in_progress", response=turn.response("in_progress", []))
    watch = CallStream(turn.chat.callable_tools) if turn.chat.callable_tools else None
    msg_id, text, n_output, reason, calls = _new_id("msg_"), "", 0, "eos", None
    part = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    async for _, d in turn.f.fan_out(http, ids, [params]):
        if d.error:
            err = {"code": "server_error", "message": d.error}
            yield event("response.failed", response=turn.response("failed", [], n_output, err))
            return
        n_output += d.token_id is not None
        if d.cached_tokens is not None:
            turn.cached = d.cached_tokens
        piece = watch.feed(d.text) if watch else d.text
        if d.finish_reason:
            reason = d.finish_reason
            tail, calls = watch.finish() if watch else ("", None)
            piece += tail
        if piece and not text:
            yield event("response.output_item.added", output_index=0, item=message_item(msg_id, "", "in_progress"))
            yield event("response.content_part.added", **part, part={"type": "output_text", "text": "", "annotations": []})
        if piece:
            text += piece
            yield event("response.output_text.delta", **part, delta=piece, logprobs=[])
    output = []
    if text:
        yield event("response.output_text.done", **part, text=text, logprobs=[])
        yield event("response.content_part.done", **part, part={"type": "output_text", "text": text, "annotations": []})
        output.append(message_item(msg_id, text, item_status(reason)))
        yield event("response.output_item.done", output_index=0, item=output[-1])
    for call in calls or []:
        item, index = call_item(call), len(output)
        yield event("response.output_item.added", output_index=index, item=call_item(call, "in_progress", ""))
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    arguments=item["arguments"])
        output.append(item)
        yield event("response.output_item.done", output_index=index, item=item)
    final = turn.finish(store, text, calls or [], reason, n_output, output)
    yield event(f"response.{final['status']}", response=final)


@router.get("/v1/responses/{rid}")
async def retrieve(rid: str, store: ResponseStore = Depends(store_of)) -> dict[str, Any]:
    kept = store.get(rid)
    if kept is None:
        raise ApiError(404, f"No response with id {rid!r} is stored here", code="not_found")
    return kept.response


@router.delete("/v1/responses/{rid}")
async def delete(rid: str, store: ResponseStore = Depends(store_of)) -> Response:
    if not store.delete(rid):
        raise ApiError(404, f"No response with id {rid!r} is stored here", code="not_found")
    return Response(json.dumps({"id": rid, "object": "response", "deleted": True}), media_type="application/json")
