"""Weight loaders: MindFormers checkpoint + yaml, HF safetensors (incl. bf16), GGUF Q/K un-permutation."""
from __future__ import annotations

import json

import numpy as np
import yaml

from agent.weights import _unpermute, load_model, read_safetensors
from server.model_files import ModelFiles
from tests.conftest import TINY

_HF_TO_MF = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
             "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
             "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2"}


def test_mindformers_checkpoint_loads_by_name_mapping(tmp_path, tiny_weights):
    import mindspore as ms

    params = []
    for name, arr in tiny_weights.items():
        if name == "model.embed_tokens.weight":
            mf = "model.tok_embeddings.embedding_weight"
        elif name == "model.norm.weight":
            mf = "model.norm_out.weight"
        elif name == "lm_head.weight":
            mf = name
        else:
            parts = name.split(".")
            mf = f"model.layers.{parts[2]}.{_HF_TO_MF['.'.join(parts[3:-1])]}.weight"
        params.append({"name": mf, "data": ms.Tensor(arr)})
    ckpt = tmp_path / "llama.ckpt"
    ms.save_checkpoint(params, str(ckpt))
    cfg_yaml = tmp_path / "llama.yaml"
    cfg_yaml.write_text(yaml.safe_dump({"model": {"model_config": {
        "hidden_size": TINY["hidden_size"], "num_layers": TINY["num_hidden_layers"],
        "num_heads": TINY["num_attention_heads"], "n_kv_heads": TINY["num_key_value_heads"],
        "vocab_size": TINY["vocab_size"], "rms_norm_eps": 1e-5, "seq_length": 512}}}))
    cfg, w = load_model(ModelFiles("mindformers", ckpt, cfg_yaml))
    assert cfg.num_kv_heads == 2 and cfg.intermediate_size == TINY["intermediate_size"]
    assert set(w) == set(tiny_weights)
    assert all(np.array_equal(w[k], tiny_weights[k]) for k in w)


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
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, rows/n_head/2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert np.array_equal(_unpermute(permuted, n_head), w)
