"""Scale benchmark: one server on a real-size model, started as a new user starts it. Prints the
CPU, the `--dry-run` plan against the measured peak RSS of the process tree, time to ready, one
stream's TTFT/TPOT, N requests all at once (llm-bench), and one stream's step time against the
weight-streaming limit (bytes a decode step reads / read bandwidth of this machine's cores).

    python -m tools.export_model --random --shape llama-7b --dtype bf16 --gguf "" --out .peers/models/llama-7b
    python -m tools.bench_scale --model .peers/models/llama-7b --dtype bfloat16 --kv-cache-memory 4.1GiB
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


import httpx
import yaml

from common.cpu import describe, read_bandwidth
from tools import server_process

ROOT = Path(__file__).resolve().parent.parent


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(kids.get(p, []))
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def bench(url: str, n: int, input_len: int, output_len: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    subprocess.run([sys.executable, "-m", "llm_serving.bench.serving", "--base-url", url, "--backend", "tgi",
                    "--num-prompts", str(n), "--input-len", str(input_len), "--output-len", str(output_len),
                    "--save-result", str(out)], cwd=ROOT, check=True, capture_output=True)
    return json.loads(out.read_text())["summary"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", default="4.1GiB", help="serving_config.kv_cache_memory")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=8899)
    args = ap.parse_args(argv)

    config = Path(tempfile.mkdtemp()) / "scale.yaml"
    config.write_text(yaml.safe_dump({
        "model_config": {"model_name": Path(args.model).name, "model_path": args.model, "model_dtype": args.dtype,
                         "seq_length": [128, 512], "decode_batch_size": [1, 4, 16], "prefill_batch_size": [4]},
        "serving_config": {"server_port": args.port, "agent_ports": [args.port + 1],
                           "kv_cache_memory": args.kv_cache_memory},
        "pa_config": {"num_blocks": "auto", "block_size": 16, "decode_seq_length": 2048}}))
    plan = subprocess.run([sys.executable, "-m", "llm_serving.serve", "--config", str(config), "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True).stdout
    print(f"CPU: {describe()}\n{plan}", flush=True)
    planned = float(next(x for x in plan.splitlines() if x.startswith("per agent:")).split()[2]) * 2**30

    log = config.with_suffix(".log")
    t0 = time.monotonic()
    peaks = [0]
    try:
        proc = server_process.start_server(["--config", str(config)], log,
                                           while_waiting=lambda p: peaks.append(tree_rss(p.pid)))
    except RuntimeError as e:
        print(e)
        return 1
    peak, ready = max(peaks), time.monotonic() - t0
    url = f"http://127.0.0.1:{args.port}"
    try:
        stats = httpx.get(f"{url}/stats", timeout=30).json()
        weights = stats["memory"][0]["weight_bytes"]
        sampler = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not sampler.wait(0.5):
                peak = max(peak, tree_rss(proc.pid))

        threading.Thread(target=sample, daemon=True).start()
        one = bench(url, 1, args.input_len, args.output_len)
        many = bench(url, args.num_prompts, args.input_len, args.output_len)
        sampler.set()
    finally:
        proc.terminate()
        proc.wait(60)
    bw = read_bandwidth(len(os.sched_getaffinity(0)))
    limit = stats["memory"][0]["streamed_bytes"] / bw
    print(f"model {args.model} ({args.dtype}); kernels: {stats['memory'][0]['kernels']}")
    print(f"| ready | peak RSS (tree) | plan | weights | KV | one stream TTFT / TPOT | {args.num_prompts} x "
          f"{args.input_len}/{args.output_len}: out tok/s, TTFT p99 | B=1 step vs streaming limit |")
    print(f"| {ready:.0f} s | {peak / 2**30:.2f} GiB | {planned / 2**30:.2f} GiB ({peak / planned:.2f}x) | "
          f"{weights / 2**30:.2f} GiB | {stats['memory'][0]['kv_cache_bytes'] / 2**30:.2f} GiB | "
          f"{one['mean_ttft_ms'] / 1e3:.2f} s / {one['mean_tpot_ms']:.0f} ms | {many['output_throughput']:.1f}, "
          f"{many['p99_ttft_ms'] / 1e3:.1f} s | {one['mean_tpot_ms']:.0f} ms vs {limit * 1e3:.0f} ms "
          f"({one['mean_tpot_ms'] / 1e3 / limit:.2f}x; {bw / 1e9:.1f} GB/s) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
