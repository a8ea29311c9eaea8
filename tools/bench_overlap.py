"""Overlap A/B in one run: the same server with `overlap_steps` off and on, B concurrent streams of
fixed length each, B in --batches.

    python -m tools.bench_overlap --config configs/smollm2.yaml --batches 1,8,64

Per mode and B: decode TPOT and output tok/s (client side), and from /debug/trace the share of
decode wall time spent outside the model's own compute: over consecutive decode steps, (gaps
between steps + step wall - the agent's model_s) / (gaps + step walls). Steps run back to back, so
this is 1 - model time / decode span.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


from common.cpu import describe
from tools import server_process
from llm_serving.bench.serving import random_dataset, run_benchmark

ROOT = Path(__file__).resolve().parent.parent


def start_server(config: str, extra: list[str], log: Path) -> subprocess.Popen:
    return server_process.start_server(["--config", config, *extra], log)


def decode_overhead(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Share of decode time outside the model, from the trace's step records (pairs of decode steps)."""
    gaps = wall = model = 0.0
    n = 0
    for a, b in zip(steps, steps[1:]):
        if a["kind"] == b["kind"] == "decode":
            gaps += max(0.0, b["start"] - a["end"])
            wall += b["end"] - b["start"]
            model += b["model_s"]
            n += 1
    span = gaps + wall
    return {"decode_steps": n, "share_outside_model": (span - model) / span if span else float("nan"),
            "share_gaps": gaps / span if span else float("nan"), "step_ms": 1e3 * wall / max(n, 1),
            "model_ms": 1e3 * model / max(n, 1)}


def trace_steps(base: str, since: float) -> list[dict[str, Any]]:
    events = httpx.get(f"{base}/debug/trace", timeout=30).json()["traceEvents"]
    steps = sorted((e["args"] for e in events if e.get("pid") == 1 and "sent" in e.get("args", {})),
                   key=lambda s: s["start"])
    return [s for s in steps if s["sent"] >= since]


def measure(base: str, model: str, batch: int, input_len: int, output_len: int) -> dict[str, float]:
    reqs = random_dataset(batch, input_len, output_len, seed=batch)
    since = time.monotonic()
    results, duration = asyncio.run(run_benchmark(reqs, "openai", base, model, float("inf"), 1.0, None, 0,
                                                  progress=False))
    ok = [r for r in results if r.ok]
    assert len(ok) == batch, [r.error for r in results if not r.ok][:3]
    tpot = sum((r.latency - r.ttft) / max(1, r.output_tokens - 1) for r in ok) / len(ok)
    out = {"tpot_ms": tpot * 1e3, "tok_s": sum(r.output_tokens for r in ok) / duration}
    return out | decode_overhead(trace_steps(base, since))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--dtype", choices=["float32", "int8"])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=32, help="words per prompt")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="runs per point and server start")
    ap.add_argument("--modes", default="off,on,off,on,off,on",
                    help="server starts in this order; alternating starts and the median of every run "
                         "of a mode cancel the machine's drift")
    args = ap.parse_args(argv)
    base, model = server_process.endpoint(args.config)
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    for mode in args.modes.split(","):
        extra = ["--no-overlap"] if mode == "off" else []
        proc = start_server(args.config, extra + (["--dtype", args.dtype] if args.dtype else []),
                            Path(f"/tmp/bench_overlap_{mode}.log"))
        try:
            measure(base, model, 2, args.input_len, 8)  # warm the HTTP path
            for b in batches:
                for _ in range(args.repeats):
                    runs.setdefault((b, mode), []).append(measure(base, model, b, args.input_len, args.output_len))
                    print(f"{mode:>3} B={b:<3} {runs[(b, mode)][-1]}", file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    rows = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    print(f"\noverlap A/B, {model} {args.dtype or 'float32'}, {args.input_len}-word prompts, {args.output_len} tokens "
          f"each, server starts {args.modes}, medians of {args.repeats} run(s) per start; CPU: {describe()}")
    print("| B | overlap | TPOT ms | output tok/s | step ms | model ms | outside model | of it gaps |")
    print("|---|---|---|---|---|---|---|---|")
    for b in batches:
        for mode in ("off", "on"):
            r = rows[(b, mode)]
            print(f"| {b} | {mode} | {r['tpot_ms']:.2f} | {r['tok_s']:.1f} | {r['step_ms']:.2f} | {r['model_ms']:.2f} "
                  f"| {100 * r['share_outside_model']:.1f}% | {100 * r['share_gaps']:.1f}% |")
        print(f"| {b} | on/off | {rows[(b, 'on')]['tpot_ms'] / rows[(b, 'off')]['tpot_ms']:.3f} "
              f"| {rows[(b, 'on')]['tok_s'] / rows[(b, 'off')]['tok_s']:.3f} | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
