"""Throughput-latency curve over the step token budget (`max_num_batched_tokens`): one server start
per value (each budget has its own graph set), the same llm-bench workload against each, one table
and one PNG.

    python -m tools.sweep_budget --config configs/smollm2.yaml --budgets 128,256,512,1024 \\
        --out docs/budget_sweep -- --num-prompts 64 --input-len 200 --output-len 128 --request-rate 2

Arguments after `--` go to llm-bench (llm_serving/bench/serving.py). Needs the `bench` extra (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from llm_serving.bench import serving as bench_serving
from tools import server_process

ROOT = Path(__file__).resolve().parent.parent


def serve(config: Path, budget: int, log: Path) -> tuple[subprocess.Popen, str]:
    doc = yaml.safe_load(config.read_text())
    sc = doc.setdefault("serving_config", {})
    sc["max_num_batched_tokens"] = budget
    sc["prefill_only_tokens"] = max(budget, int(sc.get("prefill_only_tokens") or 0))
    path = Path(tempfile.mkdtemp()) / f"budget{budget}.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = server_process.start_server(["--config", str(path)], log, session=False)
    return proc, f"http://{sc.get('server_ip', '127.0.0.1')}:{sc.get('server_port', 8835)}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "p99_ttft_ms", "p99 TTFT (ms)"), (axes[1], "mean_tpot_ms", "mean TPOT (ms)")):
        ax.plot([r["output_throughput"] for r in rows], [r[key] for r in rows], "o-")
        for r in rows:
            ax.annotate(str(r["budget"]), (r["output_throughput"], r[key]))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(label)
    fig.suptitle("throughput vs latency over max_num_batched_tokens")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--budgets", required=True, help="comma-separated max_num_batched_tokens values")
    ap.add_argument("--out", default="budget_sweep", help="prefix of the .json, .md and .png written")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for budget in (int(b) for b in args.budgets.split(",")):
        proc, url = serve(Path(args.config), budget, out.with_name(f"{out.name}_server{budget}.log"))
        try:
            result = out.with_name(f"{out.name}_{budget}.json")
            bench_serving.main(["--base-url", url, *bench_args, "--save-result", str(result)])
            rows.append({"budget": budget, **json.loads(result.read_text())["summary"]})
        finally:
            proc.terminate()
            proc.wait(60)
    table = ["| max_num_batched_tokens | output tok/s | mean TTFT (ms) | p99 TTFT (ms) | mean TPOT (ms) | failed |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['budget']} | {r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
              f"{r['mean_tpot_ms']:.1f} | {r['failed']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
