"""llm-bench's report: the summary table, the server's own counters (ours only), the sweep's plot and
its goodput (the highest request rate whose tail latencies stay within bounds)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx


def print_table(s: dict[str, Any], title: str = "Serving Benchmark Result") -> None:
    w = 50
    print(f"{' ' + title + ' ':=^{w}}")
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"), ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    if "arrival_bound_throughput" in s:  # see summarize
        rows.append(("Arrival bound (tok/s):", f"{s['arrival_bound_throughput']:.2f}"))
        rows.append(("Share of the arrival bound:", f"{s['output_throughput'] / s['arrival_bound_throughput']:.1%}"))
    for k, v in rows:
        print(f"{k:<40}{v:>10}")
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{label:-^{w}}")
        for stat in ("mean", "median", "p99"):
            print(f"{stat.capitalize() + ' ' + name.upper() + ' (ms):':<40}{s[f'{stat}_{name}_ms']:>10.2f}")
    print("=" * w)
    for e in s["errors"]:
        print(f"error: {e}")


def server_stats(base: str) -> dict[str, Any] | None:
    """Our server's counters (None for peers, which lack the endpoint)."""
    try:
        r = httpx.get(f"{base}/stats", timeout=10)
        return r.json() if r.status_code == 200 and "server_cpu_s" in r.json() else None
    except (httpx.HTTPError, ValueError):
        return None


def add_server_overhead(s: dict[str, Any], before: dict | None, after: dict | None) -> None:
    """Server-process CPU time per agent step, relative to the step time (the engine overlaps
    nothing with a step's wall time, so this is the server's share of the critical path bound)."""
    if not before or not after or after["steps"] == before["steps"]:
        return
    steps = after["steps"] - before["steps"]
    cpu = (after["server_cpu_s"] - before["server_cpu_s"]) / steps
    step = (after["step_wall_s"] - before["step_wall_s"]) / steps
    s.update(server_cpu_per_step_ms=cpu * 1e3, mean_step_ms=step * 1e3, server_cpu_share_of_step=cpu / step)


def plot_sweep(summaries: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s["output_throughput"] for s in summaries], [s["p99_ttft_ms"] for s in summaries], "o-")
    for s in summaries:
        ax.annotate(f"{s['request_rate']:g}/s", (s["output_throughput"], s["p99_ttft_ms"]))
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("p99 TTFT (ms)")
    ax.set_title("throughput vs latency")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot saved to {path}")


def goodput_line(summaries: list[dict[str, Any]], ttft_ms: float, tpot_ms: float) -> str:
    """The highest swept rate at which p99 TTFT <= ttft_ms and p99 TPOT <= tpot_ms (and nothing failed)."""
    good = [s for s in summaries if s["failed"] == 0 and s["p99_ttft_ms"] <= ttft_ms and s["p99_tpot_ms"] <= tpot_ms]
    if not good:
        return f"goodput: no swept rate keeps p99 TTFT <= {ttft_ms:g} ms and p99 TPOT <= {tpot_ms:g} ms"
    best = max(good, key=lambda s: s["request_rate"])
    return (f"goodput: {best['request_rate']:g} req/s ({best['output_throughput']:.1f} output tok/s) keeps p99 TTFT "
            f"<= {ttft_ms:g} ms and p99 TPOT <= {tpot_ms:g} ms (at it: {best['p99_ttft_ms']:.0f} and "
            f"{best['p99_tpot_ms']:.1f} ms)")
