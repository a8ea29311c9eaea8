"""Agent model speed: decode step latency at several batch sizes and prefill tokens/s, for our
MindSpore runner, a NumPy (OpenBLAS) forward and, when torch is installed, a torch-eager forward of
the same weights, as ratios in one run.

    python -m tools.bench_agent [--model smollm2] [--batches 1,8,32,64] [--context 128]
                                [--dtypes float32,int8,int8:64]

--dtypes runs one runner per entry (int8:G = at most G inputs per int8 scale, 72 when omitted; 0: 8 per row) and
adds a column per entry after the first, with its speed-up over the first.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any, Callable


import numpy as np

from common.config import QUANT_GROUP_SIZE
from common.cpu import describe, read_bandwidth


class NumpyLlama:
    """Eager fp32 NumPy forward with a dense per-sequence KV cache: the baseline."""

    def __init__(self, cfg, w: dict[str, np.ndarray], batch: int, max_len: int):
        from agent.model_config import rope_tables

        self.cfg = cfg
        self.cos, self.sin = rope_tables(cfg)
        t = lambda a: np.ascontiguousarray(a.T)  # noqa: E731
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(dict(
                n1=w[p + "input_layernorm.weight"], n2=w[p + "post_attention_layernorm.weight"],
                qkv=t(np.concatenate([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], 0)),
                o=t(w[p + "self_attn.o_proj.weight"]),
                gu=t(np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], 0)),
                down=t(w[p + "mlp.down_proj.weight"])))
        self.embed = w["model.embed_tokens.weight"]
        self.head = t(w.get("lm_head.weight", self.embed) if not cfg.tie_word_embeddings else self.embed)
        self.norm = w["model.norm.weight"]
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)

    def _rms(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.cfg.rms_eps) * g

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:  # x [..., n, heads, hd]
        hd = self.cfg.head_dim
        c, s = self.cos[pos][..., None, :], self.sin[pos][..., None, :]
        return x * c + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * s

    def forward(self, tokens: np.ndarray, start: int) -> np.ndarray:
        """tokens [B, Q] at positions start..start+Q-1 for every row; logits of the last token [B, V]."""
        c = self.cfg
        b, q = tokens.shape
        h, kv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        pos = np.arange(start, start + q)
        x = self.embed[tokens]  # [B, Q, D]
        end = start + q
        mask = np.where(np.arange(end)[None, :] <= pos[:, None], 0.0, -1e9).astype(np.float32)
        for i, L in enumerate(self.layers):
            y = self._rms(x, L["n1"]) @ L["qkv"]
            qh = self._rope(y[..., :h * hd].reshape(b, q, h, hd), pos)
            kh = self._rope(y[..., h * hd:(h + kv) * hd].reshape(b, q, kv, hd), pos)
            vh = y[..., (h + kv) * hd:].reshape(b, q, kv, hd)
            self.k[i, :, :, start:end] = kh.transpose(0, 2, 1, 3)
            self.v[i, :, :, start:end] = vh.transpose(0, 2, 1, 3)
            qg = qh.reshape(b, q, kv, h // kv, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, -1, hd)
            s = qg @ self.k[i, :, :, :end].transpose(0, 1, 3, 2) / math.sqrt(hd)
            s = s.reshape(b, kv, h // kv, q, end) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = (s.reshape(b, kv, -1, end) @ self.v[i, :, :, :end]).reshape(b, kv, h // kv, q, hd)
            x = x + o.transpose(0, 3, 1, 2, 4).reshape(b, q, h * hd) @ L["o"]
            gu = self._rms(x, L["n2"]) @ L["gu"]
            g, u = gu[..., :c.intermediate_size], gu[..., c.intermediate_size:]
            x = x + (g / (1 + np.exp(-g)) * u) @ L["down"]
        return self._rms(x[:, -1], self.norm) @ self.head


class TorchLlama:
    """Eager fp32 torch forward (the issue's baseline), same dense-cache scheme as NumpyLlama."""

    def __init__(self, ref: NumpyLlama):
        import torch

        self.torch, self.cfg = torch, ref.cfg
        t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731  (a writable copy)
        self.layers = [{k: t(v) for k, v in layer.items()} for layer in ref.layers]
        self.embed, self.head, self.norm = t(ref.embed), t(ref.head), t(ref.norm)
        self.cos, self.sin = t(ref.cos), t(ref.sin)
        self.k, self.v = t(ref.k), t(ref.v)

    def forward(self, tokens: np.ndarray, start: int) -> np.ndarray:
        torch, c = self.torch, self.cfg
        with torch.inference_mode():
            tok = torch.from_numpy(tokens)
            b, q = tok.shape
            h, kv, hd = c.num_heads, c.num_kv_heads, c.head_dim
            end = start + q
            cos, sin = self.cos[start:end][:, None], self.sin[start:end][:, None]
            rms = lambda x, g: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + c.rms_eps) * g  # noqa: E731
            rope = lambda x: x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin  # noqa: E731
            x = self.embed[tok]
            for i, L in enumerate(self.layers):
                y = rms(x, L["n1"]) @ L["qkv"]
                qh = rope(y[..., :h * hd].reshape(b, q, h, hd)).transpose(1, 2)
                kh = rope(y[..., h * hd:(h + kv) * hd].reshape(b, q, kv, hd)).transpose(1, 2)
                self.k[i, :, :, start:end] = kh
                self.v[i, :, :, start:end] = y[..., (h + kv) * hd:].reshape(b, q, kv, hd).transpose(1, 2)
                o = torch.nn.functional.scaled_dot_product_attention(
                    qh, self.k[i, :, :, :end], self.v[i, :, :, :end], is_causal=q > 1, enable_gqa=True)
                x = x + o.transpose(1, 2).reshape(b, q, h * hd) @ L["o"]
                gu = rms(x, L["n2"]) @ L["gu"]
                g, u = gu[..., :c.intermediate_size], gu[..., c.intermediate_size:]
                x = x + (torch.nn.functional.silu(g) * u) @ L["down"]
            return (rms(x[:, -1], self.norm) @ self.head).numpy()


def measure(fns: dict[str, Callable[[], object]], repeat: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each system, timed in interleaved rounds: this VM's speed drifts
    over seconds, so back-to-back blocks per system would compare different machines."""
    for fn in fns.values():
        fn()  # warm (compiles the graph for this shape)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


class Bench:
    """The runners of each dtype variant over one model, the steps they time and the report."""

    def __init__(self, args: argparse.Namespace):
        from agent.model.calibrate import CALIBRATION_TEXT
        from agent.graph_call import setup_mindspore
        from agent.runner import ModelRunner
        from agent.runner_config import RunnerConfig
        from agent.weights.load import load_model
        from common.model_files import resolve_model
        from common.tokenizer import load_tokenizer
        from server.sampling_params import SamplingParams
        from shm.arena import Arena, ArenaSpec

        self.args, self.variants = args, args.dtypes.split(",")
        self.batches = [int(b) for b in args.batches.split(",")]
        self.max_len = 2 * max(args.context, args.prefill)
        files = resolve_model(args.model)
        self.cfg, self.weights = load_model(files, max_position=self.max_len)
        setup_mindspore(".cache/mindspore", key=f"bench|{self.cfg}|{args.batches}|{args.context}|{args.dtypes}")
        self.bs, self.per_seq = 16, self.max_len // 16
        calibration = load_tokenizer(files).encode(CALIBRATION_TEXT)
        self.runners = {}
        for v in self.variants:
            spec, _, kv = v.partition("/")
            dtype, _, group = spec.partition(":")
            rc = RunnerConfig(num_blocks=1 + self.per_seq * max(self.batches), block_size=self.bs,
                              max_model_len=self.max_len, token_buckets=self.batches + [args.prefill],
                              max_running=max(self.batches), model_dtype=dtype, kv_cache_dtype=kv or "auto",
                              int8_group=int(group or QUANT_GROUP_SIZE))
            weights = load_model(files, max_position=self.max_len, blocks=True)[1] if dtype == "gguf" else self.weights
            self.runners[v] = ModelRunner(self.cfg, weights, rc, calibration=calibration)
            print(f"{v}: weights {self.runners[v].model.weight_bytes / 2**20:.0f} MiB")
        self.arena = Arena.private(ArenaSpec(max(self.batches) + args.prefill, max(self.batches), self.per_seq))
        self.greedy = SamplingParams()
        try:
            import torch  # noqa: F401  (optional: `pip install torch==2.13.0` adds the torch-eager column)
            self.have_torch = True
        except ImportError:
            self.have_torch = False

    def _row(self, i: int, tokens: np.ndarray, start: int, prompt_len: int) -> Any:
        from shm.step import RowInput
        return RowInput(i, tokens, start, list(range(1 + i * self.per_seq, 1 + (i + 1) * self.per_seq)), True,
                        self.greedy, prompt_len, 0)

    def decode(self, runner: Any, b: int) -> Callable[[], object]:
        rows = [self._row(i, np.asarray([7], np.int32), self.args.context, self.args.context) for i in range(b)]
        v = self.arena.step(self.arena.write_step(rows, self.bs))
        return lambda: runner.step(v, [])

    def prefill(self, runner: Any) -> Callable[[], object]:
        rows = [self._row(0, np.arange(self.args.prefill, dtype=np.int32) + 100, 0, self.args.prefill)]
        v = self.arena.step(self.arena.write_step(rows, self.bs))
        return lambda: runner.step(v, [])

    def fill_cache(self, runner: Any, rows: int) -> None:
        """Write every decode row's context into the KV cache (prefill steps, `--prefill` tokens at a
        time). Untouched, the cache's pages are all the kernel's one zero page, always in cache, and a
        many-row step measured far faster than served (where attention reads the cache from DRAM)."""
        ctx, chunk = self.args.context, self.args.prefill
        for i in range(rows):
            for s0 in range(0, ctx, chunk):
                toks = (np.arange(s0, min(ctx, s0 + chunk), dtype=np.int32) * 7 + i) % self.cfg.vocab_size
                runner.step(self.arena.step(self.arena.write_step([self._row(i, toks, s0, ctx)], self.bs)), [])

    def header(self) -> None:
        print(f"CPU: {describe()}")
        for v, r in self.runners.items():
            print(f"{v}: {r.kernel_paths}; KV cache {r.kv_dtype}")
        c = self.cfg
        print(f"model {self.args.model}: {c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}; "
              f"decode context {self.args.context}, prefill chunk {self.args.prefill}")
        print(f"{'workload':<22}{'MindSpore':>14}{'NumPy':>14}{'vs NumPy':>10}"
              + (f"{'torch':>14}{'vs torch':>10}" if self.have_torch else "")
              + "".join(f"{v:>18}{'vs ' + self.variants[0]:>14}" for v in self.variants[1:]))

    def report(self, name: str, ms_fns: list[Callable[[], object]], ref: NumpyLlama, toks: np.ndarray, start: int,
               per_token: int = 0) -> dict[str, float]:
        fns = {"ms": ms_fns[0], "np": lambda: ref.forward(toks, start)}
        fns.update({v: fn for v, fn in zip(self.variants[1:], ms_fns[1:])})
        if self.have_torch:
            tref = TorchLlama(ref)
            diff = np.abs(tref.forward(toks, start) - ref.forward(toks, start)).max()
            assert diff < 1e-2, f"torch and NumPy baselines disagree by {diff}"
            fns["torch"] = lambda: tref.forward(toks, start)
        t = measure(fns, self.args.repeat, self.args.rounds)
        fmt = (lambda t: f"{per_token / t:>10.0f} t/s") if per_token else (lambda t: f"{t * 1e3:>11.1f} ms")
        line = f"{name:<22}{fmt(t['ms'])}{fmt(t['np'])}{t['np'] / t['ms']:>9.2f}x"
        if self.have_torch:
            line += f"{fmt(t['torch'])}{t['torch'] / t['ms']:>9.2f}x"
        line += "".join(f"{fmt(t[v]):>18}{t['ms'] / t[v]:>13.2f}x" for v in self.variants[1:])
        print(line, flush=True)
        return t

    def streaming_limit(self) -> None:
        """A one-row decode step reads every weight once: memory bandwidth bounds it. Timed again
        without the NumPy baseline between calls (OpenBLAS's threads keep spinning on both cores
        after its calls), with the read bandwidth measured in every round next to that round's steps
        (it drifts between runs minutes apart): each round gives a ratio."""
        cores, rounds = len(os.sched_getaffinity(0)), self.args.rounds
        fns = {v: self.decode(r, 1) for v, r in self.runners.items()}
        bws, alone = [], {v: [] for v in self.runners}
        for _ in range(rounds):
            bws.append(read_bandwidth(cores))
            for v, t in measure(fns, 4 * self.args.repeat, 1).items():
                alone[v].append(t)
        bw = statistics.median(bws)
        print(f"weight-streaming limit at {bw / 1e9:.1f} GB/s (read bandwidth of {cores} cores, median of {rounds} "
              f"rounds; {min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f}):")
        for v, r in self.runners.items():
            ratios = [t * b / r.model.streamed_bytes for t, b in zip(alone[v], bws)]
            print(f"  {v}: decode B=1 alone {statistics.median(alone[v]) * 1e3:.1f} ms, limit "
                  f"{r.model.streamed_bytes / bw * 1e3:.1f} ms ({statistics.median(ratios):.2f}x: "
                  f"median of the rounds' ratios, {min(ratios):.2f}-{max(ratios):.2f}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=128, help="tokens already in the cache at decode")
    ap.add_argument("--prefill", type=int, default=128, help="prefill chunk length")
    ap.add_argument("--repeat", type=int, default=3, help="calls per system per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="float32", help="model dtypes to compare: float32, bfloat16, int8, "
                    "int8:<group>; /<kv> picks the KV cache's dtype (bfloat16/float16/float32; default auto), e.g. "
                    "float32/bfloat16")
    args = ap.parse_args(argv)
    b = Bench(args)
    b.header()
    for r in b.runners.values():
        b.fill_cache(r, max(b.batches))
    for n in b.batches:
        b.report(f"decode step B={n}", [b.decode(r, n) for r in b.runners.values()],
                 NumpyLlama(b.cfg, b.weights, n, b.max_len), np.full((n, 1), 7, np.int64), args.context)
    b.report(f"prefill {args.prefill} tokens", [b.prefill(r) for r in b.runners.values()],
             NumpyLlama(b.cfg, b.weights, 1, b.max_len), (np.arange(args.prefill) + 100)[None], 0,
             per_token=args.prefill)
    if 1 in b.batches:
        b.streaming_limit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
