"""Multi-turn chat workload against any OpenAI-compatible server (ours, vLLM, SGLang, llama.cpp):
conversations that each have their own system prompt, their turns in order (each turn's messages
are the whole conversation so far), random think times between turns and staggered starts.
Clients in lockstep hide what routing and prefix caches do; these do not.

    python -m tools.bench_multiturn [--base-url http://127.0.0.1:8835] [--conversations 12] [--turns 4]
        [--system-words 400] [--user-words 40] [--output-len 32] [--think-s 2] [--stagger-s 8]

`--shared-prefix 0` gives every conversation one turn and a system prompt of its own words only
(nothing shared anywhere: the balance check of a router). Prints TTFT and TPOT percentiles and
output tok/s; against our server also the share of prompt tokens the agents computed (the rest came
from their prefix caches) and the requests each agent took (/metrics).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from llm_serving.bench import lifecycle
from llm_serving.bench.serving import _WORDS


@dataclass
class Turn:
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""


@dataclass
class Conversation:
    system: str
    users: list[str]
    start_s: float  # its first turn is sent this long after the run starts
    thinks: list[float]  # seconds before each later turn
    turns: list[Turn] = field(default_factory=list)


def conversations(n: int, turns: int, system_words: int, user_words: int, think_s: float, stagger_s: float,
                  seed: int, shared: bool = False) -> list[Conversation]:
    """`shared`: one system prompt for every conversation (a hot prefix), else each its own."""
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(_WORDS) for _ in range(k))  # noqa: E731
    common = words(system_words)
    return [Conversation("You are an assistant. " + common if shared else f"You are assistant {i}. " + words(system_words),
                         [words(user_words) for _ in range(turns)],
                         rng.uniform(0, stagger_s), [rng.expovariate(1 / think_s) if think_s > 0 else 0.0
                                                     for _ in range(turns - 1)]) for i in range(n)]


async def _turn(client: httpx.AsyncClient, base: str, model: str, messages: list[dict], output_len: int) -> tuple[Turn, str]:
    body = {"model": model, "messages": messages, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    turn, text, t0 = Turn(), "", time.perf_counter()
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                turn.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return turn, ""
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                if ev.get("usage"):
                    turn.output_tokens = int(ev["usage"]["completion_tokens"])
                delta = (ev.get("choices") or [{}])[0].get("delta", {}).get("content")
                if delta:
                    turn.ttft = turn.ttft or time.perf_counter() - t0
                    text += delta
        turn.latency = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    return turn, text


async def run(convs: list[Conversation], base: str, model: str, output_len: int) -> float:
    """Every conversation as its own client; the wall time from the first send to the last reply."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=len(convs) + 1)) as client:
        async def talk(c: Conversation) -> None:
            await asyncio.sleep(c.start_s)
            messages = [{"role": "system", "content": c.system}]
            for i, user in enumerate(c.users):
                if i:
                    await asyncio.sleep(c.thinks[i - 1])
                messages.append({"role": "user", "content": user})
                turn, reply = await _turn(client, base, model, messages, output_len)
                c.turns.append(turn)
                messages.append({"role": "assistant", "content": reply})

        t0 = time.perf_counter()
        await asyncio.gather(*(talk(c) for c in convs))
        return time.perf_counter() - t0


def server_counters(base: str) -> dict[str, float]:
    """Our server's prompt-token, per-agent request and routing counters ({} for a peer without them)."""
    keep = (lifecycle.PROMPT, lifecycle.PREFILL, "llm_serving_agent_requests_total", "llm_serving_routed_by_prefix_total",
            "llm_serving_routed_past_prefix")
    return {k: v for k, v in lifecycle.samples(base).items() if k.startswith(keep)}


def summarize(convs: list[Conversation], wall: float, before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    turns = [t for c in convs for t in c.turns]
    ok = [t for t in turns if not t.error]
    ttft = np.array([t.ttft for t in ok]) * 1e3
    tpot = np.array([(t.latency - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]) * 1e3
    s: dict[str, Any] = {"turns": len(turns), "failed": len(turns) - len(ok), "wall_s": wall,
                         "output_tok_s": sum(t.output_tokens for t in ok) / wall,
                         "ttft_p50_ms": float(np.median(ttft)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
                         "tpot_p50_ms": float(np.median(tpot)) if len(tpot) else 0.0,
                         "tpot_p99_ms": float(np.percentile(tpot, 99)) if len(tpot) else 0.0,
                         "errors": sorted({t.error for t in turns if t.error})[:3]}
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    prompt = delta.get(lifecycle.PROMPT, 0.0)
    if prompt:
        s["prompt_computed_share"] = delta.get(lifecycle.PREFILL, 0.0) / prompt
        s["prompt_tokens"] = prompt
        s["agent_requests"] = [v for k, v in sorted(delta.items()) if k.startswith("llm_serving_agent_requests_total")]
        s["routed_by_prefix"] = delta.get("llm_serving_routed_by_prefix_total", 0.0)
        s["routed_past_prefix"] = delta.get("llm_serving_routed_past_prefix_total", 0.0)
        s["routed_past_prefix_tokens"] = delta.get("llm_serving_routed_past_prefix_tokens_total", 0.0)
    return s


def measure(base: str, model: str, convs: list[Conversation], output_len: int) -> dict[str, Any]:
    before = server_counters(base)
    wall = asyncio.run(run(convs, base, model, output_len))
    return summarize(convs, wall, before, server_counters(base))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_multiturn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8835")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--think-s", type=float, default=2.0, help="mean of the exponential think time between turns")
    ap.add_argument("--stagger-s", type=float, default=8.0, help="first turns spread uniformly over this")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    convs = conversations(args.conversations, args.turns, args.system_words, args.user_words, args.think_s,
                          args.stagger_s, args.seed)
    s = measure(args.base_url.rstrip("/"), args.model, convs, args.output_len)
    print(json.dumps(s, indent=1))
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
