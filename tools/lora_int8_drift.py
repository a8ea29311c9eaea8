"""How far an int8 base follows a LoRA adapter as the adapter grows stronger: seeded random adapters
of increasing size (tools/lora_adapter.py) on the same model, served over float32 weights and over
int8 weights (the adapters stay float32 on both: agent/kernels/linear_int8.cpp's Shrink), and the
int8 side's distance from the float32 side at each strength. float32 with an adapter is PEFT's
forward (tests/agent/test_lora.py), so this is int8's error against the adapter as trained.

    python -m tools.lora_int8_drift [--model smollm2] [--scales 0,0.5,1,1.5,2,3] [--tokens 16]

Strength: how much the adapter moves float32's next-token logits, as a share of their largest value
(the fixture adapters of test_lora move them 0.2-0.8). Columns: int8's error in nats at float32's
top token of the first step (median and worst over the prompts), and the share of greedy tokens
int8 picks as float32 does over --tokens steps. Runs our real runner in this process.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from tools.eval_quant import BLOCK, GREEDY_BLOCKS, PROMPTS

RANK = 16


def runner_with(model: str, dtype: str, adapters: list, slots: int):
    from agent.graph_call import setup_mindspore
    from agent.model.calibrate import CALIBRATION_TEXT
    from agent.model.lora import LoraSlots
    from agent.runner import ModelRunner
    from agent.runner_config import RunnerConfig
    from agent.weights.load import load_model
    from common.model_files import resolve_model
    from common.tokenizer import load_tokenizer

    setup_mindspore()
    files = resolve_model(model)
    cfg, weights = load_model(files, max_position=GREEDY_BLOCKS * BLOCK, int8=dtype == "int8")
    rc = RunnerConfig(num_blocks=1 + len(PROMPTS) * GREEDY_BLOCKS, block_size=BLOCK, max_model_len=GREEDY_BLOCKS * BLOCK,
                      token_buckets=[len(PROMPTS), 512], max_running=len(PROMPTS), model_dtype=dtype,
                      lora=(slots, RANK))
    tok = load_tokenizer(files)
    return ModelRunner(cfg, weights, rc, calibration=tok.encode(CALIBRATION_TEXT),
                       lora=LoraSlots(adapters, slots, RANK)), tok


def greedy(runner, prompts: list[list[int]], n: int, adapter: int) -> tuple[list[list[int]], np.ndarray]:
    """n greedy tokens of each prompt with every row on `adapter` (0: none, k: slot k - 1), and the
    first step's log-probabilities [prompts, vocab]."""
    lens = np.array([len(p) for p in prompts], np.int32)
    tables = np.zeros((len(prompts), runner.rc.width), np.int32)
    tables[:, :GREEDY_BLOCKS] = 1 + np.arange(len(prompts) * GREEDY_BLOCKS, dtype=np.int32).reshape(-1, GREEDY_BLOCKS)
    tokens = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    positions = np.concatenate([np.arange(k, dtype=np.int32) for k in lens])
    qlens, out, first = lens, [[] for _ in prompts], None
    for _ in range(n):
        rows = np.repeat(np.arange(len(prompts)), qlens)
        slots = (tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK).astype(np.int32)
        x = SimpleNamespace(tokens=tokens, positions=positions, slots=slots, query_lens=qlens, block_tables=tables,
                            targets=np.full(len(tokens), -1, np.int32), spec_len=np.zeros(len(qlens), np.int32),
                            adapter=np.full(len(qlens), adapter, np.int32))
        logits, lse = runner.forward(x)
        first = logits - lse[:, None] if first is None else first
        tokens = logits.argmax(-1).astype(np.int32)
        for r, t in enumerate(tokens):
            out[r].append(int(t))
        positions = (lens + len(out[0]) - 1).astype(np.int32)
        qlens = np.ones(len(prompts), np.int32)
    return out, first


def main() -> None:
    from agent.lora import read_adapter
    from agent.weights.load import load_model
    from common.cpu import describe
    from common.model_files import resolve_model
    from tools.lora_adapter import model_config, random_adapter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--scales", default="0,0.5,1,1.5,2,3", help="random_adapter's scale per adapter (0: the base)")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    scales = [float(s) for s in args.scales.split(",")]
    cfg = load_model(resolve_model(args.model), max_position=GREEDY_BLOCKS * BLOCK)[0]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [read_adapter(f"s{s}", random_adapter(Path(tmp) / f"s{s}", model_config(args.model), RANK, scale=s),
                                 cfg, RANK) for s in scales if s > 0]
    runs = {}
    for dtype in ("float32", "int8"):
        runner, tok = runner_with(args.model, dtype, adapters, max(1, len(adapters)))
        prompts = [tok.encode(p) for p in PROMPTS]
        runs[dtype] = [greedy(runner, prompts, args.tokens, 0)]
        runs[dtype] += [greedy(runner, prompts, args.tokens, k + 1) for k in range(len(adapters))]
        del runner
    base32 = runs["float32"][0][1]
    print(f"# {args.model}, rank-{RANK} adapters on every projection; {describe()}")
    print("| adapter scale | strength | int8 error at fp32's top token, median / worst (nats) | greedy agreement |")
    print("|---|---|---|---|")
    for i, s in enumerate([0.0] + [s for s in scales if s > 0]):
        (toks32, lp32), (toks8, lp8) = runs["float32"][i], runs["int8"][i]
        top = lp32.argmax(-1)
        err = np.abs(lp8[np.arange(len(top)), top] - lp32[np.arange(len(top)), top])
        strength = float(np.median(np.abs(lp32 - base32).max(-1) / np.abs(base32).max(-1))) if i else 0.0
        agree = float(np.mean([a == b for x, y in zip(toks32, toks8) for a, b in zip(x, y)]))
        print(f"| {s if i else 'base'} | {strength:.2f} | {np.median(err):.3f} / {err.max():.3f} | {agree:.3f} |")


if __name__ == "__main__":
    main()
