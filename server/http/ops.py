"""Operations: /health, /metrics, /stats, /debug/trace, and draining an agent (/admin/agents/{port}/drain,
behind the API keys as every route but /health and /metrics)."""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.engine.drain import DrainError
from server.http.frontend import ApiError, Frontend

router = APIRouter(tags=["operations"])
LAG_PROBE_S = 0.01


async def watch_loop_lag(f: Frontend) -> None:
    """The event loop's lag as /metrics shows it: how late a 10 ms timer fires (the app's startup task)."""
    loop, lag = asyncio.get_running_loop(), f.engine.metrics.loop_lag
    while True:
        t = loop.time()
        await asyncio.sleep(LAG_PROBE_S)
        lag.observe(max(0.0, loop.time() - t - LAG_PROBE_S))


@router.get("/health")
async def health(f: Frontend = Depends(Frontend.of)) -> JSONResponse:
    status, why = f.engine.health()
    draining = f.engine.drains.draining()  # ports nothing is scheduled on (they still answer: 200)
    if draining:
        why += f"; draining: port{'s' if len(draining) > 1 else ''} {', '.join(map(str, draining))}"
    return JSONResponse({"status": status, "reason": why, "draining": draining},
                        status_code=200 if status in ("ok", "degraded") else 503)


@router.get("/metrics")
async def metrics(f: Frontend = Depends(Frontend.of)) -> Response:
    return Response(generate_latest(f.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/stats")
async def stats(f: Frontend = Depends(Frontend.of)) -> dict[str, Any]:
    """Live counters for operators and benchmarks (the original's /serving/* keep their shapes)."""
    return {"model_name": f.cfg.model_name, "max_model_len": f.cfg.max_model_len, "block_size": f.cfg.block_size,
            "num_blocks": f.cfg.num_blocks, "agents": len(f.cfg.agent_ports), **f.engine.stats()}


@router.get("/debug/trace")
async def trace(f: Frontend = Depends(Frontend.of)) -> dict[str, Any]:
    return f.engine.stepper.trace.chrome()  # recent steps (chrome://tracing, Perfetto)


async def _drain(f: Frontend, port: int, resume: bool) -> dict[str, Any]:
    try:
        return await asyncio.wrap_future(f.engine.drains.ask(port, resume))
    except DrainError as exc:
        raise ApiError(exc.status, str(exc)) from None


@router.post("/admin/agents/{port}/drain")
async def drain(port: int, f: Frontend = Depends(Frontend.of)) -> dict[str, Any]:
    """Move every sequence off the agent on `port` with its KV; answers once it holds none (then
    restart or upgrade it: nothing is lost). Nothing new is scheduled there until it restarts or resumes."""
    return await _drain(f, port, False)


@router.post("/admin/agents/{port}/resume")
async def resume(port: int, f: Frontend = Depends(Frontend.of)) -> dict[str, Any]:
    return await _drain(f, port, True)
