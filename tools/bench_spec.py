"""Speculative decoding A/B in one run: the same server with speculative_config off and with each
method on, greedy, on three workloads at batch sizes B:

- `copy`: answers that repeat their prompt (correct a paragraph's spelling, extend a JSON record,
  continue regular code), where prompt lookup drafts well;
- `chat`: ordinary questions, whose answers repeat little (what a draft model is for);
- `random`: random-word prompts (`tools/bench_serving.random_dataset`), where it finds little.

    python -m tools.bench_spec --config configs/smollm2.yaml --batches 1,8,64

Per workload, B and mode: TPOT and output tok/s (client side), drafts proposed and kept and tokens
per drafting row (from /metrics), and whether every greedy text equals speculation off's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from common.cpu import describe
from tools import server_process
from llm_serving.bench.serving import BenchRequest, random_dataset, run_benchmark

PARAGRAPHS = [
    "The libary opened at nine every morning, and the first visiters were usualy students who needed a quiet "
    "place to study before there classes. The librarian kept a list of new books on a small board near the door.",
    "Our team meets on Tuesdays to revew the progress of each project. We discus what went well, what could be "
    "improved, and which tasks shoud be finished before the next meeting. Notes are shared with everyone after.",
    "Rivers carry water from the mountians to the sea, shaping valleys and feeding farms along the way. In the "
    "spring, melting snow makes the rivers rise, and the towns near the banks prepare for floods.",
    "A good recipe lists its ingredents first, then the steps in order. Each step should say how long it takes "
    "and what the cook should see when it is done, so that a begginer can follow it without guessing.",
]
RECORD = {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for": "the first published "
          "algorithm", "languages": ["English", "French"], "city": "London"}
CODE = ("def area_square(side):\n    return side * side\n\n\ndef area_rectangle(width, height):\n    return width * "
        "height\n\n\ndef area_triangle(base, height):\n    return base * height / 2\n\n\ndef area_")


def copy_prompts(n: int) -> list[str]:
    """Prompts whose answers repeat them: corrections, a JSON record extended, regular code continued."""
    kinds = [f"Correct the spelling in this paragraph and write it out again in full.\n\nParagraph: {p}\n\n"
             f"Corrected paragraph:" for p in PARAGRAPHS]
    kinds.append(f"Here is a JSON record:\n{json.dumps(RECORD)}\nWrite the same record again with one more key, "
                 f"\"id\": 7, added at the end:\n")
    kinds.append(CODE)
    return [kinds[i % len(kinds)] for i in range(n)]


QUESTIONS = ["Why is the sky blue?", "Give three tips for sleeping better.", "What does a compiler do?",
             "Describe a good breakfast.", "How do plants make food from sunlight?", "What is a prime number?",
             "Explain what a database index is.", "Why do cats purr?"]


def chat_prompts(n: int, config: str = "configs/smollm2.yaml") -> list[str]:
    """Ordinary questions in the model's chat template, where an answer repeats little of its prompt."""
    from common.config import load_config
    from common.model_files import resolve_model
    from common.tokenizer import load_tokenizer

    cfg = load_config(config)
    tok = load_tokenizer(resolve_model(cfg.model_path, cfg.model_cfg_path), cfg.tokenizer_path)
    return [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(n)]


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def measure(base: str, model: str, reqs: list[BenchRequest], batch: int) -> tuple[dict[str, float], list[str]]:
    before = {k: metric(base, f"llm_serving_spec_{k}") for k in ("draft_tokens_total", "accepted_tokens_total",
                                                                 "tokens_per_step_count", "tokens_per_step_sum")}
    results, duration = asyncio.run(run_benchmark(reqs, "openai", base, model, float("inf"), 1.0, batch, 0,
                                                  progress=False))
    ok = [r for r in results if r.ok]
    assert len(ok) == len(reqs), [r.error for r in results if not r.ok][:3]
    d = {k: metric(base, f"llm_serving_spec_{k}") - v for k, v in before.items()}
    tpot = statistics.mean((r.latency - r.ttft) / max(1, r.output_tokens - 1) for r in ok)
    return {"tpot_ms": 1e3 * tpot, "tok_s": sum(r.output_tokens for r in ok) / duration,
            "drafted": d["draft_tokens_total"], "kept": d["accepted_tokens_total"],
            "per_row": d["tokens_per_step_sum"] / d["tokens_per_step_count"] if d["tokens_per_step_count"] else 1.0
            }, [r.text for r in results]


def workloads(batches: list[int], output_len: int, kinds: list[str],
              config: str = "configs/smollm2.yaml") -> dict[tuple[str, int], list[BenchRequest]]:
    """Per (workload, B): its requests, run B at a time: at least 6 copy or chat and 4 random prompts,
    and up to 3 waves of B (24 requests), so a small batch is measured full, not by its slowest answer."""
    out = {}
    for b in batches:
        n = max(b, min(3 * b, 24))
        for kind in kinds:
            if kind == "random":
                out[(kind, b)] = random_dataset(max(n, 4), 32, output_len, seed=b)
            else:
                prompts = copy_prompts(max(n, 6)) if kind == "copy" else chat_prompts(max(n, 6), config)
                out[(kind, b)] = [BenchRequest(p, len(p.split()), output_len, ignore_eos=False) for p in prompts]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--modes", default="off;ngram;off;ngram", help="server starts in this order, ';'-separated: "
                    "off, a method, or a --speculative-config JSON such as {\"method\": \"ngram\", "
                    "\"num_speculative_tokens\": 3}; a mode started twice gets the median of all its runs "
                    "(alternating starts cancel the machine's drift)")
    ap.add_argument("--workloads", default="copy,random", help="copy, chat (ordinary questions), random")
    ap.add_argument("--peer", help="URL[,model]: measure this running OpenAI server (vLLM with its own "
                    "--speculative-config, say) on the same requests instead of starting ours")
    ap.add_argument("--repeats", type=int, default=1, help="runs per point and server start")
    args = ap.parse_args(argv)
    base, model = server_process.endpoint(args.config)
    batches = [int(b) for b in args.batches.split(",")]
    starts = [m.strip() for m in args.modes.split(";")]
    modes = list(dict.fromkeys(starts))
    loads = workloads(batches, args.output_len, args.workloads.split(","), args.config)
    if args.peer:
        return measure_peer(args.peer, loads)
    runs: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    texts: dict[tuple[str, int, str], list[str]] = {}
    for i, mode in enumerate(starts):
        spec = mode if mode.startswith("{") else json.dumps({"method": mode})
        extra = (["--dtype", args.dtype] if args.dtype else []) + ([] if mode == "off" else ["--speculative-config", spec])
        proc = server_process.start_server(["--config", args.config, *extra], Path(f"/tmp/bench_spec_{i}.log"))
        try:
            measure(base, model, random_dataset(2, 8, 8, seed=0), 2)  # warm the HTTP path
            for (kind, b), reqs in loads.items():
                for _ in range(args.repeats):
                    row, texts[(kind, b, mode)] = measure(base, model, reqs, b)
                    runs.setdefault((kind, b, mode), []).append(row)
                    print(f"{mode} {kind} B={b} {row}", file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    rows = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()}
    report(rows, texts, modes, loads, model, args)
    return 0


def measure_peer(peer: str, loads: dict[tuple[str, int], list[BenchRequest]]) -> int:
    url, _, model = peer.partition(",")
    measure(url, model or "bench", random_dataset(2, 8, 8, seed=0), 2)  # warm its HTTP path
    print(f"| workload | B | server | TPOT ms | output tok/s |\n|---|---|---|---|---|")
    for (kind, b), reqs in loads.items():
        row, _ = measure(url, model or "bench", reqs, b)
        print(f"| {kind} | {b} | {url} | {row['tpot_ms']:.2f} | {row['tok_s']:.1f} |", flush=True)
    return 0


def report(rows, texts, modes, loads, model, args) -> None:
    print(f"\nspeculative decoding A/B, {model} {args.dtype or 'float32'}, greedy, up to {args.output_len} tokens "
          f"(copy: until EOS), server starts {args.modes}, medians of every run of a mode; {time.strftime('%Y-%m-%d')}; CPU: {describe()}")
    print("| workload | B | speculation | TPOT ms | output tok/s | TPOT vs off | tok/s vs off | drafted | kept "
          "| tokens per drafting row | texts = off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, b in loads:
        off = rows[(kind, b, modes[0])]
        for mode in modes:
            r = rows[(kind, b, mode)]
            same = texts[(kind, b, mode)] == texts[(kind, b, modes[0])]
            print(f"| {kind} | {b} | {mode} | {r['tpot_ms']:.2f} | {r['tok_s']:.1f} | {r['tpot_ms'] / off['tpot_ms']:.3f} "
                  f"| {r['tok_s'] / off['tok_s']:.3f} | {r['drafted']:.0f} | {r['kept']:.0f} | {r['per_row']:.2f} "
                  f"| {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    sys.exit(main())
