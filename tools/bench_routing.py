"""KV-aware routing in one run (serving_config.routing): the same multi-turn chat workload
(tools/bench_multiturn.py) through one agent, then two data-parallel agents routed by least load and
by prefix; and a workload with nothing shared (one turn each, every prompt its own) through the two
agents by prefix, for balance.

    python -m tools.bench_routing [--config configs/smollm2.yaml] [--conversations 12] [--turns 4]

Prints per layout: the share of prompt tokens the agents computed (the rest came from their prefix
caches), TTFT p50/p99, TPOT p50, output tok/s, requests per agent; and prefix routing's ratios to
least load's (the targets: computed share <= 1.05x one agent's, TTFT p50 <= 0.7x least load's, output
tok/s >= least load's; with nothing shared, no agent over 1.5x the other's requests).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from common.cpu import describe
from tools import server_process
from tools.bench_multiturn import conversations, measure


def _config(base: str, ports: list[int], routing: str, folder: Path) -> Path:
    doc = yaml.safe_load(Path(base).read_text())
    doc["serving_config"].update(agent_ports=ports, routing=routing)
    path = folder / f"{routing}-{len(ports)}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _serve(config: Path, log: Path, model: str, output_len: int, workloads: dict[str, Callable]) -> dict[str, dict]:
    """Each workload (made fresh: a run fills its conversations' turns) through one server start."""
    base, _ = server_process.endpoint(str(config))
    proc = server_process.start_server(["--config", str(config)], log)
    try:
        return {name: measure(base, model, convs(), output_len) for name, convs in workloads.items()}
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--think-s", type=float, default=2.0)
    ap.add_argument("--stagger-s", type=float, default=8.0)
    args = ap.parse_args(argv)
    _, model = server_process.endpoint(args.config)
    port = yaml.safe_load(Path(args.config).read_text())["serving_config"]["agent_ports"][0]
    chat = lambda: conversations(args.conversations, args.turns, args.system_words, 40, args.think_s,  # noqa: E731
                                 args.stagger_s, 0)
    alone = lambda: conversations(2 * args.conversations, 1, args.system_words, 40, 0, args.stagger_s, 1)  # noqa: E731
    # every conversation on one system prompt, all at once: the agent holding it is soon loaded past the bound
    hot = lambda: conversations(2 * args.conversations, 2, args.system_words, 40, args.think_s, 0, 2, shared=True)  # noqa: E731
    folder = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    one = _config(args.config, [port], "prefix", folder)
    runs = {"one agent": _serve(one, folder / "one.log", model, args.output_len, {"chat": chat})}
    for routing in ("least_load", "prefix"):
        runs[routing] = _serve(_config(args.config, [port, port + 1], routing, folder), folder / f"{routing}.log", model,
                               args.output_len, {"chat": chat, "nothing shared": alone, "one hot prefix": hot})
    report(runs, args)
    return 0


def report(runs: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    print(f"# {args.conversations} conversations x {args.turns} turns, ~{args.system_words}-word system prompts, "
          f"{args.output_len} tokens a turn, think ~{args.think_s:g} s; {describe()}")
    print("| layout | workload | prompt computed | TTFT p50 / p99 (ms) | TPOT p50 (ms) | output tok/s | requests per agent |")
    print("|---|---|---|---|---|---|---|")
    for layout, workloads in runs.items():
        for name, s in workloads.items():
            print(f"| {layout} | {name} | {s.get('prompt_computed_share', 0):.3f} | {s['ttft_p50_ms']:.0f} / "
                  f"{s['ttft_p99_ms']:.0f} | {s['tpot_p50_ms']:.1f} | {s['output_tok_s']:.1f} | "
                  f"{', '.join(f'{v:.0f}' for v in s.get('agent_requests', []))} |")
    one, least, prefix = runs["one agent"]["chat"], runs["least_load"]["chat"], runs["prefix"]["chat"]
    shared = runs["prefix"]["nothing shared"].get("agent_requests") or [1]
    print(f"\nprefix vs one agent, prompt computed: {prefix['prompt_computed_share'] / one['prompt_computed_share']:.2f}x "
          f"(least load: {least['prompt_computed_share'] / one['prompt_computed_share']:.2f}x); prefix vs least load: "
          f"TTFT p50 {prefix['ttft_p50_ms'] / least['ttft_p50_ms']:.2f}x, output tok/s "
          f"{prefix['output_tok_s'] / least['output_tok_s']:.2f}x; nothing shared, busiest agent / other: "
          f"{max(shared) / max(1, min(shared)):.2f}x")
    past = runs["prefix"]["one hot prefix"]
    print(f"one hot prefix, prefix routing: {past.get('routed_past_prefix', 0):.0f} requests went to the least loaded agent "
          f"past the one holding their prefix, computing {past.get('routed_past_prefix_tokens', 0):.0f} prompt tokens "
          f"again (what copying the prefix's KV would save) of {past.get('prompt_tokens', 0):.0f}")
    failed = sum(s["failed"] for w in runs.values() for s in w.values())
    if failed:
        print(f"{failed} turns failed", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
