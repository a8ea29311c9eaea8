"""Memory you can predict (common/memory.py): the plan's arithmetic against the model's real
bytes, `num_blocks: auto` and `kv_cache_memory` through launch_agents and an attached server, a
config too large for this host refused in seconds before any agent starts, and `--dry-run`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from common.config import ConfigError, load_config
from common.config_values import parse_bytes
from common.memory import GiB, ModelShape, kv_block_bytes, weight_bytes
from tests.conftest import TINY
from tests.helpers import ROOT, ServerProcess, tiny_config

TINY_SHAPE = ModelShape(TINY["vocab_size"], TINY["hidden_size"], TINY["intermediate_size"], TINY["num_hidden_layers"],
                        TINY["num_attention_heads"], TINY["num_key_value_heads"],
                        TINY["hidden_size"] // TINY["num_attention_heads"], TINY["max_position_embeddings"])


@pytest.mark.parametrize("text,want", [("8GiB", 8 * GiB), ("512 MiB", 512 << 20), ("20G", 20 * GiB),
                                       ("1.5GB", 1_500_000_000), (4096, 4096)])
def test_byte_counts(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("bad", ["lots", "8 GiBs", "-1GiB", True])
def test_bad_kv_cache_memory_is_a_config_error(tmp_path, bad):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"serving_config": {"kv_cache_memory": bad}}))
    with pytest.raises(ConfigError, match="serving_config.kv_cache_memory"):
        load_config(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_planned_bytes_are_the_models_bytes(tiny_weights, dtype):
    """The plan's weight and KV bytes are what the built model holds (weights within 2%: norms; an
    int8 KV row carries its scale). The tiny model's int8 rows pad to 8 groups (17% here), so its
    weights are not compared."""
    from agent.runner import ModelRunner
    from agent.runner_config import RunnerConfig
    from agent.graph_call import setup_mindspore
    from tests.conftest import tiny_model_config

    setup_mindspore()
    rc = RunnerConfig(num_blocks=40, block_size=16, max_model_len=128, token_buckets=[1], max_running=1,
                      model_dtype=dtype)
    model = ModelRunner(tiny_model_config(), tiny_weights, rc, calibration=list(range(3, 40))).model
    planned = weight_bytes(TINY_SHAPE, dtype)
    assert dtype == "int8" or abs(model.weight_bytes - planned) <= 0.02 * planned, (model.weight_bytes, planned)
    assert model.kv_cache_bytes == 40 * kv_block_bytes(TINY_SHAPE, 16, dtype)  # KV auto: the weights' dtype


def test_a_draft_model_is_in_the_plan_and_auto_blocks_pay_for_its_kv(tmp_path, tiny_model_dir):
    """self_int8 adds its int8 weights and an int8 KV block per target block (its cache has the
    target's geometry); `num_blocks: auto` from kv_cache_memory splits the bytes over both caches."""
    from common.memory import plan
    from common.model_files import resolve_model

    files = resolve_model(str(tiny_model_dir), None)
    cfg = load_config(tiny_config(tmp_path, tiny_model_dir), spec_method="self_int8")
    p = plan(cfg, files, 1)
    assert p.draft == weight_bytes(TINY_SHAPE, "int8") + cfg.num_blocks * kv_block_bytes(TINY_SHAPE, 4, "int8")
    assert "draft model" in p.describe()
    per_block = kv_block_bytes(TINY_SHAPE, 4) + kv_block_bytes(TINY_SHAPE, 4, "int8")
    auto = load_config(tiny_config(tmp_path, tiny_model_dir, num_blocks="auto", kv_cache_memory=300 * per_block),
                       spec_method="self_int8")
    plan(auto, files, 1)
    assert auto.num_blocks == 300


def test_a_config_too_large_for_this_host_stops_before_any_agent(tmp_path, tiny_model_dir):
    """100 million KV blocks (~190 GiB): one line naming what is needed and what is available, exit 1,
    and no agent process ever started (none loaded a weight)."""
    config = tiny_config(tmp_path, tiny_model_dir, num_blocks=100_000_000)
    out = subprocess.run([sys.executable, "-m", "llm_serving.serve", "--config", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    line = [x for x in out.stderr.splitlines() if "needs" in x]
    assert line and "KV cache" in line[0] and "available" in line[0], out.stderr
    assert "100000000 float32 blocks" in line[0]
    assert "weights loaded" not in out.stderr


def test_dry_run_prints_the_plan_of_a_7b_config(tmp_path):
    """llama2-7B's shape (config.json alone, no weights): bf16 weights ~12.8 GiB; float32 with the
    default 1024 blocks cannot fit a 24 GB host (exit 1 where this host has less than 42 GiB)."""
    model = tmp_path / "llama2-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 4096}))
    out = subprocess.run([sys.executable, "-m", "llm_serving.serve", "--dry-run", "--model", str(model), "--dtype",
                          "bfloat16"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    weights = next(x for x in out.stdout.splitlines() if x.strip().startswith("weights"))
    assert 12.5 <= float(weights.split()[1]) <= 13.2, out.stdout
    assert "KV cache     8.00 GiB (1024 bfloat16 blocks)" in out.stdout  # KV auto: bfloat16 with bfloat16 weights
    big = subprocess.run([sys.executable, "-m", "llm_serving.serve", "--dry-run", "--model", str(model)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    if "available:" in big.stdout and float(big.stdout.split("available: ")[1].split()[0]) < 41:
        assert big.returncode == 1 and "does not fit" in big.stdout


LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "max_position_embeddings": 4096}


@pytest.mark.parametrize("dtype,fits", [("float16", True), ("float32", False)])
def test_the_contest_yaml_plans_llama2_7b_on_one_32gb_device(tmp_path, dtype, fits):
    """The original's own YAML (1024 blocks of 16, 4096-token steps) on one 32 GiB Ascend device,
    planned from this machine: float16 fits (weights ~12.6 GiB, a float16 KV cache of 8 GiB);
    float32 does not, and the one line says by how much."""
    model = tmp_path / "llama2-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA2_7B))
    out = subprocess.run([sys.executable, "-m", "llm_serving.serve", "--config", "configs/original/llama2_7b_contest.yaml",
                          "--model", str(model), "--dtype", dtype, "--dry-run", "--device", "Ascend",
                          "--device-memory", "32GiB"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (out.returncode == 0) == fits, out.stdout + out.stderr
    assert "Ascend memory: 32.00 GiB a device" in out.stdout
    if fits:
        assert "KV cache     8.00 GiB (1024 float16 blocks)" in out.stdout and out.stdout.rstrip().endswith("fits")
    else:
        line = out.stdout.splitlines()[-1]
        assert line.startswith("does not fit") and "GiB short" in line and "float16" in line, line
        assert "KV cache 16.00 GiB (1024 float32 blocks)" in line


def test_other_devices_take_float32_or_float16_weights(tmp_path):
    with pytest.raises(ConfigError, match="model_dtype bfloat16 on Ascend"):
        load_config(None, device="Ascend", model_dtype="bfloat16")


def test_auto_pool_from_kv_cache_memory_via_launch_agents_and_attach(tmp_path, tiny_model_dir):
    """launch_agents sizes `num_blocks: auto` from kv_cache_memory; a server attached with the same
    auto YAML takes the agents' pool (handshake num_blocks 0) and serves; /stats reports the pool."""
    per_block = kv_block_bytes(TINY_SHAPE, 4)
    config = tiny_config(tmp_path, tiny_model_dir, num_blocks="auto", kv_cache_memory=f"{100 * per_block}")
    (tmp_path / "run").mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLM_SERVING_RUNTIME_DIR": str(tmp_path / "run")}
    log = tmp_path / "launch.log"
    launcher = subprocess.Popen([sys.executable, "-m", "llm_serving.launch", "--config", str(config)], cwd=ROOT,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "all agents started" not in log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert "100 blocks" in log.read_text()
        srv = ServerProcess(config, "--attach", env=env)
        try:
            r = httpx.post(f"{srv.url}/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}},
                           timeout=60)
            assert r.status_code == 200
            mem = httpx.get(f"{srv.url}/stats").json()["memory"][0]
            assert mem["kv_cache_bytes"] == 100 * per_block and mem["kv_cache_dtype"] == "float32"
            assert 0 < mem["streamed_bytes"] < mem["weight_bytes"] and mem["activation_bytes"] > 0
            assert mem.pop("rss_bytes") > 0  # /stats has it now; /info has what the agent said at attach
            assert httpx.get(f"{srv.url}/info").json()["agents"] == [mem]
        finally:
            srv.stop()
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(60)


def test_a_foreign_model_folder_is_refused_by_its_model_type_before_the_plan_reads_it(tmp_path):
    """A GPT-2 folder as transformers saves it (n_head, not num_attention_heads): one `config:` line
    naming its model_type, not a KeyError from the memory plan."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768,
                                                   "n_head": 12, "n_layer": 12, "n_positions": 1024}))
    out = subprocess.run([sys.executable, "-m", "llm_serving.serve", "--dry-run", "--model", str(model)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "model_type 'gpt2' is not supported" in out.stderr + out.stdout and "Traceback" not in out.stderr
