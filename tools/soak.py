"""Soak: mixed traffic for a fixed time while the server's and the agents' memory is sampled.

    python -m tools.soak --config configs/smollm2.yaml --minutes 60 [--clients 6] [--dtype bfloat16] [--kinds json,n2]

Starts `llm-serving` on the config (loopback), then each client thread loops over ten request
kinds (`--kinds` picks some, to bisect growth by kind): completions greedy / seeded sampling /
logprobs / stop strings and penalties / echo with prompt logprobs / n=2 with logprobs, chat, chat
constrained to a JSON schema, TGI generate with details, and TGI streams (the client leaves one in
five after a few events), prompts of random lengths. Every 10 s it records each process's RSS.
Prints the curve a minute a line, requests by outcome, and each process's RSS at the end against
its value after the warm-up (`--warmup-minutes`, 5): a flat process stays within 2%; and each
agent's against its memory plan (`/stats`). Exit 1 on a request that hung or a 5xx answer.
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


from tools.fault_inject import ROOT, agent_pids, start_server

WORDS = ["alpha", "beta", "gamma", "delta", "serving", "memory", "token", "paris", "river", "stone"]


def rss_mb(pid: int) -> float:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096 / 2**20
    except OSError:
        return float("nan")


SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
          "required": ["word", "count"]}


def bodies(text: str, new: int, rng: random.Random) -> dict[str, tuple[str, dict]]:
    """Each request kind's path and body."""
    chat = [{"role": "user", "content": text}]
    return {
        "greedy": ("/v1/completions", {"prompt": text, "max_tokens": new, "temperature": 0}),
        "sampled": ("/v1/completions", {"prompt": text, "max_tokens": new, "temperature": 0.9, "top_p": 0.9,
                                        "seed": rng.randint(0, 99)}),
        "logprobs": ("/v1/completions", {"prompt": text, "max_tokens": new, "logprobs": 3}),
        "penalties": ("/v1/completions", {"prompt": text, "max_tokens": new, "stop": ["gamma", "."],
                                          "frequency_penalty": 0.5, "repetition_penalty": 1.2}),
        "chat": ("/v1/chat/completions", {"messages": chat, "max_tokens": new}),
        "tgi": ("/generate", {"inputs": text, "parameters": {"max_new_tokens": new, "details": True}}),
        "echo": ("/v1/completions", {"prompt": text, "max_tokens": new, "echo": True, "logprobs": 1}),
        "stream": ("/generate_stream", {"inputs": text, "parameters": {"max_new_tokens": new}}),
        "json": ("/v1/chat/completions", {"messages": chat, "max_tokens": 48, "temperature": 0.7,
                                          "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "w", "schema": SCHEMA}}}),
        "n2": ("/v1/completions", {"prompt": text, "max_tokens": new, "n": 2, "temperature": 0.8, "logprobs": 2}),
    }


KINDS = list(bodies("", 1, random.Random()))
CUT_STREAMS = 0.2  # of streams, the client leaves after a few events


def one(url: str, rng: random.Random, kinds: list[str]) -> str:
    """One request of a random kind: its outcome ('ok', 'left', 'http NNN', 'hung', an error name)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 200)))
    kind = rng.choice(kinds)
    path, body = bodies(text, rng.randint(4, 96), rng)[kind]
    try:
        if kind != "stream":
            r = httpx.post(url + path, json=body, timeout=300)
            return "ok" if r.status_code == 200 else f"http {r.status_code}"
        leave_after = rng.randint(1, 4) if rng.random() < CUT_STREAMS else None
        with httpx.stream("POST", url + path, json=body, timeout=300) as r:
            if r.status_code != 200:
                return f"http {r.status_code}"
            for i, _ in enumerate(r.iter_lines()):
                if leave_after is not None and i >= leave_after:
                    return "left"
        return "ok"
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/smollm2.yaml"))
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--warmup-minutes", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", help="model_config.model_dtype (llm-serving --dtype), else the config's")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"request kinds, comma-separated (all: {','.join(KINDS)})")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(unknown)}; known: {KINDS}")
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    proc, url = start_server(Path(args.config), log, 900, *(["--dtype", args.dtype] if args.dtype else []))
    planned = [m["planned_bytes"] / 2**20 for m in httpx.get(f"{url}/stats", timeout=30).json()["memory"]]
    pids = {"server": proc.pid, **{f"agent{i}": p for i, p in enumerate(agent_pids(proc.pid))}}
    stop, outcomes, lock = threading.Event(), collections.Counter(), threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        while not stop.is_set():
            result = one(url, rng, kinds)
            with lock:
                outcomes[result] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    start, samples = time.monotonic(), []
    try:
        while (elapsed := time.monotonic() - start) < args.minutes * 60:
            samples.append((elapsed, {name: rss_mb(pid) for name, pid in pids.items()}))
            stop.wait(10.0)
    finally:
        stop.set()
        for t in threads:
            t.join(330)
        proc.terminate()
        proc.wait(60)
    print(f"soak {args.minutes:g} min, {args.clients} clients, log {log}")
    print("minute  " + "  ".join(f"{n:>10}" for n in pids) + "   (RSS, MiB)")
    for elapsed, rss in samples[::6]:
        print(f"{elapsed / 60:6.1f}  " + "  ".join(f"{rss[n]:10.1f}" for n in pids))
    base = next(r for e, r in samples if e >= args.warmup_minutes * 60) if samples[-1][0] >= args.warmup_minutes * 60 \
        else samples[0][1]
    last = samples[-1][1]
    for n in pids:
        print(f"{n}: {base[n]:.1f} -> {last[n]:.1f} MiB after warm-up ({(last[n] / base[n] - 1) * 100:+.2f}%)")
    for i, plan in enumerate(planned):
        if plan:
            print(f"agent{i} at the end: {last[f'agent{i}'] / plan * 100:.0f}% of its memory plan ({plan:.1f} MiB)")
    print("requests: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    return 1 if outcomes["hung"] or any(k.startswith("http 5") for k in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
