"""Contest-compatible benchmark client (performance_serving/test_serving_performance.py).

Sends X*T requests at about X per second (gaps 1/X with small jitter), streamed greedily to
/models/llama2/generate_stream, prompts from an Alpaca-format JSON list (prompt = instruction + ":"
+ input, max_new_tokens = token count of the reference output). Writes result_{X}_x.json and ends
its log with `All Tasks Done; Exec Time is <s>` (the contest score).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from pathlib import Path

import httpx

from tools.bench_serving import BenchRequest, send


def load_requests(path: str, n: int, model_path: str) -> list[BenchRequest]:
    from common.model_files import resolve_model
    from server.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(model_path))
    items = json.loads(Path(path).read_text())
    out = []
    for i in range(n):
        it = items[i % len(items)]
        prompt = it["instruction"] + ":" + it.get("input", "")
        out.append(BenchRequest(prompt, len(tok.encode(prompt)), max(1, len(tok.encode(it["output"]))),
                                ignore_eos=False))
    return out


async def run(reqs: list[BenchRequest], rate: float, port: int, model: str) -> tuple[list[dict], float]:
    base = f"http://127.0.0.1:{port}"
    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0),
                                 limits=httpx.Limits(max_connections=len(reqs) + 1)) as client:
        async def one(r: BenchRequest) -> dict:
            res = await send(client, "original", base, model, r)
            return {"input": r.prompt, "resp_text": res.text, "res_time": res.latency,
                    "first_token_time": res.ttft, "output_tokens": res.output_tokens, "error": res.error}

        t0 = time.perf_counter()
        tasks = []
        for r in reqs:
            tasks.append(asyncio.create_task(one(r)))
            await asyncio.sleep(max(0.0, 1.0 / rate * (1 + rng.uniform(-0.1, 0.1))))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-X", type=float, required=True, help="requests per second")
    ap.add_argument("-P", type=int, default=8835, help="server port")
    ap.add_argument("-O", default=".", help="output directory")
    ap.add_argument("-T", type=float, required=True, help="seconds of arrivals (X*T requests)")
    ap.add_argument("--dataset", required=True, help="Alpaca-format JSON list")
    ap.add_argument("--model", default="llama2", help="model name in the URL")
    ap.add_argument("--model-path", default="smollm2", help="tokenizer source for max_new_tokens")
    args = ap.parse_args(argv)
    out_dir = Path(args.O)
    out_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(out_dir / f"test_{args.X:g}.log")])
    reqs = load_requests(args.dataset, int(args.X * args.T), args.model_path)
    results, elapsed = asyncio.run(run(reqs, args.X, args.P, args.model))
    (out_dir / f"result_{args.X:g}_x.json").write_text(json.dumps(results, ensure_ascii=False, indent=1))
    failed = sum(1 for r in results if r["error"])
    logging.info("requests: %d, failed: %d", len(results), failed)
    logging.info("All Tasks Done; Exec Time is %.3f", elapsed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
