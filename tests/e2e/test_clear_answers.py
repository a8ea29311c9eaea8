"""Every input and every config gets a clear answer, through the running server: sampling values
checked in the float32 the sampler uses, TGI ranges whether or not it samples, OpenAI fields we
cannot honour refused, bounded token-id prompts and chunked bodies, and one-line start-up errors."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import ROOT, ServerProcess, tiny_config

ROUTES = [("/generate", "tgi"), ("/models/tiny/generate", "original"), ("/v1/completions", "completions"),
          ("/v1/chat/completions", "chat")]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    srv = ServerProcess(tiny_config(tmp_path_factory.mktemp("answers"), tiny_model_dir))
    yield srv
    srv.stop()


def _body(kind: str, **params) -> dict:
    if kind in ("tgi", "original"):
        return {"inputs": "hello", "parameters": {"max_new_tokens": 4, "do_sample": True, **params}}
    body = {"model": "tiny", "max_tokens": 4, **params}
    if kind == "chat":
        return {**body, "messages": [{"role": "user", "content": "hello"}]}
    return {**body, "prompt": "hello"}


def _error(r: httpx.Response) -> str:
    err = r.json()["error"]
    return err["message"] if isinstance(err, dict) else err


@pytest.mark.parametrize("path, kind", ROUTES)
@pytest.mark.parametrize("name, value", [("top_p", 1e-300), ("top_p", 1e-46), ("repetition_penalty", 1e-300)])
def test_a_value_that_is_zero_in_float32_is_a_400_naming_it(server, path, kind, name, value):
    r = httpx.post(server.url + path, json=_body(kind, temperature=1.0, **{name: value}), timeout=60)
    assert r.status_code == 400 and name in _error(r), r.text


@pytest.mark.parametrize("path, kind", ROUTES)
def test_the_smallest_float32_top_p_samples_the_likeliest_token(server, path, kind):
    """1.4e-45 is the smallest positive float32: nucleus sampling keeps exactly the likeliest token."""
    r = httpx.post(server.url + path, json=_body(kind, temperature=1.0, top_p=1.4e-45, seed=3), timeout=60)
    greedy = httpx.post(server.url + path, json=_body(kind, temperature=0.0), timeout=60)
    assert r.status_code == 200 and greedy.status_code == 200, r.text
    text = (lambda j: j.get("generated_text") or j["choices"][0].get("text") or j["choices"][0]["message"]["content"])
    assert text(r.json()) == text(greedy.json())


@pytest.mark.parametrize("params", [{"top_p": 2}, {"temperature": -1}, {"top_k": -7}, {"min_p": 3}])
def test_tgi_ranges_are_checked_without_do_sample(server, params):
    for path in ("/generate", "/models/tiny/generate"):
        r = httpx.post(server.url + path, json={"inputs": "x", "parameters": {"max_new_tokens": 2, **params}},
                       timeout=30)
        assert r.status_code == 400 and next(iter(params)) in _error(r), r.text


def test_logit_bias_is_refused_and_an_empty_one_is_nothing(server):
    r = httpx.post(f"{server.url}/v1/completions", json={**_body("completions"), "logit_bias": {"5": 10}}, timeout=30)
    assert r.status_code == 400 and "logit_bias" in _error(r)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**_body("chat"), "logit_bias": {}}, timeout=60)
    assert r.status_code == 200, r.text


def test_echo_prepends_the_prompt_and_chat_refuses_it(server):
    body = {"model": "tiny", "prompt": "echo me", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    echoed = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["text"] == "echo me" + plain
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "echo": True, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == "echo me" + plain
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**_body("chat"), "echo": True}, timeout=30)
    assert r.status_code == 400 and "echo" in _error(r), r.text


def test_legacy_logprob_tokens_are_text(server):
    body = {"model": "tiny", "prompt": "a b", "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    tokens = choice["logprobs"]["tokens"]  # special tokens by name, as vLLM shows them; the text skips them
    assert "".join(t for t in tokens if t not in ("<s>", "</s>")) == choice["text"]
    assert not any("Ġ" in t for t in tokens)
    assert all(len(top) >= 1 for top in choice["logprobs"]["top_logprobs"])


def test_a_5mb_token_id_prompt_is_refused_while_health_answers(server):
    # Behaviour, not speed: the refusal names the limit and /health keeps answering while the
    # body is read (wall-clock bounds would fail on an oversubscribed machine).
    ids = list(range(200)) * 5000  # 1,000,000 ids, ~4.9 MB of JSON
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(
        target=lambda: result.setdefault("r", httpx.post(f"{server.url}/generate", json={"inputs": ids}, timeout=60)))
    sender.start()
    answered = 0
    while sender.is_alive() or not answered:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        answered += 1
    sender.join()
    assert result["r"].status_code == 400 and "maximum" in _error(result["r"])
    r = httpx.post(f"{server.url}/generate", json={"inputs": [1] * ((1 << 20) + 1)}, timeout=60)
    assert r.status_code == 400 and "at most" in _error(r)


def test_a_chunked_body_over_the_limit_is_413(server):
    def chunks():
        for _ in range(9):
            yield b" " * (1 << 20)

    for path in ("/generate", "/v1/completions"):
        r = httpx.post(server.url + path, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413 and "larger than" in _error(r), r.text
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("text, says", [
    ("serving_config:\n  max_queue: abc\n", "config: serving_config.max_queue = 'abc': must be an integer"),
    ("serving_config:\n  max_queue: 0\n", "config: serving_config.max_queue = 0: must be >= 1"),
    ("serving_config:\n  step_timeout_s: 0\n", "config: serving_config.step_timeout_s = 0.0: must be >= 1"),
    ("serving_config:\n  heartbeat_s: -1\n", "config: serving_config.heartbeat_s = -1.0: must be in [0.1, 25]"),
    ("serving_config: [1, 2\n", "is not valid YAML at line 2"),
    ("pa_config:\n  num_blocks: 4\n", "need num_blocks >= 129"),
    ("model_config:\n  seq_length: []\n", "config: model_config.seq_length = []"),
    ("serving_config:\n  agent_ports: [61166, 61166]\n", "each port once"),
    (None, "config file"),
])
def test_start_up_config_errors_are_one_line_and_exit_1(tmp_path, text, says):
    path = tmp_path / "bad.yaml"
    if text is not None:
        path.write_text(text)
    for module in ("llm_serving.serve", "llm_serving.launch"):
        out = subprocess.run([sys.executable, "-m", module, "--config", str(path)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
        assert out.returncode == 1 and len(lines) == 1 and says in lines[0], (module, lines)
        assert "Traceback" not in out.stderr


def test_verbose_start_up_errors_carry_the_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("serving_config:\n  max_queue: 0\n")
    out = subprocess.run([sys.executable, "-m", "llm_serving.serve", "--config", str(path), "--verbose"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" in out.stderr and "max_queue" in out.stderr


def test_the_contest_yaml_and_ours_still_load(tmp_path):
    from common.config import load_config

    for path in (ROOT / "configs/smollm2.yaml", ROOT / "configs/original/llama2_7b_contest.yaml"):
        assert load_config(path).agent_ports
    doc = yaml.safe_load((ROOT / "configs/smollm2.yaml").read_text())
    doc["serving_config"]["overlap_steps"] = "False"  # the original clients' string booleans
    (tmp_path / "strbool.yaml").write_text(yaml.safe_dump(doc))
    assert load_config(tmp_path / "strbool.yaml").overlap_steps is False


def test_ctrl_c_stops_the_server_and_its_agents_without_restarts(server):
    """Ctrl-C in a terminal (and `timeout`) signals the whole process group: the agents exit while
    the server finishes its requests. None is restarted, and no traceback is printed. Runs last:
    it stops this module's server."""
    agents = server.agent_pids()
    assert agents
    os.killpg(server.proc.pid, signal.SIGINT)
    assert server.proc.wait(30) == 128 + signal.SIGINT
    log = server.log.read_text()
    assert "restart" not in log and "Traceback" not in log and "ERROR" not in log, log[-3000:]
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in agents) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in agents)
