"""IPC overhead per step (ZeroMQ + shared memory, real agent process) next to the model's decode
step time, as a ratio in one run.

Measures: heartbeat round trip; an empty `a` step (the full step path with no rows); writing a
64-row decode step into the arena; a real batch-32 decode step of the default model.

    python -m tools.bench_ipc [--config configs/smollm2.yaml] [--n 200] [--transport ipc|tcp|curve]

`--transport tcp` runs the agent on tcp 127.0.0.2 (tensors as frames), `curve` the same with CURVE
keys (authentication and encryption, shm/curve.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


import numpy as np

from llm_serving.agents import start_agents, stop_agents
from common.config import load_config
from llm_serving.boot import connect_agents
from server.sampling_params import SamplingParams
from shm.step import RowInput, StepDims
from shm import protocol as P
from tools.curve_keys import make


def median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--transport", choices=["ipc", "tcp", "curve"], default="ipc")
    args = ap.parse_args(argv)
    overrides: dict = {"warmup": False}
    if args.transport != "ipc":
        overrides["agent_ip"] = "127.0.0.2"
    if args.transport == "curve":
        keys = Path(tempfile.mkdtemp(prefix="llm-serving-curve-"))
        make(keys)
        overrides["curve_keys"] = str(keys)
    cfg = load_config(args.config, **overrides)
    procs = start_agents(cfg, args.config, overrides)
    [client] = connect_agents(cfg)
    try:
        bs, width = cfg.block_size, 8
        greedy = SamplingParams()

        def rows(n: int) -> list[RowInput]:
            return [RowInput(i, np.asarray([11], np.int32), 100, list(range(1 + i * width, 1 + (i + 1) * width)),
                             True, greedy, 100, 0) for i in range(n)]

        def step(dims: StepDims) -> dict:
            client.send_step(dims, [], has_prefill=True)  # rows carry their tokens: `*`
            body = client.poll_step(600)
            assert body is not None
            return body

        heartbeat = median_us(lambda: client.call(P.HEARTBEAT), args.n)
        empty = median_us(lambda: step(StepDims(0, 0, 0)), args.n)
        rows64 = rows(64)
        write64 = median_us(lambda: client.arenas[0].write_step(rows64, bs), args.n)
        dims = client.arenas[0].write_step(rows(args.decode_batch), bs)
        step(dims)  # compile this shape
        walls, models = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            body = step(dims)
            walls.append(time.perf_counter() - t0)
            models.append(body.model_s)
        decode_us = statistics.median(walls) * 1e6
        ipc = empty + write64
        print(f"transport: {args.transport}")
        print(f"heartbeat round trip           {heartbeat:10.1f} us")
        print(f"empty 'a' step round trip      {empty:10.1f} us")
        print(f"write 64-row decode step       {write64:10.1f} us")
        print(f"decode step B={args.decode_batch:<3} (wall)        {decode_us:10.1f} us "
              f"(model {statistics.median(models) * 1e6:.0f} us)")
        print(f"IPC overhead / decode step     {ipc / decode_us * 100:10.3f} %  (target <= 2%)")
    finally:
        client.close()
        stop_agents(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
