"""The device path's graph building on this CPU: what an Ascend or GPU agent builds (the plain
MindSpore model, no native kernels) for a serving config's step sizes, with the time, the peak RSS
and the target beside it (weights + KV + 1.5 GiB).

    python -m tools.bench_plain --config configs/smollm2.yaml --model smollm2 [--dtype float16]
        [--gather-bytes 268435456] [--run]

`--run` also runs every graph once (MindSpore allocates a graph's buffers at its first run).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace


import agent.model.attention
from agent.graph_call import setup_mindspore
from agent.packing import padding
from agent.runner import ModelRunner
from agent.runner_config import RunnerConfig
from agent.weights.load import load_model
from common.config import load_config
from common.model_files import resolve_model

MiB = 1 << 20


def status(key: str) -> int:
    """/proc/self/status's `key` in MiB (VmRSS, VmHWM)."""
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":")) >> 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--gather-bytes", type=int, default=agent.model.attention.GATHER_BYTES)
    ap.add_argument("--run", action="store_true", help="run every graph once after building it")
    args = ap.parse_args()
    agent.model.attention.GATHER_BYTES = args.gather_bytes
    cfg = load_config(args.config, model_path=args.model, model_dtype=args.dtype)
    model_cfg, weights = load_model(resolve_model(cfg.model_path), cfg.max_model_len)
    setup_mindspore()
    rc = replace(RunnerConfig.from_serving(cfg), native_kernels=False)
    t0 = time.monotonic()
    runner = ModelRunner(model_cfg, weights, rc)
    del weights
    w, kv = runner.model.weight_bytes // MiB, runner.model.kv_cache_bytes // MiB
    print(f"loaded: RSS {status('VmRSS')} MiB (weights {w} MiB, KV {kv} MiB, {args.dtype})", flush=True)
    runner.warmup()
    print(f"{runner.graph_compiles} graphs built in {time.monotonic() - t0:.0f}s: peak RSS {status('VmHWM')} MiB",
          flush=True)
    if args.run:
        for t, r, s in rc.graph_shapes():
            g = padding(t, r, s, rc.width)
            runner._run(g._replace(slots=g.slots + rc.block_size))
        print(f"every graph run once: peak RSS {status('VmHWM')} MiB", flush=True)
    print(f"target (weights + KV + 1.5 GiB): {w + kv + 1536} MiB")


if __name__ == "__main__":
    main()
