"""HTTP clients of a running test server, shared by the end-to-end tests: a greedy request in the
original dialect and a TGI stream, requests at once on threads, /metrics and /stats read, and the
events the tests wait on instead of sleeping (a token generated, the server idle)."""
from __future__ import annotations

import json
import threading
import time

import httpx

GENERATED = "llm_serving_generation_tokens_total"


def original_generate(url: str, prompt: str, new: int = 12, **params) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new, "do_sample": "False", "ignore_eos": "True",
                                             **params}}
    r = httpx.post(f"{url}/models/tiny/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_tgi(url: str, prompt: str, new: int = 12) -> str:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new, "ignore_eos": True}}
    text, final = "", None
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                ev = json.loads(line[5:])
                text += ev["token"]["text"]
                final = ev["generated_text"] or final
    assert final == text
    return text


def server_idle(url: str, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = httpx.get(f"{url}/stats", timeout=10).json()
        if info["running"] == 0 and info["waiting"] == 0 and info["kv_usage"] == [0.0]:
            return info
        time.sleep(0.2)
    raise AssertionError(f"server not idle: {info}")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def concurrent(url: str, prompts: list[str], new: int) -> dict[str, str]:
    out: dict[str, str] = {}
    threads = [threading.Thread(target=lambda p=p: out.__setitem__(p, original_generate(url, p, new=new)["generated_text"]))
               for p in prompts]
    for t in threads:
        t.start()
    return out, threads


def wait_generating(url: str, before: float, timeout: float = 300) -> None:
    """Until the server has generated a token past `before` (GENERATED read before the requests
    were sent): they are mid-stream. An event, where a fixed sleep was early on a loaded machine
    and late on a fast one."""
    deadline = time.monotonic() + timeout
    while metric(url, GENERATED) == before:
        assert time.monotonic() < deadline, "no token generated"
        time.sleep(0.02)
