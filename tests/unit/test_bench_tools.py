"""llm-bench's arrivals and random lengths."""
from __future__ import annotations

def test_bench_arrival_bound_caps_output_throughput_at_a_finite_rate():
    from llm_serving.bench.serving import RequestResult, summarize

    # Sent at 0, 1 and 4 s, 100 tokens each, the last answered at 5 s: no server could have ended
    # before 4 s, so 300 tokens / 4 s is the most any could reach.
    res = [RequestResult(ok=True, ttft=0.1, latency=1.0, output_tokens=100, start=10.0 + t) for t in (0, 1, 4)]
    s = summarize(res, duration=5.0)
    assert s["output_throughput"] == 60.0 and s["arrival_bound_throughput"] == 75.0
    burst = [RequestResult(ok=True, latency=1.0, output_tokens=100, start=10.0) for _ in range(3)]
    assert "arrival_bound_throughput" not in summarize(burst, duration=5.0)  # all at once: no bound


def test_bench_random_range_ratio_draws_lengths_in_range():
    from llm_serving.bench.serving import random_dataset

    reqs = random_dataset(200, 200, 128, seed=3, range_ratio=0.9)
    ins, outs = [r.prompt_len for r in reqs], [r.max_tokens for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 380 and min(outs) >= 12 and max(outs) <= 243
    assert max(ins) - min(ins) > 250 and max(outs) - min(outs) > 150  # really spread
    assert all(len(r.prompt.split()) == r.prompt_len for r in reqs)
    fixed = random_dataset(5, 128, 128, seed=1)
    assert {(r.prompt_len, r.max_tokens) for r in fixed} == {(128, 128)}


def test_goodput_is_the_highest_rate_within_both_bounds():
    from llm_serving.bench.report import goodput_line

    def run(rate: float, ttft: float, tpot: float, failed: int = 0) -> dict:
        return {"request_rate": rate, "p99_ttft_ms": ttft, "p99_tpot_ms": tpot, "failed": failed,
                "output_throughput": 10 * rate}

    sweep = [run(1, 100, 20), run(2, 180, 30), run(4, 150, 45), run(8, 900, 30), run(3, 100, 20, failed=1)]
    assert goodput_line(sweep, 200, 40).startswith("goodput: 2 req/s (20.0 output tok/s)")
    assert "no swept rate" in goodput_line(sweep, 50, 40)
