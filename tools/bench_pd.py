"""Prefill/decode disaggregation in one run: one mixed workload (long prompts among short chats,
Poisson arrivals) served by three layouts of this machine's first two cores,

    pd      a prefill agent on core 0 and a decode agent on core 1 (serving_config.agent_roles)
    pd-tcp  the same over tcp (agent_ip 127.0.0.2): KV hand-overs as step frames, as across hosts
    dp      two agents doing both, one core each (data parallel)
    one     one agent on both cores

    python -m tools.bench_pd --config configs/smollm2.yaml --requests 48 --rate 0.6

Prints TTFT and TPOT p50/p99, output tok/s and goodput (requests/s that met both --ttft-slo and
--tpot-slo) per layout, PD's ratios to the better of the other two, and what the KV hand-overs cost
(/metrics: bytes and seconds per 1k prompt tokens).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

from common.cpu import describe
from tools import server_process
from llm_serving.bench.serving import BenchRequest, random_dataset, run_benchmark, summarize

HANDOVER = {"handovers": "llm_serving_kv_handovers_total", "bytes": "llm_serving_kv_handover_bytes_total",
            "seconds": "llm_serving_kv_handover_seconds_sum", "copy": "llm_serving_kv_handover_copy_seconds_total",
            "prompt": "llm_serving_prompt_tokens_total"}
LOCAL, TCP = "127.0.0.1", "127.0.0.2"  # a loopback address that is not "local": tcp, as to another host
LAYOUTS = {"pd": ([[0], [1]], ["prefill", "decode"], LOCAL), "pd-tcp": ([[0], [1]], ["prefill", "decode"], TCP),
           "dp": ([[0], [1]], ["both", "both"], LOCAL), "one": ([[0, 1]], ["both"], LOCAL)}


def workload(n: int, long_share: float, seed: int) -> list[BenchRequest]:
    """`n` requests in a shuffled order: `long_share` of them 800-1600-word prompts (1-2k tokens) with
    64 tokens out, the rest 48-144-word chats with 128 out."""
    n_long = round(n * long_share)
    reqs = random_dataset(n_long, 1200, 64, seed, range_ratio=1 / 3) + random_dataset(n - n_long, 96, 128, seed + 1,
                                                                                       range_ratio=0.5)
    random.Random(seed).shuffle(reqs)
    return reqs


def layout_config(base: Path, name: str, out: Path) -> Path:
    """The base YAML with this layout's agents: ports after the base's first, cores, roles, address."""
    doc = yaml.safe_load(base.read_text())
    sc = doc.setdefault("serving_config", {})
    cores, roles, ip = LAYOUTS[name]
    first = sc.get("agent_ports", [61166])[0]
    sc.update(agent_ports=[first + i for i in range(len(roles))], agent_cores=cores, agent_roles=roles, agent_ip=ip)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _counter(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def goodput(results: list[Any], duration: float, ttft_s: float, tpot_s: float) -> float:
    """Requests/s that met both targets (TPOT over the tokens after the first)."""
    met = [r for r in results if r.ok and r.ttft <= ttft_s
           and (r.output_tokens < 2 or (r.latency - r.ttft) / (r.output_tokens - 1) <= tpot_s)]
    return len(met) / duration


def run_layout(name: str, config: Path, reqs: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    base, model = server_process.endpoint(str(config))
    proc = server_process.start_server(["--config", str(config)], Path(f"/tmp/bench_pd_{name}.log"))
    try:
        asyncio.run(run_benchmark(workload(2, 0.5, 99), "openai", base, model, float("inf"), 1.0, None, 0, progress=False))
        moved = {k: _counter(base, metric) for k, metric in HANDOVER.items()}
        results, duration = asyncio.run(run_benchmark(reqs, "openai", base, model, args.rate, 1.0, None, args.seed))
        s = summarize(results, duration)
        s["goodput"] = goodput(results, duration, args.ttft_slo, args.tpot_slo)
        s.update({k: _counter(base, HANDOVER[k]) - v for k, v in moved.items()})
        return s
    finally:
        proc.terminate()
        proc.wait(60)


def report(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n## Prefill/decode disaggregation: {args.requests} requests ({args.long_share:.0%} long) at "
          f"{args.rate} req/s, Poisson; {describe()}")
    print(f"Goodput: requests/s with TTFT <= {args.ttft_slo} s and TPOT <= {args.tpot_slo * 1000:.0f} ms.\n")
    print("| layout | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s | goodput (req/s) | failed |")
    print("|---|---|---|---|---|---|")
    for name, s in runs.items():
        print(f"| {name} | {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | {s['median_tpot_ms']:.1f} / "
              f"{s['p99_tpot_ms']:.1f} | {s['output_throughput']:.1f} | {s['goodput']:.3f} | {s['failed']} |")
    others = [s for n, s in runs.items() if not n.startswith("pd")]
    if "pd" in runs and others:
        pd = runs["pd"]
        best_tpot = min(s["p99_tpot_ms"] for s in others)
        best_good = max(s["goodput"] for s in others)
        best_tok = max(s["output_throughput"] for s in others)
        best_ttft = min(s["p99_ttft_ms"] for s in others)
        print(f"\nPD vs the better other: TPOT p99 {pd['p99_tpot_ms'] / best_tpot:.2f}x, goodput "
              f"{pd['goodput'] / best_good if best_good else float('inf'):.2f}x, output tok/s "
              f"{pd['output_throughput'] / best_tok:.2f}x, TTFT p99 {pd['p99_ttft_ms'] / best_ttft:.2f}x")
    for name in [n for n in runs if n.startswith("pd")]:
        pd, k = runs[name], runs[name]["prompt"] / 1000 or 1
        print(f"{name} hand-overs: {pd['handovers']:.0f} of {pd['prompt']:.0f} prompt tokens; per 1k of them "
              f"{pd['bytes'] / 2**20 / k:.1f} MiB, {pd['copy'] * 1000 / k:.1f} ms of copies on the agents, "
              f"{pd['seconds'] * 1000 / pd['handovers'] if pd['handovers'] else 0:.0f} ms from the export's reply to "
              "the import's per hand-over (waiting for the decode agent's next step included)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_pd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--layouts", default="pd,dp,one")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--rate", type=float, default=0.6, help="requests/s (Poisson)")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    reqs = workload(args.requests, args.long_share, args.seed)
    folder = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    runs = {}
    for name in args.layouts.split(","):
        runs[name] = run_layout(name, layout_config(Path(args.config), name, folder), reqs, args)
        print(f"{name}: {runs[name]['output_throughput']:.1f} tok/s, TPOT p99 {runs[name]['p99_tpot_ms']:.1f} ms",
              file=sys.stderr, flush=True)
    report(runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
