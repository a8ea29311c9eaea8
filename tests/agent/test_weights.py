"""Weight loaders: MindFormers checkpoint + yaml, HF safetensors (incl. bf16), GGUF Q/K un-permutation."""
from __future__ import annotations

import json

import numpy as np
import pytest

from agent.model.quant import bf16_bits
from agent.weights.gguf import unpermute_rows
from agent.weights.load import load_model, read_safetensors
from common.model_files import ModelFiles
from tests.conftest import TINY
from tests.helpers import ROOT, save_mindformers
from tools.export_model import permute_qk


def test_mindformers_checkpoint_loads_by_name_mapping(tmp_path, tiny_weights):
    ckpt, cfg_yaml = save_mindformers(tmp_path, tiny_weights)
    cfg, w = load_model(ModelFiles("mindformers", ckpt, cfg_yaml))
    assert cfg.num_kv_heads == 2 and cfg.intermediate_size == TINY["intermediate_size"]
    assert set(w) == set(tiny_weights)
    assert all(np.array_equal(w[k], tiny_weights[k]) for k in w)


def test_a_mindformers_tensor_nothing_reads_is_refused_by_name(tmp_path, tiny_weights):
    """A bias (or any parameter) MindFormers names and no layer here reads: refused, not skipped."""
    from agent.weights.families import UnsupportedModel
    from tests.helpers import save_mindformers

    for name, shown in (("model.layers.0.attention.wq.bias", "model.layers.0.self_attn.q_proj.bias"),
                        ("model.freqs_mgr.scale", r"\(mindformers\) model.freqs_mgr.scale")):
        ckpt, cfg_yaml = save_mindformers(tmp_path, tiny_weights, {name: np.ones(64, np.float32)})
        with pytest.raises(UnsupportedModel, match=f"no llama layer reads .*{shown}"):
            load_model(ModelFiles("mindformers", ckpt, cfg_yaml))


def test_safetensors_bf16_and_hf_config(tmp_path, tiny_model_dir, tiny_weights):
    w = read_safetensors(tiny_model_dir / "model.safetensors")
    assert all(np.array_equal(w[k], tiny_weights[k]) for k in w)
    # bf16 shard: the top 16 bits of float32
    a = np.array([[1.5, -2.0], [0.15625, 3.0]], np.float32)
    raw = (a.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    header = json.dumps({"x": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, len(raw)]}}).encode()
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + raw)
    assert np.array_equal(read_safetensors(path)["x"], a)
    cfg, _ = load_model(ModelFiles("hf", tiny_model_dir))
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)


def test_gguf_unpermute_inverts_llama_cpp_permutation():
    n_head, rows, cols = 4, 32, 5
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    # permute_qk is llama.cpp convert_hf_to_gguf.py's reshape(n_head, 2, rows/n_head/2, ...).swapaxes(1, 2)
    permuted = permute_qk(w, n_head)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(permuted[unpermute_rows(rows, n_head)], w)


def test_export_round_trips_through_our_loaders(tmp_path):
    """tools/export_model.py writes what peers load (HF folder, GGUF f32/f16); reading them back
    gives the same weights and config, so a peer comparison runs one model everywhere."""
    from agent.model_config import ModelConfig
    from common.model_files import resolve_model
    from common.tokenizer import load_tokenizer
    from tools.export_model import random_llama, write_gguf, write_hf

    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=True, max_position=256, eos_token_ids=[2])
    w = random_llama(cfg, seed=1)
    tok_src = resolve_model("smollm2").path
    write_hf(tmp_path, cfg, w, tok_src)
    for dtype in ("f32", "f16"):
        write_gguf(tmp_path / f"m-{dtype}.gguf", cfg, w, tok_src, dtype)
    hf_cfg, hf_w = load_model(ModelFiles("hf", tmp_path))
    assert (hf_cfg.num_kv_heads, hf_cfg.tie_word_embeddings, hf_cfg.eos_token_ids) == (2, True, [2])
    assert set(hf_w) == set(w) and all(np.array_equal(hf_w[k], w[k]) for k in w)
    g_cfg, g_w = load_model(ModelFiles("gguf", tmp_path / "m-f32.gguf"))
    assert (g_cfg.num_layers, g_cfg.num_heads, g_cfg.num_kv_heads) == (2, 4, 2)
    assert all(np.array_equal(g_w[k], w[k]) for k in w)
    _, h_w = load_model(ModelFiles("gguf", tmp_path / "m-f16.gguf"))
    assert max(float(np.abs(h_w[k] - w[k]).max()) for k in w) < 1e-4
    write_hf(tmp_path / "bf16", cfg, w, tok_src, "bf16")  # written straight to bf16, tensor by tensor
    _, b_w = load_model(ModelFiles("hf", tmp_path / "bf16"))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(np.array_equal(b_w[k], (bf16_bits(w[k]).astype(np.uint32) << 16).view(np.float32)) for k in w)
    text = "Paris, 1889: the Eiffel Tower!"
    ids = load_tokenizer(ModelFiles("gguf", tok_src)).encode(text)
    assert load_tokenizer(ModelFiles("hf", tmp_path)).encode(text) == ids
    assert load_tokenizer(ModelFiles("gguf", tmp_path / "m-f32.gguf")).encode(text) == ids


def test_mindformers_base_config_chains_resolve_without_the_extra(tmp_path):
    """As MindFormerConfig merges them: bases relative to the yaml, a list of bases in order, the
    child's nested keys merged into the base's; load_checkpoint found in a base. With the extra
    installed, mindformers itself reads the chain and must agree."""
    import pytest
    import yaml

    from agent.weights.load import mindformers_model_config
    from common.model_files import mindformers_yaml, resolve_model

    ckpt = tmp_path / "llama.ckpt"
    ckpt.write_bytes(b"x")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "llama.yaml").write_text(yaml.safe_dump({
        "load_checkpoint": str(ckpt), "model": {"model_config": {"hidden_size": 64, "num_layers": 2}}}))
    (tmp_path / "base" / "run.yaml").write_text(yaml.safe_dump({"base_config": "llama.yaml", "seed": 1,
                                                                "model": {"model_config": {"num_heads": 4}}}))
    (tmp_path / "other.yaml").write_text(yaml.safe_dump({"seed": 2, "runner": {"batch": 8}}))
    child = tmp_path / "child.yaml"
    child.write_text(yaml.safe_dump({"base_config": ["base/run.yaml", "other.yaml"],
                                     "model": {"model_config": {"num_layers": 3}}}))
    assert mindformers_model_config(child) == {"hidden_size": 64, "num_layers": 3, "num_heads": 4}
    doc = mindformers_yaml(child)
    assert doc["seed"] == 2 and doc["runner"] == {"batch": 8} and "base_config" not in doc
    files = resolve_model(None, str(child))  # the original's way: model_cfg_path alone names the weights
    assert files.path == ckpt and files.cfg_path == child
    (tmp_path / "a.yaml").write_text("base_config: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base_config: a.yaml\n")
    with pytest.raises(ValueError, match="base_config cycle"):
        mindformers_yaml(tmp_path / "a.yaml")
    (tmp_path / "lost.yaml").write_text("base_config: nowhere.yaml\n")
    with pytest.raises(FileNotFoundError, match="nowhere.yaml not found .base_config of"):
        mindformers_yaml(tmp_path / "lost.yaml")


_LOAD_CHILD = """
import sys
from pathlib import Path
import mindspore  # noqa: F401  (its runtime is part of the final RSS, not of loading)
from agent.runner import ModelRunner
from agent.runner_config import RunnerConfig
from agent.graph_call import setup_mindspore
from agent.weights.load import load_model
from common.model_files import ModelFiles

def status(key):  # kB; VmHWM, unlike ru_maxrss, does not carry the forking parent's peak over exec
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) * 1024

setup_mindspore()
cfg, weights = load_model(ModelFiles(sys.argv[1], Path(sys.argv[2])), 128)
rc = RunnerConfig(num_blocks=8, block_size=16, max_model_len=128, token_buckets=[1], max_running=1, model_dtype=sys.argv[3])
runner = ModelRunner(cfg, weights, rc)
del weights
print(status("VmRSS"), status("VmHWM"), runner.model.weight_bytes)
"""


@pytest.mark.parametrize("kind,dtype", [("hf", "bfloat16"), ("gguf", "bfloat16"), ("hf", "float32")])
def test_loading_streams_tensor_by_tensor(tmp_path, kind, dtype):
    """Peak RSS while loading and building the model stays within 35% of the float32 model's bytes
    above the final RSS: tensors are read from the memory-mapped file one at a time and converted to
    their final dtype (a whole-model float32 dict first, as before, peaked ~40% above final at
    bfloat16, ~230 MB here; streamed, 38-57 MB: one layer's conversion and the file pages read)."""
    import subprocess
    import sys

    from agent.model_config import ModelConfig
    from common.model_files import resolve_model
    from tools.export_model import random_llama, write_gguf, write_hf

    cfg = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=16, num_heads=8,
                      num_kv_heads=4, max_position=128, eos_token_ids=[2])
    w = random_llama(cfg, seed=1)  # ~200 MB as float32
    tok = resolve_model("smollm2").path
    path = tmp_path / "m"
    if kind == "hf":
        write_hf(path, cfg, w, tok)
    else:
        path = tmp_path / "m-f32.gguf"
        write_gguf(path, cfg, w, tok, "f32")
    del w
    out = subprocess.run([sys.executable, "-c", _LOAD_CHILD, kind, str(path), dtype], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    final, peak, weight_bytes = map(int, out.stdout.split()[-3:])
    assert weight_bytes < (0.6 if dtype == "bfloat16" else 1.1) * 200e6
    assert peak - final <= 0.35 * 200e6, (peak / 2**20, final / 2**20)
