"""LoRA serving cost in one run: the same model served without adapters, and with N random adapters
of rank R (tools/lora_adapter.py) loaded, under the same load: B requests all at once (random prompts,
fixed output lengths), on the base model and spread evenly over the adapters.

    python -m tools.bench_lora --config configs/smollm2.yaml --adapters 4 --rank 16 [--dtype int8]

Prints output tok/s of each run and its ratio to the base model served without adapters, and what
the adapters add to the agent's weights (/stats).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from common.cpu import describe
from tools import server_process
from llm_serving.bench.serving import random_dataset, run_benchmark
from tools.lora_adapter import model_config, random_adapter


async def _load(base: str, models: list[str], n: int, input_len: int, output_len: int) -> float:
    """Output tok/s of `n` requests sent at once, spread evenly over `models`."""
    share = [random_dataset(n // len(models), input_len, output_len, seed=i) for i in range(len(models))]
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(run_benchmark(reqs, "openai", base, m, float("inf"), 1.0, len(reqs), 0, progress=False)
                                  for m, reqs in zip(models, share)))
    wall = time.perf_counter() - t0
    results = [r for rs, _ in runs for r in rs]
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    return sum(r.output_tokens for r in results) / wall


def _weights(base: str) -> int:
    return int(httpx.get(f"{base}/stats", timeout=30).json()["memory"][0]["weight_bytes"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--starts", default="off;lora;off;lora", help="server starts in order (medians per mode)")
    ap.add_argument("--dtype", default="float32", help="model_dtype of every start (int8: float adapters beside int8 rows)")
    args = ap.parse_args(argv)
    base, model = server_process.endpoint(args.config)
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    config = model_config(yaml.safe_load(Path(args.config).read_text())["model_config"].get("model_path") or "smollm2")
    names = [f"ft{i}" for i in range(args.adapters)]
    for i, n in enumerate(names):
        random_adapter(folder / n, config, args.rank, seed=i)
    runs: dict[str, list[float]] = {}
    weights: dict[str, int] = {}
    for i, mode in enumerate(args.starts.split(";")):
        extra = ["--lora-modules", *(f"{n}={folder / n}" for n in names), "--max-loras", str(args.adapters),
                 "--max-lora-rank", str(args.rank)] if mode == "lora" else []
        proc = server_process.start_server(["--config", args.config, "--dtype", args.dtype, *extra],
                                           Path(f"/tmp/bench_lora_{i}.log"))
        try:
            asyncio.run(_load(base, [model], 2, 8, 8))  # warm the HTTP path
            weights[mode] = _weights(base)
            loads = {"off": {"base": [model]}, "lora": {"base": [model], "adapters": names}}[mode]
            for kind, models in loads.items():
                tok_s = asyncio.run(_load(base, models, args.requests, args.input_len, args.output_len))
                runs.setdefault(f"{mode}/{kind}", []).append(tok_s)
                print(f"{mode} {kind}: {tok_s:.1f} tok/s", file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    report(runs, weights, model, args)
    return 0


def report(runs: dict[str, list[float]], weights: dict[str, int], model: str, args: argparse.Namespace) -> None:
    med = {k: statistics.median(v) for k, v in runs.items()}
    off = med["off/base"]
    print(f"\nLoRA cost, {model} {args.dtype}, {args.requests} x {args.input_len}/{args.output_len} all at once, "
          f"{args.adapters} adapters of rank {args.rank}, starts {args.starts} (medians); {time.strftime('%Y-%m-%d')}; "
          f"CPU: {describe()}")
    print("| server | requests on | output tok/s | vs no adapters |")
    print("|---|---|---|---|")
    for key, label in (("off/base", "no adapters"), ("lora/base", f"{args.adapters} adapters loaded"),
                       ("lora/adapters", f"{args.adapters} adapters loaded")):
        server, kind = label, "the base model" if key.endswith("base") else "the adapters, evenly"
        print(f"| {server} | {kind} | {med[key]:.1f} | {med[key] / off:.3f} |")
    extra = weights.get("lora", 0) - weights.get("off", 0)
    print(f"\nweights: {weights.get('off', 0) / 2**20:.1f} MiB without adapters, +{extra / 2**20:.1f} MiB with "
          f"{args.adapters} slots ({extra / max(args.adapters, 1) / 2**20:.1f} MiB a slot)")


if __name__ == "__main__":
    sys.exit(main())
