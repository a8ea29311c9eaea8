"""The server's request life-cycle histograms (our /metrics) as a per-run breakdown for llm-bench:
where a request's time went, as the server measured it."""
from __future__ import annotations

import httpx

PHASES = {"waiting (arrival -> scheduled)": "llm_serving_request_waiting_seconds",
          "scheduling -> inference": "llm_serving_request_scheduling_to_inference_seconds",
          "inference (first step -> last reply)": "llm_serving_request_inference_seconds",
          "TTFT": "llm_serving_time_to_first_token_seconds",
          "latency (arrival -> end)": "llm_serving_e2e_request_latency_seconds"}
PREFILL = "llm_serving_prefill_tokens_computed_total"
PROMPT = "llm_serving_prompt_tokens_total"


def samples(base: str) -> dict[str, float]:
    """Every sample of a server's /metrics, by name with its labels (`name{label="x"}`); {} when it
    has none there (a peer without the endpoint)."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def snapshot(base: str) -> dict[str, float] | None:
    """Sums and counts of the life-cycle histograms and the prompt counters; None for servers
    without them (peers)."""
    wanted = {f"{m}{s}" for m in PHASES.values() for s in ("_sum", "_count")} | {PREFILL, PROMPT}
    out = {k: v for k, v in samples(base).items() if k in wanted}
    return out if len(out) == len(wanted) else None


def breakdown(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """Mean seconds per phase over the requests that ended in between, and the share of prompt tokens
    the agents computed (1 - prefix-cache hits)."""
    if not before or not after:
        return {}
    out = {}
    for label, m in PHASES.items():
        n = after[f"{m}_count"] - before[f"{m}_count"]
        if n:
            out[label] = (after[f"{m}_sum"] - before[f"{m}_sum"]) / n
    prompt = after[PROMPT] - before[PROMPT]
    if prompt:
        out["prompt tokens computed (share)"] = (after[PREFILL] - before[PREFILL]) / prompt
    return out


def print_breakdown(b: dict[str, float]) -> None:
    if not b:
        return
    print(f"{' server-side breakdown (means) ':-^50}")
    for label, v in b.items():
        print(f"{label + ':':<40}{v:>10.3f}" if "share" in label else f"{label + ' (ms):':<40}{v * 1e3:>10.2f}")
