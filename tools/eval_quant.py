"""Accuracy of a model dtype against float32, on the same weights: perplexity over a fixed corpus
that ships with the project (tools/data/eval_corpus.txt) and agreement of greedy continuations of a
fixed prompt set. Runs our real runner (MindSpore graphs, native kernels) in this process.

The corpus is ~5000 tokens, read in windows of WINDOW tokens. The table gives each dtype's
perplexity change with its standard error (of the mean per-token log-likelihood change, paired with
float32 on the same tokens): on the shorter corpus it had before, that error was as large as the
changes measured, which then moved with the rounding of single activations (docs/perf-notes.md).

    python -m tools.eval_quant [--model smollm2] [--dtype int8] [--tokens 16] [--groups 64,0] [--kv auto,int8]
                               [--llama-cpp .peers/llamacpp/bin/llama-server --gguf-dir .peers/models/smollm2]

--llama-cpp adds the same greedy comparison for llama.cpp's q8_0 against its own f32, from
model-f32.gguf and model-q8_0.gguf (tools/export_model.py) of the same weights.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace


import numpy as np

from common.config import QUANT_GROUP_SIZE

CORPUS = Path(__file__).with_name("data") / "eval_corpus.txt"
PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village,", "The three primary colors are",
    "def fibonacci(n):", "Water is made of", "The best way to learn a new language is",
    "In 1969, the first humans", "A healthy breakfast usually includes", "The sun rises in the",
    "To make a cup of tea, first", "The largest planet in our solar system is", "My favourite book is",
    "import numpy as np\n", "The main causes of the First World War were", "Photosynthesis is the process",
    "Here is a short poem about the sea:", "The difference between a virus and a bacterium is",
    "Question: What is 12 times 12?\nAnswer:", "The stock market fell today because",
    "Dear hiring manager,", "The Pythagorean theorem states that", "Cats and dogs are",
    "The recipe calls for two eggs,", "In computer science, a hash table is",
]
BLOCK = 16
WINDOW = 1024  # tokens per perplexity window: the runner's max_model_len
GREEDY_BLOCKS = 4  # KV blocks per greedy prompt: its tokens and the continuation's, at most 64


def build_runner(model: str, dtype: str, max_len: int = WINDOW, max_rows: int = 32, group: int = QUANT_GROUP_SIZE, kv: str = "auto"):
    from agent.model.calibrate import CALIBRATION_TEXT
    from agent.runner import ModelRunner
    from agent.runner_config import RunnerConfig
    from agent.graph_call import setup_mindspore
    from agent.weights.load import load_model
    from common.model_files import resolve_model
    from common.tokenizer import load_tokenizer

    setup_mindspore()
    files = resolve_model(model)
    cfg, weights = load_model(files, max_position=max_len, int8=dtype == "int8", blocks=dtype == "gguf")
    # A pool for what runs: one corpus window, or every greedy prompt's few blocks (the whole
    # max_rows x max_len pool took seconds to zero per runner).
    blocks = 1 + max(max_len // BLOCK, len(PROMPTS) * GREEDY_BLOCKS)
    rc = RunnerConfig(num_blocks=blocks, block_size=BLOCK, max_model_len=max_len,
                      token_buckets=[max_rows, 512], max_running=max_rows, model_dtype=dtype,
                      kv_cache_dtype=kv, int8_group=group)
    tok = load_tokenizer(files)
    return ModelRunner(cfg, weights, rc, calibration=tok.encode(CALIBRATION_TEXT)), tok


def token_nll(runner, ids: list[int], chunk: int = 128) -> tuple[list[float], list[int]]:
    """The NLL of every next token of one sequence (at most max_model_len tokens) fed in chunks
    through the paged cache, and the model's top token at every position (teacher-forced: each
    prediction sees the corpus, not the model's own earlier picks)."""
    from agent.packing import GraphInputs

    width = runner.rc.width
    table = np.arange(1, width + 1, dtype=np.int32).reshape(1, width)  # block 0 is reserved
    nll: list[float] = []
    top: list[int] = []
    for s in range(0, len(ids) - 1, chunk):
        part = np.asarray(ids[s:s + chunk], np.int32)
        n = len(part)
        tokens = np.zeros(chunk, np.int32)
        tokens[:n] = part
        pos = np.arange(s, s + chunk, dtype=np.int32)
        slots = np.where(np.arange(chunk) < n, pos + BLOCK, 0).astype(np.int32)  # padding writes block 0
        logits, lse = runner._run(GraphInputs(tokens, np.minimum(pos, s + n - 1), slots, np.zeros(chunk, np.int32), table,
                                              np.arange(chunk, dtype=np.int32), None))
        nxt = np.asarray(ids[s + 1:s + n + 1])
        m = len(nxt)
        nll.extend((lse[:m] - logits[np.arange(m), nxt]).tolist())
        top.extend(logits[:m].argmax(-1).tolist())
    return nll, top


def corpus_nll(runner, ids: list[int]) -> tuple[list[float], list[int]]:
    """token_nll over consecutive windows of WINDOW tokens (each starts with an empty context)."""
    nll: list[float] = []
    top: list[int] = []
    for s in range(0, len(ids) - 1, WINDOW):
        a, b = token_nll(runner, ids[s:s + WINDOW])
        nll += a
        top += b
    return nll, top


def greedy(runner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens after each prompt, all prompts as one batch (prefill step, then decode steps)."""
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.max() + n > GREEDY_BLOCKS * BLOCK:
        raise ValueError(f"a prompt and {n} tokens exceed the {GREEDY_BLOCKS * BLOCK} a greedy row has room for")
    tables = np.zeros((len(prompts), runner.rc.width), np.int32)  # columns past a row's blocks: never read
    tables[:, :GREEDY_BLOCKS] = 1 + np.arange(len(prompts) * GREEDY_BLOCKS, dtype=np.int32).reshape(-1, GREEDY_BLOCKS)
    tokens = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    positions = np.concatenate([np.arange(k, dtype=np.int32) for k in lens])
    qlens, out = lens, [[] for _ in prompts]
    for _ in range(n):
        rows = np.repeat(np.arange(len(prompts)), qlens)
        slots = (tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK).astype(np.int32)
        x = SimpleNamespace(tokens=tokens, positions=positions, slots=slots, query_lens=qlens, block_tables=tables,
                            targets=np.full(len(tokens), -1, np.int32),  # nothing scored
                            spec_len=np.zeros(len(qlens), np.int32), adapter=np.zeros(len(qlens), np.int32))  # no drafts, no LoRA
        logits, _ = runner.forward(x)
        tokens = logits.argmax(-1).astype(np.int32)
        for r, t in enumerate(tokens):
            out[r].append(int(t))
        positions = (lens + len(out[0]) - 1).astype(np.int32)
        qlens = np.ones(len(prompts), np.int32)
    return out


def evaluate(model: str, dtype: str, n: int, group: int = QUANT_GROUP_SIZE, kv: str = "auto") -> dict:
    t0 = time.monotonic()
    runner, tok = build_runner(model, dtype, group=group, kv=kv)
    corpus = tok.encode(CORPUS.read_text())
    nll, top = corpus_nll(runner, corpus)
    continuations = greedy(runner, [tok.encode(p) for p in PROMPTS], n)
    if dtype == "int8":
        dtype += {0: " (8 groups per row)", -1: " (per channel)"}.get(group, f" (group <= {group})")
    dtype += f", {runner.kv_dtype} KV"
    return {"dtype": dtype, "perplexity": float(np.exp(np.mean(nll))), "nll": nll, "tokens": len(corpus), "top": top,
            "greedy": continuations,
            "seconds": time.monotonic() - t0, "weight_bytes": runner.model.weight_bytes}


def agreement(a: list[list[int]], b: list[list[int]], n: int | None = None) -> float:
    """Share of prompts whose continuations are identical (in their first n tokens)."""
    return sum(x[:n] == y[:n] for x, y in zip(a, b)) / len(a)


def standard_error(base: list[float], other: list[float]) -> float:
    """Standard error of the perplexity ratio's logarithm (~ its relative change): the per-token NLL
    differences' spread over the square root of their count."""
    d = np.asarray(other) - np.asarray(base)
    return float(d.std(ddof=1) / np.sqrt(len(d)))


def top1_agreement(a: list[int], b: list[int]) -> float:
    """Share of corpus positions where two models pick the same top token (teacher-forced). One
    sample per position (~5000 on the shipped corpus), where `agreement` has one per prompt (24), and
    moved far more than this with the order of one float sum between builds (docs/perf-notes.md)."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def llama_cpp_greedy(server: str, gguf: Path, prompts: list[list[int]], n: int, port: int = 8091) -> list[list[int]]:
    """n greedy tokens after each token-id prompt from a llama.cpp server on `gguf` (2 threads)."""
    proc = subprocess.Popen([server, "-m", str(gguf), "--port", str(port), "-t", "2", "-np", "1", "-c", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/health")
                break
            except OSError:
                time.sleep(1)
        out = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False,
                    "return_tokens": True, "ignore_eos": True}
            req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            out.append(json.load(urllib.request.urlopen(req))["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="int8")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--groups", default=str(QUANT_GROUP_SIZE), help="int8 group sizes to compare (at most G inputs per scale; 0: 8 per row; -1: per channel)")
    ap.add_argument("--kv", default="auto", help="KV cache dtypes to compare for --dtype (kv_cache_dtype values)")
    ap.add_argument("--llama-cpp", help="a llama-server binary: also compare llama.cpp q8_0 with its f32")
    ap.add_argument("--gguf-dir", type=Path, help="folder with model-f32.gguf and model-q8_0.gguf")
    args = ap.parse_args()
    base = evaluate(args.model, "float32", args.tokens)
    tests = [evaluate(args.model, args.dtype, args.tokens, int(g), kv) for g in args.groups.split(",")
             for kv in args.kv.split(",")]
    print(f"corpus: {CORPUS.name}, {base['tokens']} tokens; {len(PROMPTS)} prompts x {args.tokens} greedy tokens")
    print(f"| dtype | perplexity | vs float32 (± standard error) | same top token (corpus) | greedy identical: {args.tokens} / 8 / 4 "
          "tokens | weights MiB |")
    print("|---|---|---|---|---|---|")
    for r in (base, *tests):
        same = " / ".join(f"{agreement(base['greedy'], r['greedy'], n):.0%}" for n in (None, 8, 4))
        print(f"| {r['dtype']} | {r['perplexity']:.3f} | {r['perplexity'] / base['perplexity'] - 1:+.2%} "
              f"(± {standard_error(base['nll'], r['nll']):.2%}) | "
              f"{top1_agreement(base['top'], r['top']):.1%} | {same} | {r['weight_bytes'] / 2**20:.0f} |")
    if args.llama_cpp:
        from common.model_files import resolve_model
        from common.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model(args.model))
        prompts = [tok.encode(p) for p in PROMPTS]
        f32, q8 = (llama_cpp_greedy(args.llama_cpp, args.gguf_dir / f"model-{t}.gguf", prompts, args.tokens)
                   for t in ("f32", "q8_0"))
        same = " / ".join(f"{agreement(f32, q8, n):.0%}" for n in (None, 8, 4))
        print(f"| llama.cpp q8_0 vs its f32 | - | - | - | {same} | - |")


if __name__ == "__main__":
    main()
