"""Shared fixtures: a tiny random Llama written as a real Hugging Face folder (config.json,
model.safetensors, byte-level tokenizer.json), so tests exercise the real loaders and processes.
Each test gets its folder's marker (unit, agent, e2e): `pytest -m unit` runs the seconds-long ones."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import mindspore  # noqa: F401  (before any protobuf user, as the agents do: its generated code needs it first)
import numpy as np
import pytest

from common.cpu import apply_isa_cap
from tests.helpers import GRAPH_CACHE_ENV

# LLM_SERVING_MAX_ISA (the suite run as another CPU kind): oneDNN capped to match before it first
# dispatches in this process; agents and child processes inherit both.
apply_isa_cap()
os.environ.setdefault("LLM_SERVING_LOG", "WARNING")
os.environ.setdefault("LLM_SERVING_LOG_DIR", tempfile.mkdtemp(prefix="llm-serving-logs-"))  # agents' MindSpore logs

TINY = dict(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257,
            model_type="llama")


def tiny_model_config():
    from agent.model_config import ModelConfig

    c = TINY
    return ModelConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                       intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
                       num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                       rms_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
                       max_position=c["max_position_embeddings"], bos_token_id=256, eos_token_ids=[257])


def byte_level_tokenizer_json() -> str:
    """A real byte-level BPE tokenizer: 256 byte tokens + <s>, </s> and a chat marker."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    return tok.to_str()


@pytest.fixture(scope="session")
def tiny_weights() -> dict[str, np.ndarray]:
    from tests.reference import random_weights

    return random_weights(tiny_model_config(), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_weights) -> Path:
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY))
    save_file(tiny_weights, str(d / "model.safetensors"))
    (d / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}))
    return d


@pytest.fixture(scope="session")
def smollm2_fp32_eval(tmp_path_factory) -> dict:
    """SmolLM2's float32 perplexity and greedy continuations (tools/eval_quant.py): the reference the
    int8 and 16-bit accuracy tests compare with, computed once per session (~25 s), shared by
    pytest-xdist's workers through a file in their common temporary folder."""
    import pickle

    from filelock import FileLock

    from tools.eval_quant import evaluate

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return evaluate("smollm2", "float32", 4)
    path = tmp_path_factory.getbasetemp().parent / "smollm2_fp32_eval.pkl"
    with FileLock(f"{path}.lock"):
        if not path.is_file():
            path.write_bytes(pickle.dumps(evaluate("smollm2", "float32", 4)))
        return pickle.loads(path.read_bytes())


# The longest files (each over a minute on 2 cores): run first, so the two workers of `-n 2 --dist
# loadfile` end together instead of one idling while the other runs a long file handed out last.
LONGEST_FIRST = ("agent/test_tensor_parallel.py", "e2e/test_tensor_parallel_serving.py", "agent/test_families.py",
                 "agent/test_smollm2_accuracy.py", "agent/test_model_runner.py", "e2e/test_supervision.py")


def _weight(item: pytest.Item) -> int:
    path = Path(item.path).as_posix()
    return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))


def pytest_configure(config: pytest.Config) -> None:
    """One graph compile cache for the run (xdist's workers inherit the variable): the servers and
    agents of many tests share a config, and each built the same graphs into its own folder (a
    tiny server's start: 11.6 s cold, 5.8 s from the cache; Zen 3). The cache key
    (agent.runner_config.compile_cache_key) holds all a graph depends on, as for the product's own
    cache, which data-parallel agents share the same way."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[GRAPH_CACHE_ENV] = tempfile.mkdtemp(prefix="llm-serving-graphs-")
        # The native kernels built once, before the workers start: on a clean checkout each worker's
        # first model and every agent it started at once built them side by side (35 s of CPU each
        # on Zen 3), and the first tests ran 50-80 s.
        from agent.kernels import library

        library()


def pytest_unconfigure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(os.environ.pop(GRAPH_CACHE_ENV, ""), ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = Path(item.path).parent.name
        if group in ("unit", "agent", "e2e"):
            item.add_marker(group)
    items.sort(key=_weight)  # stable: each file's tests keep their order
