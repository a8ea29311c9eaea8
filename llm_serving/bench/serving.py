"""llm-bench: serving benchmark in the vLLM `bench serve` format, against our server or any peer.

Backends: `original` (/models/{model}/generate_stream), `tgi` (/generate_stream), `openai`
(/v1/completions, so vLLM and llama.cpp servers work too). Poisson or gamma arrivals, optional
max concurrency, random / Alpaca-JSON / shared-prefix datasets, JSON results, `--sweep` PNG.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from llm_serving.bench import lifecycle
from llm_serving.bench.report import add_server_overhead, plot_sweep, server_stats, goodput_line, print_table


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int  # approximate (words) unless the dataset knows tokens
    max_tokens: int
    ignore_eos: bool = True  # benchmarks fix output lengths; the contest client does not


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_len: int = 0
    text: str = ""
    start: float = 0.0


# ------------------------------------------------------------------ datasets
_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
          "point government company number group problem fact").split()


def random_dataset(n: int, input_len: int, output_len: int, seed: int, prefix_len: int = 0,
                   range_ratio: float = 0.0) -> list[BenchRequest]:
    """Random-word prompts; with range_ratio R each prompt and output length is drawn uniformly
    from [L(1-R), L(1+R)] (as `vllm bench serve --random-range-ratio`)."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(_WORDS) for _ in range(prefix_len))

    def draw(length: int) -> int:
        return max(1, rng.randint(round(length * (1 - range_ratio)), round(length * (1 + range_ratio))))

    out = []
    for _ in range(n):
        n_in, n_out = draw(input_len), draw(output_len)
        body = " ".join(rng.choice(_WORDS) for _ in range(max(0, n_in - prefix_len)))
        out.append(BenchRequest((prefix + " " + body).strip(), n_in, n_out))
    return out


def alpaca_dataset(path: str, n: int, seed: int, tokenizer: Any = None) -> list[BenchRequest]:
    """Alpaca-format JSON list (instruction, input, output) as in the contest client: prompt =
    instruction + ":" + input, max tokens = the reference output's token count."""
    items = json.loads(Path(path).read_text())
    random.Random(seed).shuffle(items)
    out = []
    for it in items[:n]:
        prompt = it["instruction"] + ":" + it.get("input", "")
        ref = it.get("output", "")
        n_out = len(tokenizer.encode(ref)) if tokenizer else max(1, int(len(ref.split()) * 1.3))
        out.append(BenchRequest(prompt, len(prompt.split()), max(1, n_out)))
    return out


# ------------------------------------------------------------------ backends
def request_spec(backend: str, base: str, model: str, r: BenchRequest) -> tuple[str, dict[str, Any]]:
    if backend == "original":
        return f"{base}/models/{model}/generate_stream", {
            "inputs": r.prompt, "stream": "True",
            "parameters": {"max_new_tokens": r.max_tokens, "do_sample": "False", "ignore_eos": str(r.ignore_eos)}}
    if backend == "tgi":
        return f"{base}/generate_stream", {"inputs": r.prompt, "parameters": {
            "max_new_tokens": r.max_tokens, "ignore_eos": r.ignore_eos}}
    return f"{base}/v1/completions", {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens,
                                      "temperature": 0, "stream": True, "ignore_eos": r.ignore_eos,
                                      "stream_options": {"include_usage": True}}


def parse_chunk(backend: str, line: str) -> tuple[int, str, dict | None] | None:
    """(tokens in this chunk, text, usage) or None for other lines. OpenAI servers' closing usage
    report (`include_usage`) is the exact token count: a chunk may hold more or fewer tokens than one
    (held-back UTF-8, coalesced steps), so counted chunks are only the fallback."""
    if backend == "original":
        if not line.strip():
            return None
        data = json.loads(line).get("data", [{}])[0]
        return (1, data.get("generated_text", ""), None) if "tokens" in data else None
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return None
    ev = json.loads(payload)
    if "error" in ev:
        raise RuntimeError(str(ev["error"]))
    if backend == "tgi":
        return (1, ev["token"]["text"], None) if ev.get("token", {}).get("id") is not None else None
    choices = ev.get("choices") or []
    if not choices:
        return (0, "", ev["usage"]) if ev.get("usage") else None
    text = choices[0].get("text", "")
    return (1, text, ev.get("usage")) if text or choices[0].get("finish_reason") is None else None


async def send(client: httpx.AsyncClient, backend: str, base: str, model: str, r: BenchRequest) -> RequestResult:
    url, body = request_spec(backend, base, model, r)
    res = RequestResult(prompt_len=r.prompt_len)
    res.start = t0 = time.perf_counter()
    last = t0
    usage: dict | None = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                chunk = parse_chunk(backend, line)
                if chunk is None:
                    continue
                if chunk[2]:
                    usage = chunk[2]
                    if not chunk[0]:
                        continue
                now = time.perf_counter()
                if res.output_tokens == 0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                res.output_tokens += chunk[0]
                res.text += chunk[1]
        res.latency = time.perf_counter() - t0
        if usage:
            res.output_tokens = int(usage.get("completion_tokens", res.output_tokens))
            res.prompt_len = int(usage.get("prompt_tokens", res.prompt_len))
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no tokens"
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_benchmark(reqs: list[BenchRequest], backend: str, base: str, model: str, rate: float,
                        burstiness: float, max_concurrency: int | None, seed: int, progress: bool = True
                        ) -> tuple[list[RequestResult], float]:
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    done = 0
    limits = httpx.Limits(max_connections=max_concurrency or len(reqs) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        async def one(r: BenchRequest) -> RequestResult:
            nonlocal done
            if sem:
                async with sem:
                    out = await send(client, backend, base, model, r)
            else:
                out = await send(client, backend, base, model, r)
            done += 1
            if progress:
                bar = "#" * int(30 * done / len(reqs))
                print(f"\r[{bar:<30}] {done}/{len(reqs)}", end="", file=sys.stderr, flush=True)
            return out

        tasks = []
        t0 = time.perf_counter()
        for r in reqs:
            tasks.append(asyncio.create_task(one(r)))
            if rate != float("inf"):
                # Gamma with shape=burstiness and mean 1/rate; burstiness 1 is Poisson.
                await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if progress:
        print(file=sys.stderr)
    return results, duration


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ms = lambda xs: [x * 1000 for x in xs]  # noqa: E731
    ttft = ms([r.ttft for r in ok])
    tpot = ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    itl = ms([x for r in ok for x in r.itl])
    e2e = ms([r.latency for r in ok])
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)

    def stats(name: str, xs: list[float]) -> dict[str, float]:
        a = np.asarray(xs or [0.0])
        return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
                f"p99_{name}_ms": float(np.percentile(a, 99))}

    # At a finite request rate no server ends before the last request is sent: output tokens over
    # that time bound any server's output throughput (a server that answered every request the
    # instant it came would reach it), so a ratio between two servers is capped by it too.
    sent = [r.start for r in results if r.start]
    span = max(sent) - min(sent) if sent else 0.0
    bound = {"arrival_bound_throughput": out_tok / span} if span > 0.05 * duration else {}
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "total_input_tokens": in_tok, "total_output_tokens": out_tok,
            "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
            "total_token_throughput": (in_tok + out_tok) / duration, **bound,
            **stats("ttft", ttft), **stats("tpot", tpot), **stats("itl", itl), **stats("e2el", e2e),
            "errors": sorted({r.error for r in results if r.error})[:5]}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="llm-bench", description=__doc__)
    ap.add_argument("--base-url", default="http://127.0.0.1:8835")
    ap.add_argument("--backend", choices=("original", "tgi", "openai"), default="openai")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dataset", choices=("random", "alpaca", "shared-prefix"), default="random")
    ap.add_argument("--dataset-path", help="Alpaca-format JSON for --dataset alpaca")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128, help="words per random prompt")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=64, help="shared words for --dataset shared-prefix")
    ap.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="lengths drawn from [L(1-R), L(1+R)] for prompts and outputs (random datasets)")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf = all at once")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--sweep", help="comma-separated request rates; draws a throughput-latency PNG")
    ap.add_argument("--goodput", metavar="TTFT_MS,TPOT_MS", help="with --sweep: the highest rate whose p99 TTFT and "
                    "p99 TPOT stay within these bounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-result", help="JSON file for the summary (and per-request results)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)

    if args.dataset == "alpaca":
        if not args.dataset_path:
            ap.error("--dataset alpaca needs --dataset-path")
        reqs = alpaca_dataset(args.dataset_path, args.num_prompts, args.seed)
    else:
        prefix = args.prefix_len if args.dataset == "shared-prefix" else 0
        if not 0 <= args.random_range_ratio < 1:
            ap.error("--random-range-ratio must be in [0, 1)")
        reqs = random_dataset(args.num_prompts, args.input_len, args.output_len, args.seed, prefix,
                              args.random_range_ratio)

    rates = [float(x) for x in args.sweep.split(",")] if args.sweep else [args.request_rate]
    summaries = []
    base = args.base_url.rstrip("/")
    for rate in rates:
        before, phases = server_stats(base), lifecycle.snapshot(base)
        results, duration = asyncio.run(run_benchmark(reqs, args.backend, base, args.model,
                                                      rate, args.burstiness, args.max_concurrency, args.seed))
        s = summarize(results, duration)
        s["request_rate"] = rate
        add_server_overhead(s, before, server_stats(base))
        s["server_breakdown"] = lifecycle.breakdown(phases, lifecycle.snapshot(base))
        summaries.append(s)
        print_table(s, f"rate {rate:g} req/s")
        lifecycle.print_breakdown(s["server_breakdown"])
        if "server_cpu_per_step_ms" in s:
            print(f"server CPU per step: {s['server_cpu_per_step_ms']:.2f} ms = "
                  f"{s['server_cpu_share_of_step'] * 100:.1f}% of the mean step ({s['mean_step_ms']:.1f} ms)")
        if args.save_result:
            path = Path(args.save_result)
            if len(rates) > 1:
                path = path.with_name(f"{path.stem}_rate{rate:g}{path.suffix}")
            path.write_text(json.dumps({"summary": s, "requests": [asdict(r) for r in results]}, indent=1))
    if args.sweep:
        plot_sweep(summaries, Path(args.save_result or "bench").with_suffix(".png"))
    if args.goodput:
        ttft_ms, tpot_ms = (float(x) for x in args.goodput.split(","))
        print(goodput_line(summaries, ttft_ms, tpot_ms))
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
