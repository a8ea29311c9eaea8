"""A user of the original llm-serving: its contest YAML, a copy of it on a small MindFormers
checkpoint, the contest's benchmark client with the seeds' literal command, and its precision check.
Real server processes throughout."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from common.config import load_config
from tests.conftest import tiny_model_config
from tests.helpers import ROOT, ServerProcess, free_port, save_mindformers
from tests.reference import reference_logits

CONTEST = ROOT / "configs/original/llama2_7b_contest.yaml"
CLIENT = ROOT / "tools/test_serving_performance.py"


def test_contest_yaml_keys_get_one_line_each_when_not_honoured():
    notes = load_config(CONTEST).notices
    for key in ("zactivate_len", "model_type", "seq_type", "current_index", "pad_token_id", "tokenizer.type",
                "basic_inputs", "backend 'kbk'"):
        assert sum(key in n for n in notes) == 1, (key, notes)
    assert not [n for n in notes if "max_generate_length" in n or "model_dtype" in n or "unknown" in n]


def test_contest_yaml_stops_naming_what_is_missing_never_another_model():
    r = subprocess.run([sys.executable, "-m", "llm_serving.serve", "--config", str(CONTEST), "--port", str(free_port())],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "model_config.model_cfg_path /home/ma-user/work/mindformers/configs/llama2/predict_llama2_7b.yaml " \
           "not found" in r.stderr
    assert "ready" not in r.stdout


@pytest.fixture(scope="module")
def contest_copy(tmp_path_factory, tiny_model_dir, tiny_weights):
    """The contest YAML, verbatim but for its paths and vocab_size: a MindFormers checkpoint of the tiny model."""
    tmp = tmp_path_factory.mktemp("contest")
    _, mf_yaml = save_mindformers(tmp, tiny_weights)
    doc = yaml.safe_load(CONTEST.read_text())
    doc["model_config"].update(model_cfg_path=str(mf_yaml), vocab_size=272, seq_length=[64],
                               decode_batch_size=[8], max_generate_length=256)
    doc["pa_config"].update(num_blocks=256, decode_seq_length=256)
    doc["tokenizer"]["vocab_file"] = str(tiny_model_dir / "tokenizer.json")
    doc["serving_config"].update(agent_ports=[free_port()], server_port=free_port(),
                                 compile_cache_dir=str(tmp / "mscache"))
    path = tmp / "llama2_7b_contest_tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    srv = ServerProcess(path)
    yield srv, tmp
    srv.stop()


def test_contest_copy_serves_the_checkpoint_its_model_cfg_path_names(contest_copy, tiny_weights):
    srv, _ = contest_copy
    prompt = [72, 101, 108, 108, 111]
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 4, "do_sample": "False", "ignore_eos": "True"}}
    got = [t["id"] for t in httpx.post(f"{srv.url}/models/llama2/generate", json=body, timeout=60).json()["tokens"]]
    ids = list(prompt)
    for _ in range(4):
        ids.append(int(np.argmax(reference_logits(tiny_model_config(), tiny_weights, ids)[-1])))
    assert got == ids[len(prompt):]
    info = json.loads(httpx.get(f"{srv.url}/serving/get_serverd_model_info", timeout=10).text.removeprefix("data: "))
    assert info["model_id"] == "llama_7b" and info["max_input_length"] == 64


def test_the_contest_buckets_are_caps_and_small_steps_run_small_graphs(contest_copy):
    """seq_length [4096] / decode_batch_size [128] are the contest's: steps of 1 to 4096 tokens, 4x
    apart at most; here (its copy: [64] / [8]) a lone decode runs the 1-token graph, a short prompt
    beside running decodes a graph within the budget, and none larger is built."""
    contest = load_config(CONTEST)
    assert contest.token_buckets == [1, 4, 16, 64, 128, 512, 2048, 4096]
    assert sum("step sizes here" in n for n in contest.notices) == 1
    srv, _ = contest_copy
    assert "step graphs: [1, 4, 8, 32, 64] tokens" in srv.log.read_text()
    body = {"inputs": "one alone", "parameters": {"max_new_tokens": 6, "do_sample": "False", "ignore_eos": "True"}}
    before = len(_trace_steps(srv.url))
    assert httpx.post(f"{srv.url}/models/llama2/generate", json=body, timeout=60).status_code == 200
    alone = _trace_steps(srv.url)[before:]
    assert [s["graph_tokens"] for s in alone if s["kind"] == "decode"] == [1] * 5, alone
    threads = [threading.Thread(target=httpx.post, args=(f"{srv.url}/models/llama2/generate",),
                                kwargs={"json": {**body, "parameters": {**body["parameters"], "max_new_tokens": 40}},
                                        "timeout": 60}) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    short = {"inputs": [5] * 10, "parameters": {"max_new_tokens": 2, "do_sample": "False", "ignore_eos": "True"}}
    assert httpx.post(f"{srv.url}/models/llama2/generate", json=short, timeout=60).status_code == 200
    for t in threads:
        t.join(60)
    steps = _trace_steps(srv.url)[before:]
    assert max(s["graph_tokens"] for s in steps) <= 64 and any(s["n_tokens"] >= 10 for s in steps)
    assert all(s["graph_tokens"] >= s["n_tokens"] for s in steps)


def _trace_steps(url: str) -> list[dict]:
    trace = httpx.get(f"{url}/debug/trace", timeout=10).json()["traceEvents"]
    return [e["args"] for e in trace if e.get("pid") == 1 and "graph_tokens" in e.get("args", {})]


def _client(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLIENT), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_contest_client_with_the_seeds_command(contest_copy, tmp_path):
    srv, _ = contest_copy
    port = srv.url.rsplit(":", 1)[1]
    missing = _client("-X", "2", "-P", port, "-O", "./out", "-T", "3", cwd=tmp_path)
    assert missing.returncode == 2 and "--make-sample ./alpaca_5010.json" in missing.stderr
    assert _client("--make-sample", "./alpaca_5010.json", cwd=tmp_path).returncode == 0
    r = _client("-X", "2", "-P", port, "-O", "./out", "-T", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads((tmp_path / "out/result_2.0_x.json").read_text())
    assert len(results) == 6 and all(x["resp_text"] and x["first_token_time"] is not None for x in results)
    sample = json.loads((tmp_path / "alpaca_5010.json").read_text())
    assert results[0]["input"] == sample[0]["instruction"]  # no ":" without an input
    assert results[2]["input"] == sample[2]["instruction"] + ":" + sample[2]["input"]
    summary = json.loads((tmp_path / "out/count_2.0.json").read_text())
    assert summary["requests"] == 6 and summary["failed"] == 0 and summary["output_tokens"] > 0
    [log] = (tmp_path / "testLog").glob("test_performance_*.log")
    text = log.read_text()
    assert "Test Progress --> 6/6" in text and "All Tasks Done; Exec Time is" in text


def test_precision_mode_passes_on_the_same_model_and_fails_on_a_perturbed_one(contest_copy, tmp_path, tiny_model_dir,
                                                                           tiny_weights):
    from safetensors.numpy import save_file

    srv, _ = contest_copy
    (tmp_path / "data.json").write_text(json.dumps([{"instruction": "abc", "input": "", "output": "x"},
                                                    {"instruction": "hello", "input": "world", "output": "y"}]))
    dump = ["--dataset", "data.json", "--prompts", "2", "--every", "4", "--max-new-tokens", "16"]
    for name in ("a.json", "b.json"):
        assert _client("-P", srv.url.rsplit(":", 1)[1], *dump, "--precision-dump", name, cwd=tmp_path).returncode == 0
    same = _client("--precision-compare", "a.json", "b.json", cwd=tmp_path)
    assert same.returncode == 0 and "PASS" in same.stdout

    perturbed = tmp_path / "perturbed"
    shutil.copytree(tiny_model_dir, perturbed)
    rng = np.random.default_rng(1)
    save_file({k: v + (rng.standard_normal(v.shape).astype(np.float32) * 0.02 if k == "lm_head.weight" else 0)
               for k, v in tiny_weights.items()}, str(perturbed / "model.safetensors"))
    doc = yaml.safe_load(srv.config_path.read_text())
    doc["model_config"].update(model_path=str(perturbed), model_cfg_path=None)
    doc["serving_config"].update(agent_ports=[free_port()], server_port=free_port())
    other = tmp_path / "perturbed.yaml"
    other.write_text(yaml.safe_dump(doc))
    p = ServerProcess(other, "--dump-logits", str(tmp_path / "raw-c"), "--dump-every", "4")
    try:
        assert _client("-P", p.url.rsplit(":", 1)[1], *dump, "--precision-dump", "c.json", cwd=tmp_path).returncode == 0
        for f in (tmp_path / "raw-c").glob("*.npy"):  # what the JSON run made the server write
            f.unlink()
        assert _client("-P", p.url.rsplit(":", 1)[1], *dump, "--precision-dump", "raw-c", cwd=tmp_path).returncode == 0
    finally:
        p.stop()
    differ = _client("--precision-compare", "a.json", "c.json", cwd=tmp_path)
    assert differ.returncode == 1 and "FAIL" in differ.stdout

    # The contest's own layout: raw full-vocabulary logits, one .npy per prompt and position.
    doc["model_config"].update(model_path=str(tiny_model_dir))
    doc["serving_config"].update(agent_ports=[free_port()], server_port=free_port())
    same_model = tmp_path / "same.yaml"
    same_model.write_text(yaml.safe_dump(doc))
    for run in ("raw-a", "raw-b"):
        q = ServerProcess(same_model, "--dump-logits", str(tmp_path / run), "--dump-every", "4")
        try:
            r = _client("-P", q.url.rsplit(":", 1)[1], *dump, "--precision-dump", run, cwd=tmp_path)
            assert r.returncode == 0, r.stderr
        finally:
            q.stop()
    from tools.precision import dump_files

    files = dump_files(tmp_path / "raw-a")  # the contest's names: {time}_{ids as floats}_{absolute position}
    assert len({key for key, _, _ in files}) == 2 and len(files) == 8  # 2 prompts x 16 tokens, every 4th position
    assert all(pos % 4 == 0 and re.fullmatch(r"(\d+\.0)+\d*\.?\d*", key) for key, pos, _ in files)
    (key, pos, _), path = next(iter(files.items()))  # the first written
    assert np.load(path).shape == (272,) and np.load(path).dtype == np.float32  # the whole vocabulary
    same = _client("--precision-compare", "raw-a", "raw-b", cwd=tmp_path)
    assert same.returncode == 0 and same.stdout.count("ok  ") == 8 and "precision PASS" in same.stdout
    differ = _client("--precision-compare", "raw-a", "raw-c", cwd=tmp_path)
    assert differ.returncode == 1 and "precision FAIL" in differ.stdout
    assert f"first difference: {path.name} (position {pos})" in differ.stdout, differ.stdout
    missing = _client("-P", q.url.rsplit(":", 1)[1], *dump, "--precision-dump", "nowhere", cwd=tmp_path)
    assert missing.returncode != 0
