"""LoRA adapters loaded and unloaded at run time, as vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter take them (behind the API keys, as every route). A load fills a free slot of
every agent between steps (serving_config.max_loras); an unload stops new requests at once and its
running ones finish on its weights (its slot is reused only after them)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from common.lora import AdapterError
from server.http.frontend import ApiError, Frontend

router = APIRouter()


class LoadLora(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLora(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; the name says which


async def _apply(f: Frontend, name: str, path: str | None) -> PlainTextResponse:
    try:
        return PlainTextResponse(await asyncio.wrap_future(f.engine.lora.load(name, path)))
    except AdapterError as exc:
        raise ApiError(exc.status, str(exc), code="model_not_found" if exc.status == 404 else None) from None


@router.post("/v1/load_lora_adapter")
async def load(body: LoadLora, f: Frontend = Depends(Frontend.of)) -> PlainTextResponse:
    if not body.lora_name or not body.lora_path:
        raise ApiError(400, "lora_name and lora_path are both required")
    return await _apply(f, body.lora_name, body.lora_path)


@router.post("/v1/unload_lora_adapter")
async def unload(body: UnloadLora, f: Frontend = Depends(Frontend.of)) -> PlainTextResponse:
    return await _apply(f, body.lora_name, None)
