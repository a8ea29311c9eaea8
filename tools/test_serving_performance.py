"""The 2024 contest's benchmark client (performance_serving/test_serving_performance.py), same flags
and outputs, plus a summary and a precision mode.

    python -m tools.test_serving_performance -X 2 -P 8835 -O ./out -T 750

Sends X*T requests, gaps of about 1/X s (Poisson in milliseconds, as the original), each streamed
greedily to /models/llama2/generate_stream with return_full_text; prompts from an Alpaca-format
JSON list (`./alpaca_5010.json` by default; prompt = instruction + ":" + input, or the instruction
alone), max_new_tokens = token count of the reference output. Logs each record and
`Test Progress --> i/n` to ./testLog/test_performance_<time>.log, ends with
`All Tasks Done; Exec Time is <s>` (the contest score) and writes <out>/result_<X>_x.json, then a
summary (per-request latency, tokens, per-token latency, totals) to <out>/count_<X>.json.

Token counts use ./tokenizer.model when present (the original's llama2 tokenizer), else the
server's own tokenizer (POST /tokenize). `--make-sample FILE` writes a small Alpaca-format sample.
Precision (the contest's check, tools/precision.py): `--precision-dump DIR/` against a server
started with `--dump-logits DIR` sends the prompts one at a time so the server writes the raw
full-vocabulary logits as .npy files every `--dump-every` positions, the contest's own layout;
`--precision-dump FILE.json` stores the top logprobs every `--every` positions over HTTP (any
server). `--precision-compare A B` compares two folders (or two JSON dumps) within atol 5e-3
(numpy.allclose), a line per file and a summary line, as the contest compared with its baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if not __package__:  # run by path, as the contest ran it: tools/ is the checkout's, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools import precision  # noqa: E402

DATASET = "./alpaca_5010.json"
LOG = logging.getLogger("test_llama")


def prompt_of(item: dict[str, Any]) -> str:
    return item["instruction"] + ":" + item["input"] if item.get("input") else item["instruction"]


def token_counter(base: str) -> Any:
    """len(tokens) of a text: the original's ./tokenizer.model if present, else the server's tokenizer."""
    if Path("tokenizer.model").exists():
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file="tokenizer.model")
        return lambda text: len(sp.encode(text))
    return lambda text: len(httpx.post(f"{base}/tokenize", json={"inputs": text}, timeout=60).json())


async def one(client: httpx.AsyncClient, url: str, prompt: str, new: int, progress: list[int], total: int) -> dict:
    """The original's request: stream, return_full_text; the response is the last line's text."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new, "do_sample": "False", "return_full_text": "True"}}
    t0 = time.time()
    first, texts, error = None, [], None
    try:
        async with client.stream("POST", url, json=body, headers={"Connection": "close"}) as r:
            async for line in r.aiter_lines():
                if not line:
                    continue
                if first is None:
                    first = time.time() - t0
                    LOG.info("first_token_time is %s", first)
                texts.append(json.loads(line)["data"][0]["generated_text"])
        if r.status_code != 200:
            error = f"HTTP {r.status_code}"
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    res = {"input": prompt, "resp_text": texts[-1] if texts else "", "res_time": time.time() - t0,
           "first_token_time": first, "output_tokens": max(0, len(texts) - 1)}
    if error:
        res["error"] = error
    progress[0] += 1
    LOG.info("%s\nTest Progress --> %d/%d", res, progress[0], total)
    return res


async def run(base: str, prompts: list[tuple[str, int]], x: float, n: int) -> tuple[list[dict], float]:
    url = f"{base}/models/llama2/generate_stream"
    interval = round(1 / x, 2)
    rng = np.random.default_rng()
    progress = [0]
    LOG.info("Start send request, avg interval is %s", interval)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.time()
        tasks = []
        for i in range(n):
            prompt, new = prompts[i % len(prompts)]
            tasks.append(asyncio.create_task(one(client, url, prompt, new, progress, n)))
            gap = rng.poisson(interval * 1000) / 1000
            LOG.info("poisson random interval time is %ss", gap)
            await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        return list(results), time.time() - t0


def count(results: list[dict], elapsed: float) -> dict[str, Any]:
    """The run in numbers: per request latency, output tokens, per-token latency; totals."""
    ok = [r for r in results if "error" not in r]
    toks = sum(r["output_tokens"] for r in ok)
    per_token = [r["res_time"] / r["output_tokens"] for r in ok if r["output_tokens"]]
    ttft = [r["first_token_time"] for r in ok if r["first_token_time"] is not None]
    mean = (lambda v: round(float(np.mean(v)), 4) if v else None)
    return {"requests": len(results), "failed": len(results) - len(ok), "exec_time_s": round(elapsed, 3),
            "output_tokens": toks, "throughput_tok_s": round(toks / elapsed, 2) if elapsed else None,
            "mean_latency_s": mean([r["res_time"] for r in ok]), "mean_first_token_s": mean(ttft),
            "mean_per_token_latency_s": mean(per_token),
            "per_request": [{"latency_s": round(r["res_time"], 4), "output_tokens": r["output_tokens"],
                             "per_token_s": round(r["res_time"] / r["output_tokens"], 4) if r["output_tokens"] else None}
                            for r in ok]}


def make_sample(path: Path, n: int = 40) -> None:
    """A deterministic Alpaca-format sample for smoke runs (the contest's alpaca_5010.json is not shipped)."""
    topics = ["the ocean", "a city park", "solar power", "the moon", "bread", "a library", "rain", "chess"]
    tasks = [("Write a short poem about {}.", ""), ("Give three facts about {}.", ""),
             ("Summarise the text", "{} is something many people enjoy and talk about every day."),
             ("Translate to French", "I like {}.")]
    items = []
    for i in range(n):
        topic = topics[i % len(topics)]
        instr, inp = tasks[i % len(tasks)]
        out = " ".join([f"{topic.capitalize()} is worth a thought."] * (1 + i % 5))
        items.append({"instruction": instr.format(topic), "input": inp.format(topic), "output": out})
    path.write_text(json.dumps(items, ensure_ascii=False, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-X", "--qps", type=float, help="requests per second")
    ap.add_argument("-P", "--port", default="8835", help="server port")
    ap.add_argument("-O", "--out_dir", default=".", help="dir for saving results")
    ap.add_argument("-T", "--test_time", type=int, default=3600, help="seconds of arrivals (X*T requests)")
    ap.add_argument("--dataset", default=DATASET, help=f"Alpaca-format JSON list (default {DATASET})")
    ap.add_argument("--host", default="localhost")
    ap.add_argument("--make-sample", metavar="FILE", help="write a small Alpaca-format sample and exit")
    ap.add_argument("--precision-dump", metavar="DIR/|FILE.json", help="a folder the server dumps raw logits into "
                    "(its --dump-logits), or a JSON file for top logprobs; first --prompts records")
    ap.add_argument("--precision-compare", nargs=2, metavar=("A", "B"), help="compare two folders or two JSON dumps "
                    "(atol 5e-3)")
    ap.add_argument("--prompts", type=int, default=5, help="precision: records to use")
    ap.add_argument("--every", type=int, default=100, help="precision: every n-th generated position")
    ap.add_argument("--max-new-tokens", type=int, default=300, help="precision: tokens per prompt")
    args = ap.parse_args(argv)
    if args.make_sample:
        make_sample(Path(args.make_sample))
        print(f"wrote {args.make_sample}")
        return 0
    if args.precision_compare:
        return 0 if precision.compare(*map(Path, args.precision_compare)) else 1
    base = f"http://{args.host}:{args.port}"
    if not Path(args.dataset).exists():
        print(f"{args.dataset} not found: pass --dataset FILE (an Alpaca-format JSON list of instruction/input/"
              f"output), or make a small sample with --make-sample {args.dataset}", file=sys.stderr)
        return 2
    items = json.loads(Path(args.dataset).read_text())
    if args.precision_dump:
        prompts, target = [prompt_of(it) for it in items[:args.prompts]], Path(args.precision_dump)
        if target.suffix == ".json":
            precision.dump_top(base, prompts, target, args.every, args.max_new_tokens)
            print(f"wrote {target}")
        else:
            print(f"the server wrote {precision.dump_raw(base, prompts, target, args.max_new_tokens)} files into {target}")
        return 0
    if args.qps is None:
        ap.error("-X/--qps is required")
    Path("testLog").mkdir(exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", handlers=[
        logging.StreamHandler(), logging.FileHandler(f"testLog/test_performance_{time.strftime('%Y-%m-%d-%H_%M')}.log")])
    n_tokens = token_counter(base)
    prompts = [(prompt_of(it), max(1, n_tokens(it["output"]))) for it in items[:int(args.qps * args.test_time)]]
    LOG.info("testcases length is %d", len(prompts))
    results, elapsed = asyncio.run(run(base, prompts, args.qps, int(args.qps * args.test_time)))
    LOG.info("All Tasks Done; Exec Time is %s", elapsed)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"result_{args.qps}_x.json").write_text(json.dumps(results))
    summary = count(results, elapsed)
    (out / f"count_{args.qps}.json").write_text(json.dumps(summary, indent=1))
    LOG.info("count: %s", json.dumps({k: v for k, v in summary.items() if k != "per_request"}))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
