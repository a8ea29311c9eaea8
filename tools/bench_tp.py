"""Tensor parallelism on this host: a model's decode and prefill steps at tensor_parallel_size n
(n rank processes, one core each) against size 1 (one process on the same cores), the collectives'
time per call, and the weights each rank holds, in one run.

    python -m tools.bench_tp --model .peers/models/llama-1b --sizes 1,2 --batches 1,16 --prefill 128

A random 1.1B model: `python -m tools.export_model --random --shape llama-1b --dtype bf16 --out
.peers/models/llama-1b` (weights are read as float32). Each size's ranks run the same steps in lock
step, as agents do; rank 0 reports.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path


import numpy as np

from common.cpu import describe

ROOT = Path(__file__).resolve().parent.parent


def _steps(runner, rows: int, context: int, prefill: int, repeat: int) -> dict[str, float]:
    """Median seconds of a decode step of `rows` sequences at `context` tokens, and of one
    `prefill`-token prompt chunk."""
    from server.sampling_params import SamplingParams
    from shm.arena import Arena, ArenaSpec
    from shm.step import RowInput

    bs = runner.rc.block_size
    per_seq = -(-(context + prefill + repeat + 2) // bs)
    arena = Arena.private(ArenaSpec(max(prefill, rows * 2), rows, per_seq))
    greedy = SamplingParams()

    def run(make_rows) -> float:
        v = arena.step(arena.write_step(make_rows(), bs))
        t0 = time.perf_counter()
        runner.step(v, [])
        return time.perf_counter() - t0

    tables = [list(range(1 + r * per_seq, 1 + (r + 1) * per_seq)) for r in range(rows)]
    for r in range(rows):  # fill each row's context, one prompt chunk at a time
        for start in range(0, context, prefill):
            n = min(prefill, context - start)
            run(lambda: [RowInput(r, np.arange(n, dtype=np.int32) % 100 + 5, start, tables[r], False, greedy,
                                  context, 0)])
    decode = [run(lambda i=i: [RowInput(r, np.asarray([7], np.int32), context + i, tables[r], True, greedy, context, i)
                               for r in range(rows)]) for i in range(repeat)]
    chunk = [run(lambda: [RowInput(0, np.arange(prefill, dtype=np.int32) % 100 + 5, 0, tables[0], True, greedy,
                                   prefill, 0)]) for _ in range(max(2, repeat // 4))]
    return {"decode_s": statistics.median(decode), "prefill_s": statistics.median(chunk)}


def _collectives(lib: str, hidden: int, repeat: int) -> dict[str, float]:
    """Seconds per all-reduce of [rows, hidden] float32 (AllReduce called as the graph calls it)."""
    fn = ctypes.CDLL(lib).AllReduce
    out = {}
    for rows in (1, 16, 128):
        x, y = np.ones((rows, hidden), np.float32), np.empty((rows, hidden), np.float32)
        params = (ctypes.c_void_p * 2)(x.ctypes.data, y.ctypes.data)
        shape = (ctypes.c_int64 * 2)(rows, hidden)
        shapes = (ctypes.POINTER(ctypes.c_int64) * 2)(shape, shape)
        dtypes = (ctypes.c_char_p * 2)(b"float32", b"float32")
        ndims = (ctypes.c_int * 2)(2, 2)
        times = []
        for _ in range(repeat * 10):
            t0 = time.perf_counter()
            assert fn(2, params, ndims, shapes, dtypes, None, None) == 0
            times.append(time.perf_counter() - t0)
        out[f"all_reduce_{rows}x{hidden}_s"] = statistics.median(times)
    return out


def _mccl(rank: int, size: int, port: int, hidden: int, repeat: int, out: str) -> None:
    """Seconds per mindspore.communication all-reduce inside a graph (mccl on CPU), as the
    plain-MindSpore path's ranks call it."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from agent.tensor_parallel import Group, join_mindspore_group

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    join_mindspore_group(Group(rank, size, sched_port=port))

    class Reduce(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.op = ops.AllReduce()

        def construct(self, x: Tensor) -> Tensor:
            return self.op(x)

    net, result = Reduce(), {}
    for rows in (1, 16, 128):
        x = Tensor(np.ones((rows, hidden), np.float32))
        net(x)
        times = []
        for _ in range(repeat * 5):
            t0 = time.perf_counter()
            net(x).asnumpy()
            times.append(time.perf_counter() - t0)
        result[f"mccl_all_reduce_{rows}x{hidden}_s"] = statistics.median(times)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def run_mccl(args: argparse.Namespace, hidden: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "mccl.json"
    code = ("import sys; from tools.bench_tp import _mccl; "
            f"_mccl(int(sys.argv[1]), 2, {port}, {hidden}, {args.repeat}, '{out}')")
    sched = subprocess.Popen([sys.executable, "-c", f"from agent.tensor_parallel import run_scheduler; run_scheduler({port}, 2)"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for r in range(2)]
    ok = all(p.wait(300) == 0 for p in ranks)
    sched.wait(60)
    return json.loads(out.read_text()) if ok else {}


def rank_main(args: argparse.Namespace) -> None:
    """One rank (or size 1): pinned, load, warm up, then the same steps as every other rank."""
    cores = sorted(os.sched_getaffinity(0))
    if args.size > 1:
        os.sched_setaffinity(0, [cores[args.rank % len(cores)]])
    from agent import kernels
    from agent.runner import ModelRunner
    from agent.runner_config import RunnerConfig
    from agent.graph_call import setup_mindspore
    from agent.tensor_parallel import Group, slot_floats
    from agent.weights.load import load_model
    from common.model_files import resolve_model

    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + args.prefill + args.repeat + 16
    cfg, weights = load_model(resolve_model(args.model), max_position=max_len)
    setup_mindspore()
    tokens = sorted({*batches, args.prefill})
    group = Group(args.rank, args.size, args.segment, slot_floats(cfg.hidden_size, cfg.vocab_size, tokens[-1],
                                                                  max(batches), args.size)) if args.size > 1 else Group()
    bs = 16
    per_seq = -(-max_len // bs)
    rc = RunnerConfig(num_blocks=1 + per_seq * max(batches), block_size=bs, max_model_len=per_seq * bs,
                      token_buckets=tokens, max_running=max(batches), model_dtype=args.dtype, tp=group)
    runner = ModelRunner(cfg, weights, rc, seed=0)
    del weights
    runner.warmup()
    result = {"weight_bytes": runner.model.weight_bytes, "kernels": runner.kernel_paths, "steps": {}}
    for b in batches:
        result["steps"][b] = _steps(runner, b, args.context, args.prefill, args.repeat)
    if args.size > 1:
        result.update(_collectives(kernels.library(), cfg.hidden_size, args.repeat))
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(result))


def run_size(args: argparse.Namespace, size: int) -> dict:
    from agent.model_config import ModelConfig  # noqa: F401  (mindspore before protobuf users)
    from agent.tensor_parallel import SEGMENT_DIR, create_segment, slot_floats
    from common.memory import model_shape
    from common.model_files import resolve_model

    out = Path(tempfile.mkdtemp()) / f"tp{size}.json"
    segment = f"llmserving-{os.getpid()}-benchtp{uuid.uuid4().hex[:6]}"
    if size > 1:
        s = model_shape(resolve_model(args.model))
        batches = [int(b) for b in args.batches.split(",")]
        create_segment(segment, size, slot_floats(s.hidden, s.vocab, max(*batches, args.prefill), max(batches), size))
    base = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--batches", args.batches,
            "--context", str(args.context), "--prefill", str(args.prefill), "--repeat", str(args.repeat),
            "--dtype", args.dtype, "--size", str(size), "--segment", segment, "--out", str(out)]
    try:
        procs = [subprocess.Popen([*base, "--rank", str(r)], cwd=ROOT) for r in range(size)]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit(f"a rank of size {size} failed")
    finally:
        (SEGMENT_DIR / segment).unlink(missing_ok=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--segment", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    print(f"CPU: {describe()}; model {args.model} ({args.dtype}); context {args.context}, prefill chunk {args.prefill}")
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {n: run_size(args, n) for n in sizes}
    one = results[sizes[0]]
    print(f"{'size':>4} {'weights/rank':>13} " + " ".join(f"{f'decode B={b} ms':>16}" for b in one["steps"])
          + f" {'prefill ms':>11}")
    for n, r in results.items():
        cells = []
        for b, s in r["steps"].items():
            cells.append(f"{s['decode_s'] * 1e3:8.1f} ({one['steps'][b]['decode_s'] / s['decode_s']:.2f}x)")
        pre = r["steps"][next(iter(r["steps"]))]["prefill_s"]
        ratio = r["weight_bytes"] / one["weight_bytes"]
        print(f"{n:>4} {r['weight_bytes'] / 2**30:7.2f} GiB ({ratio:.2f}x) " + " ".join(f"{c:>16}" for c in cells)
              + f" {pre * 1e3:6.1f} ({one['steps'][next(iter(one['steps']))]['prefill_s'] / pre:.2f}x)")
        for k, v in r.items():
            if k.startswith("all_reduce"):
                print(f"     native {k.removesuffix('_s')}: {v * 1e6:.1f} us")
    if max(sizes) > 1:
        from common.memory import model_shape
        from common.model_files import resolve_model

        for k, v in run_mccl(args, model_shape(resolve_model(args.model)).hidden).items():
            print(f"     {k.removesuffix('_s')} (mindspore.communication, in a graph): {v * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
