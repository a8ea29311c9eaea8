"""How much one server process drives: the real server attached to N simulated agents (tools/sim_agent.py:
the real protocol over ZeroMQ and shared memory, steps that cost nothing), streaming clients at
once, and what the server sustains: output tok/s, requests/s and its event loop's lag (/metrics),
at each N. The agents cost nothing, so what limits these numbers is the server (and the client
beside it on the same cores: its own share is printed too).

    python -m tools.bench_ceiling [--agents 1,4,16,64] [--streams 4] [--requests 4] [--output-len 128]

--streams: concurrent streams per agent; --requests: requests per stream slot over the run.
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from common.cpu import describe
from common.procs import cpu_seconds
from llm_serving.bench import lifecycle, server_process
from llm_serving.bench.serving import random_dataset, run_benchmark, summarize

FIRST_PORT = 61300


def lag_buckets(base: str) -> dict[float, float]:
    """The event-loop lag histogram's cumulative counts by bucket bound (/metrics)."""
    prefix = 'llm_serving_event_loop_lag_seconds_bucket{le="'
    return {float(k[len(prefix):-2]): v for k, v in lifecycle.samples(base).items()
            if k.startswith(prefix) and "+Inf" not in k}


def p99(before: dict[float, float], after: dict[float, float]) -> float:
    """The bucket bound under which 99% of the run's lag probes fell (seconds; inf past the last)."""
    delta = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}  # cumulative counts
    total = max(delta.values(), default=0.0)
    return next((le for le, n in delta.items() if total and n >= 0.99 * total), float("inf"))


def one_size(cfg_path: Path, n: int, args: argparse.Namespace, folder: Path) -> dict:
    base, model = server_process.endpoint(str(cfg_path))
    sims = subprocess.Popen([sys.executable, "-m", "tools.sim_agent", "--config", str(cfg_path)], cwd=server_process.ROOT,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert "ready" in sims.stdout.readline()
        server = server_process.start_server(["--config", str(cfg_path), "--attach"], folder / f"server-{n}.log")
        try:
            concurrency = n * args.streams
            reqs = random_dataset(concurrency * args.requests, 16, args.output_len, seed=n)
            asyncio.run(run_benchmark(reqs[:concurrency], "openai", base, model, float("inf"), 1.0, concurrency, 0,
                                      progress=False))  # warm
            lag0, cpu0, sim0 = lag_buckets(base), cpu_seconds(server.pid), cpu_seconds(sims.pid)
            client0, t0 = time.process_time(), time.perf_counter()
            results, wall = asyncio.run(run_benchmark(reqs, "openai", base, model, float("inf"), 1.0, concurrency, 0,
                                                      progress=False))
            s = summarize(results, wall)
            s.update(agents=n, concurrency=concurrency, lag_p99_s=p99(lag0, lag_buckets(base)),
                     server_cpu=(cpu_seconds(server.pid) - cpu0) / (time.perf_counter() - t0),
                     agents_cpu=(cpu_seconds(sims.pid) - sim0) / (time.perf_counter() - t0),
                     client_cpu=(time.process_time() - client0) / (time.perf_counter() - t0))
            return s
        finally:
            server.terminate()
            server.wait(60)
    finally:
        sims.terminate()
        sims.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--agents", default="1,4,16,64")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="bench-ceiling-"))
    rows = []
    for n in (int(x) for x in args.agents.split(",")):
        doc = yaml.safe_load(Path(args.config).read_text())
        # keep-alive 30 s: the client on the same cores reads a stream seconds after the server wrote
        # it, and at uvicorn's 5 s the server closed a connection the client then sent its next
        # request on (httpx's ReadError, 1 of 512 requests at 64 agents; none at 30 s)
        doc["serving_config"].update(agent_ports=[FIRST_PORT + i for i in range(n)], http_keepalive_timeout_s=30)
        doc["pa_config"]["num_blocks"] = 512
        path = folder / f"agents-{n}.yaml"
        path.write_text(yaml.safe_dump(doc))
        rows.append(one_size(path, n, args, folder))
        print(f"{n} agents: {rows[-1]['output_throughput']:.0f} tok/s", file=sys.stderr, flush=True)
    print(f"# one server, simulated agents, {args.streams} streams per agent, {args.output_len} tokens each; {describe()}")
    print("| agents | streams | output tok/s | requests/s | TTFT p50 (ms) | loop lag p99 (ms) | CPU (cores): server / "
          "simulated agents / client | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for s in rows:
        print(f"| {s['agents']} | {s['concurrency']} | {s['output_throughput']:.0f} | {s['request_throughput']:.1f} | "
              f"{s['median_ttft_ms']:.0f} | {s['lag_p99_s'] * 1e3:.1f} | {s['server_cpu']:.2f} / {s['agents_cpu']:.2f} / "
              f"{s['client_cpu']:.2f} | "
              f"{s['failed']} |")
    for e in sorted({e for s in rows for e in s["errors"]}):
        print(f"error: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
