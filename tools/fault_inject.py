"""Fault injection: a streaming load while agents are SIGKILLed or SIGSTOPped at random.

    python -m tools.fault_inject --config configs/smollm2.yaml --requests 60 --faults 3

Starts `llm-serving` on the config (loopback only, with a short step timeout so a stopped agent is
found quickly), sends a fixed number of requests of random lengths from a few client threads, and
injects a fixed number of faults spaced over the run. Everything is bounded: each request has a
deadline, the whole run a time limit. Prints requests sent / completed / failed (by reason) / hung,
KV blocks leaked, and shared-memory segments and processes left after SIGTERM; exits 1 unless
hung, leaked and left-over are all 0.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from tools import server_process

ROOT = Path(__file__).resolve().parent.parent


def agent_pids(server_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]


def start_server(config: Path, log: Path, timeout_s: float, *args: str) -> tuple[subprocess.Popen, str]:
    """`llm-serving --config config *args`, ready, and its URL."""
    doc = yaml.safe_load(config.read_text())
    url = f"http://127.0.0.1:{doc['serving_config']['server_port']}"
    try:
        proc = server_process.start_server(["--config", str(config), *args], log, timeout_s)
    except RuntimeError:
        sys.exit(f"server did not start; see {log}")
    return proc, url


def one_request(url: str, rng: random.Random, deadline_s: float) -> str:
    """'completed', 'failed: <reason>' or 'hung'."""
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "serving"]) for _ in range(rng.randint(4, 120)))
    body = {"inputs": words, "parameters": {"max_new_tokens": rng.randint(8, 64), "ignore_eos": True}}
    try:
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=deadline_s) as r:
            if r.status_code != 200:
                return f"failed: HTTP {r.status_code} {r.read().decode()[:80]}"
            for line in r.iter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        return f"failed: {event['error'][:80]}"
                    if event.get("generated_text") is not None:
                        return "completed"
        return "failed: stream ended without a final event"
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError as exc:
        return f"failed: {type(exc).__name__}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/smollm2.yaml"))
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--faults", type=int, default=3)
    ap.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults")
    ap.add_argument("--request-deadline", type=float, default=240.0)
    ap.add_argument("--step-timeout", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="fault-inject-"))
    doc = yaml.safe_load(Path(args.config).read_text())
    sc = doc.setdefault("serving_config", {})
    sc.update(server_ip="127.0.0.1", step_timeout_s=args.step_timeout, recovery_deadline_s=args.request_deadline / 2)
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(doc))
    server, url = start_server(config, tmp / "server.log", 900)
    print(f"server pid {server.pid} at {url}; log {tmp / 'server.log'}", flush=True)
    outcomes: collections.Counter[str] = collections.Counter()
    todo = list(range(args.requests))
    lock = threading.Lock()

    def client(seed: int) -> None:
        crng = random.Random(seed)
        while True:
            with lock:
                if not todo:
                    return
                todo.pop()
            result = one_request(url, crng, args.request_deadline)
            with lock:
                outcomes[result] += 1

    t0 = time.monotonic()
    clients = [threading.Thread(target=client, args=(args.seed * 1000 + i,)) for i in range(args.clients)]
    for t in clients:
        t.start()
    faults = []
    for _ in range(args.faults):
        time.sleep(args.fault_every)
        pids = agent_pids(server.pid)
        if not pids:
            continue
        victim, sig = rng.choice(pids), rng.choice([signal.SIGKILL, signal.SIGSTOP])
        os.kill(victim, sig)
        faults.append(f"{signal.Signals(sig).name} agent pid {victim} at {time.monotonic() - t0:.0f}s")
        print(faults[-1], flush=True)
    for t in clients:
        t.join()
    wall = time.monotonic() - t0
    info, deadline = {}, time.monotonic() + 60
    while time.monotonic() < deadline:
        info = httpx.get(f"{url}/stats", timeout=10).json()
        if info["running"] == 0 and info["waiting"] == 0:
            break
        time.sleep(0.5)
    leaked = round(sum(info["kv_usage"]) * (info["num_blocks"] - 1))
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    restarts = sum(float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("llm_serving_agent_restarts_total"))
    agents = agent_pids(server.pid)
    server.send_signal(signal.SIGTERM)
    server.wait(60)
    segments = [p.name for p in Path("/dev/shm").glob(f"llmserving-{server.pid}-*")]
    alive = [p for p in agents if Path(f"/proc/{p}").exists()]
    hung = outcomes.pop("hung", 0)
    completed = outcomes.pop("completed", 0)
    print(f"\nrequests sent {args.requests}, completed {completed}, failed {sum(outcomes.values())}, hung {hung} "
          f"in {wall:.0f}s; faults {len(faults)}, agent restarts {restarts:.0f}")
    for reason, n in outcomes.most_common():
        print(f"  failed x{n}: {reason}")
    print(f"KV blocks leaked: {leaked}; shared-memory segments left: {len(segments)}; agent processes left: {len(alive)}")
    return 0 if hung == leaked == len(segments) == len(alive) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
