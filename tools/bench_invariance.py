"""Batch invariance (serving_config.deterministic) in one run, on the agent's runner in process: eight
prompts, each alone and prefilled whole, against the same prompts among 56 other sequences in 64-row
steps, prefilled in chunks; tokens and logprobs compared bit for bit, with the kernels' deterministic
paths on and off (the same runner: the switch is per process, at run time). Then what the
deterministic paths cost: a 64-row decode step, a 1-row decode step and a prefill step, on and off
in alternating rounds.

    python -m tools.bench_invariance [--model smollm2] [--dtypes float32,bfloat16,int8] [--chunks 16,64,512]

tests/agent/test_batch_invariance.py runs the same comparison on a small random model."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from shm.arena import Arena, ArenaSpec
from shm.step import RowInput

BS, ROWS, NEW, OTHERS_NEW = 16, 64, 8, 40
BUCKETS = [1, 8, 64, 256, 1024]


class Seq:
    """One sequence as a scheduler would drive it: its prompt, the blocks it owns, what it sampled."""

    def __init__(self, sid: int, prompt: list[int], first_block: int, blocks: int, new: int = NEW, adapter: int = 0):
        self.sid, self.prompt, self.tokens, self.fed, self.new = sid, prompt, list(prompt), 0, new
        self.adapter = adapter  # its LoRA adapter's slot + 1 (0: the base model)
        self.table = list(range(first_block, first_block + blocks))
        self.out: list[tuple[int, bytes, list[int], bytes]] = []  # token, its logprob, top ids, top logprobs


def run_steps(runner: Any, seqs: list[Seq], chunk: int, params: Any, preempt_at: int = 0) -> None:
    """Steps of every sequence at once (what it has not fed in chunks of `chunk`, then one token a step)
    until each sequence of NEW tokens has them; the others decode meanwhile. `preempt_at`: after that
    many sampled tokens each sequence of NEW tokens is preempted once (its KV dropped: its prompt and
    output so far computed again, in chunks)."""
    width = runner.rc.width
    arena = Arena.private(ArenaSpec(BUCKETS[-1], ROWS, width))
    preempted: set[int] = set()
    while any(len(s.out) < s.new for s in seqs if s.new == NEW):
        live = [s for s in seqs if len(s.out) < s.new]
        for s in live:
            if preempt_at and s.new == NEW and len(s.out) == preempt_at and s.sid not in preempted:
                preempted.add(s.sid)
                s.fed = 0
                runner.seqs.free([s.sid])  # the agent forgets it, as the server's `free` tells it
        rows = []
        for s in live:
            n = min(chunk, len(s.tokens) - s.fed)
            rows.append(RowInput(s.sid, np.asarray(s.tokens[s.fed:s.fed + n], np.int32), s.fed, s.table,
                                 s.fed + n == len(s.tokens), params, len(s.prompt), len(s.tokens) - len(s.prompt),
                                 adapter=s.adapter))
        v = arena.step(arena.write_step(rows, BS))
        runner.step(v, [])
        o = v.outputs
        for i, (s, row) in enumerate(zip(live, rows)):
            s.fed += len(row.tokens)
            if row.sample:
                s.out.append((int(o.ids[i]), o.logprobs[i].tobytes(), o.top_ids[i, :5].tolist(), o.top_logprobs[i, :5].tobytes()))
                s.tokens.append(int(o.ids[i]))


def compare(runner: Any, prompts: list[list[int]], chunk: int, params: Any, seed: int = 5,
            preempt_at: int = 0, adapters: list[int] | None = None) -> tuple[int, int]:
    """(prompts whose tokens agree, prompts whose tokens and logprobs agree bit for bit): each alone,
    prefilled whole, against all of them among ROWS - len(prompts) random sequences, in chunks.
    `adapters`: each prompt's LoRA adapter (slot + 1); then the others take random slots too."""
    blocks = runner.rc.width
    adapters = adapters or [0] * len(prompts)
    alone = []
    for i, p in enumerate(prompts):
        s = Seq(i, p, 1, blocks, adapter=adapters[i])
        run_steps(runner, [s], len(p), params)
        alone.append(s.out)
        runner.seqs.free([i])
    rng = np.random.default_rng(seed)
    vocab = runner.cfg.vocab_size
    slots = max(adapters)
    others = [Seq(1000 + j, rng.integers(1, vocab - 16, int(rng.integers(2, 12))).tolist(), 1 + (len(prompts) + j) * blocks,
                  blocks, OTHERS_NEW, int(rng.integers(0, slots + 1))) for j in range(ROWS - len(prompts))]
    mixed = [Seq(i, p, 1 + i * blocks, blocks, adapter=a) for i, (p, a) in enumerate(zip(prompts, adapters))]
    run_steps(runner, mixed + others, chunk, params, preempt_at)
    runner.seqs.free([s.sid for s in mixed + others])
    tokens = sum([t for t, *_ in a] == [t for t, *_ in s.out] for a, s in zip(alone, mixed))
    bits = sum(a == s.out for a, s in zip(alone, mixed))
    return tokens, bits


def _runner(model: str, dtype: str, max_len: int) -> Any:
    from agent.graph_call import setup_mindspore
    from agent.model.calibrate import CALIBRATION_TEXT
    from agent.runner import ModelRunner
    from agent.runner_config import RunnerConfig
    from agent.weights.load import load_model
    from common.model_files import resolve_model
    from common.tokenizer import load_tokenizer

    setup_mindspore()
    files = resolve_model(model, None)
    tok = load_tokenizer(files, None)
    cfg, weights = load_model(files, max_len, int8=dtype == "int8")
    rc = RunnerConfig(num_blocks=1 + ROWS * (max_len // BS), block_size=BS, max_model_len=max_len, token_buckets=BUCKETS,
                      max_running=ROWS, model_dtype=dtype, deterministic=True)
    runner = ModelRunner(cfg, weights, rc, calibration=tok.encode(CALIBRATION_TEXT) if dtype == "int8" else None)
    runner.warmup(freeze=False)
    return runner, tok


PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "Explain why the sky is blue in two sentences.", "List three prime numbers:", "Once upon a time, in a village",
           "Translate 'good morning' into Spanish:", "The quick brown fox jumps over the lazy dog. " * 12]


def _timed(runner: Any, rows: list[RowInput], rounds: int) -> float:
    arena = Arena.private(ArenaSpec(BUCKETS[-1], ROWS, runner.rc.width))
    v = arena.step(arena.write_step(rows, BS))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        runner.step(v, [])
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def cost(runner: Any, rounds: int) -> dict[str, float]:
    """Median step seconds, deterministic off / on alternating: 64 decodes at 128 keys, 1 decode, a 256-token prefill."""
    from server.sampling_params import SamplingParams

    p, w = SamplingParams(), runner.rc.width
    table = list(range(1, 1 + w))
    shapes = {"decode B=64": [RowInput(i, np.array([5], np.int32), 128, list(range(1 + i * w, 1 + (i + 1) * w)), True, p,
                                       128, 0) for i in range(ROWS)],
              "decode B=1": [RowInput(0, np.array([5], np.int32), 128, table, True, p, 128, 0)],
              "prefill 256": [RowInput(0, np.arange(1, 257, dtype=np.int32) % 200 + 1, 0, table, True, p, 256, 0)]}
    out = {}
    for name, rows in shapes.items():
        got = {False: [], True: []}
        for _ in range(3):
            for on in (False, True):
                runner.rc.deterministic = on
                got[on].append(_timed(runner, rows, rounds))
        out[name] = (float(np.median(got[False])), float(np.median(got[True])))
    runner.rc.deterministic = True
    return out


def main(argv: list[str] | None = None) -> int:
    from common.cpu import describe
    from server.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(prog="bench_invariance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--chunks", default="16,64,512", help="prefill chunk sizes to compare ('': costs only)")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"# {args.model}, 8 prompts alone vs among {ROWS - 8} others in {ROWS}-row steps; {describe()}")
    print("| dtype | deterministic | chunk | greedy: tokens equal | greedy: bit-equal | seeded: bit-equal |")
    print("|---|---|---|---|---|---|")
    costs = {}
    for dtype in args.dtypes.split(","):
        runner, tok = _runner(args.model, dtype, args.max_len)
        prompts = [tok.encode(t) for t in PROMPTS]
        for on in (True, False):
            runner.rc.deterministic = on  # the same runner, its kernels' paths switched
            for chunk in [int(c) for c in args.chunks.split(",") if c]:
                g = compare(runner, prompts, chunk, SamplingParams(logprobs=5))
                s = compare(runner, prompts, chunk, SamplingParams(logprobs=5, temperature=0.8, top_p=0.9, seed=7))
                print(f"| {dtype} | {'on' if on else 'off'} | {chunk} | {g[0]}/8 | {g[1]}/8 | {s[1]}/8 |", flush=True)
        costs[dtype] = cost(runner, args.rounds)
    print("\n| dtype | step | off (ms) | on (ms) | on / off |\n|---|---|---|---|---|")
    for dtype, c in costs.items():
        for name, (off, on) in c.items():
            print(f"| {dtype} | {name} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
