"""`llm-bench` (serving.py): a vLLM-style serving benchmark against us or any OpenAI/TGI server, with
its report (report.py) and the server's request life cycle read from /metrics (lifecycle.py). Shipped
in the wheel; the other benchmarks live in the checkout's tools/."""
