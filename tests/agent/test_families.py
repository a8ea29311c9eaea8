"""Every served family against Hugging Face transformers (tests/fixtures/families, written by
tools/make_goldens.py from transformers' float32 forward): each folder loads through our loader as
transformers saved it (4.x and 5.x config layouts) and, teacher-forced along transformers' greedy
continuation, gives the same logits at every position and so the same greedy tokens.

Tolerances, relative to the largest logit of the sequence: float32 1e-4; bfloat16 weights 3e-2;
float16 weights 5e-3; int8 (W8A8, per-group or per-channel scales) 6e-2; a GGUF's Q8_0 rows run as stored (no
smoothing) 8e-2 (measured on Zen 4: 1e-6, 1.5e-2, 1.2e-3, 3.9e-2, 5.3e-2). Below float32, the greedy token must still
agree wherever transformers' top two are further apart than the tolerance."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from agent.runner import ModelRunner
from agent.weights.load import load_model
from common.model_files import ModelFiles
from server.sampling_params import SamplingParams
from tests.agent.goldens import FIXTURES, FOLDERS, MAX_LEN, TOLERANCE, forced_logits, golden, runner_for
from tests.helpers import ROOT


def compare(runner: ModelRunner, folder: str, dtype: str, bound: str = "") -> tuple[float, float]:
    """(the largest logit error over the largest logit, the share of positions whose greedy token
    agrees); asserts both against the bounds of `bound` (default: the dtype's)."""
    cases = golden(folder)
    prompt_lens = [len(ids) - 32 for ids, _ in cases]
    got = forced_logits(runner, [ids for ids, _ in cases], prompt_lens)
    tol, worst, agree, total = TOLERANCE[bound or dtype], 0.0, 0, 0
    for (ids, ref), n, ours in zip(cases, prompt_lens, got):
        want = ref[n - 1:]
        scale = np.abs(want).max()
        worst = max(worst, float(np.abs(ours - want).max() / scale))
        top2 = np.sort(want, -1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * tol * scale
        same = ours.argmax(-1) == want.argmax(-1)
        assert same[clear].all(), f"{folder} {dtype}: greedy token differs at {np.flatnonzero(~same & clear)}"
        agree, total = agree + int(same.sum()), total + len(same)
    assert worst <= tol, f"{folder} {dtype}: logit error {worst:.2e} of the largest logit > {tol}"
    return worst, agree / total


# transformers 4.x folders hold their 5.x twin's weights (same seed; tools/make_goldens.py) in the
# older config layout: loaded alike, they run the same model, so the forward runs on the 5.x ones.
TF4 = [f for f in FOLDERS if f.endswith("-tf4")]


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_numpy_decoder_matches_transformers(folder):
    """agent/model/numpy_decoder.py, the decoder as one readable NumPy file, in float64: transformers'
    float32 logits at every position within 1e-5 of the largest."""
    from agent.model.numpy_decoder import NumpyDecoder

    cfg, weights = load_model(ModelFiles("hf", FIXTURES / folder), max_position=MAX_LEN)
    decoder = NumpyDecoder(cfg, weights)
    for ids, want in golden(folder):
        assert np.abs(decoder.forward(list(ids)) - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("folder", [f for f in FOLDERS if f not in TF4])
def test_float32_matches_transformers(folder):
    runner = runner_for(folder)
    compare(runner, folder, "float32")
    speculated_equals_plain(runner, folder)


def speculated_equals_plain(runner: ModelRunner, folder: str) -> None:
    """Greedy with n-gram drafts and with the int8 self-draft's (3 a step, verified in the packed
    step) gives our plain greedy tokens; the self-draft catches prompts up in chunks of its graphs."""
    from agent.speculative.draft_model import DraftModelProposer
    from agent.speculative.ngram import NgramProposer
    from tests.agent.drivers import SpecDriver

    for seq0, proposer in ((2000, NgramProposer(1, 3)), (3000, DraftModelProposer(runner_for(folder, "int8"), "self_int8"))):
        runner.use_proposer(proposer)
        for i, (ids, _) in enumerate(golden(folder)):
            prompt = [int(t) for t in ids[:len(ids) - 32]]
            plain = SpecDriver(runner, SamplingParams(), 0).run([prompt], 24, seq0=1000 + seq0 + i)
            assert SpecDriver(runner, SamplingParams(), 3).run([prompt], 24, seq0=seq0 + i) == plain, \
                f"{folder} case {i} ({proposer.method})"


@pytest.mark.parametrize("folder", TF4)
def test_a_transformers_4_folder_loads_as_its_5_twin(folder):
    """The same config (every field the model reads) and tensors from the 4.x layout, and both
    transformers versions' goldens agree, so the 5.x twin's forward test covers this folder."""
    twin = folder[:-1] + "5"
    (cfg4, w4), (cfg5, w5) = (load_model(ModelFiles("hf", FIXTURES / f), max_position=MAX_LEN) for f in (folder, twin))
    assert cfg4 == cfg5
    assert sorted(w4) == sorted(w5) and all(np.array_equal(w4[k], w5[k]) for k in w4)
    for (ids4, ref4), (ids5, ref5) in zip(golden(folder), golden(twin), strict=True):
        np.testing.assert_array_equal(ids4, ids5)
        assert np.abs(ref4 - ref5).max() <= TOLERANCE["float32"] * np.abs(ref5).max()


# Qwen2's biases with its window; Gemma 3's q/k norms, sandwich norms and scaled embedding
@pytest.mark.parametrize("folder", ["qwen2-window-tf5", "gemma3-tf5"])
def test_plain_mindspore_path_matches_transformers(folder):
    compare(runner_for(folder, native=False), folder, "float32")


@pytest.mark.isa
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8"])
@pytest.mark.parametrize("folder", ["qwen2-tf5", "qwen3-tf5", "mistral-window-tf5", "gemma3-tf5"])
def test_reduced_precision_within_its_tolerance(folder, dtype):
    compare(runner_for(folder, dtype), folder, dtype)


@pytest.mark.isa
@pytest.mark.parametrize("folder", ["qwen2-tf5"])
def test_per_channel_int8_within_its_tolerance(folder):
    """quant_group_size -1 (oneDNN's int8 matmul; `auto` with AVX512-VNNI or AMX), where this CPU has VNNI or AMX
    (measured on Zen 4: qwen2 2.1e-2, qwen3 4.5e-2, mistral-window 4.3e-2, gemma3 2.2e-2)."""
    from tests.helpers import channel_refused_here

    if channel_refused_here():
        return
    compare(runner_for(folder, "int8:-1"), folder, "int8:-1")


@pytest.fixture(scope="module")
def byte_tokenizer_gguf(tmp_path_factory) -> Path:
    """A GGUF holding only a 272-token vocabulary (the fixtures'), for write_gguf to copy: SmolLM2's
    49k tokens would take seconds to write and read back."""
    import gguf

    path = tmp_path_factory.mktemp("tok") / "tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(272)])
    writer.add_token_types([1] * 272)
    writer.add_token_merges(["<0> <1>"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("folder, gguf_dtype, dtype", [
    ("llama3-tf5", "f32", "float32"), ("llama-linear-tf5", "f32", "float32"), ("qwen2-tf5", "f32", "float32"),
    ("qwen3-tf5", "f32", "float32"), ("mistral-window-tf5", "f32", "float32"), ("qwen2-tf5", "q8_0", "int8"),
    ("qwen3-tf5", "q8_0", "int8"), ("gemma3-pattern-tf5", "f32", "float32"), ("gemma3-pattern-tf5", "q8_0", "int8"),
    ("llama3-tf5", "q8_0", "gguf"), ("qwen3-tf5", "q8_0", "gguf"), ("gemma3-pattern-tf5", "q8_0", "gguf")])
def test_gguf_of_the_same_weights_matches_transformers(folder, gguf_dtype, dtype, tmp_path, byte_tokenizer_gguf):
    """The fixture written as GGUF the way llama.cpp's converter names and lays out tensors (the
    gguf package's name map; Llama's Q/K rows permuted, Llama 3's scaling as `rope_freqs`, linear
    scaling as metadata), read back with its Q8_0 rows kept as int8 where the model runs int8, and
    as stored where it runs gguf."""
    from tools.export_model import write_gguf

    cfg, weights = load_model(ModelFiles("hf", FIXTURES / folder))
    path = tmp_path / f"{folder}-{gguf_dtype}.gguf"
    write_gguf(path, cfg, weights, byte_tokenizer_gguf, gguf_dtype)
    compare(runner_for(folder, dtype, files=ModelFiles("gguf", path)), folder, dtype,
            "q8_0" if gguf_dtype == "q8_0" and dtype == "int8" else "")


def _edited(tmp_path: Path, folder: str, extra_tensors: dict | None = None, **config) -> ModelFiles:
    """A copy of a fixture with config.json keys replaced (None: removed) and tensors added."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    out = tmp_path / folder
    shutil.copytree(FIXTURES / folder, out)
    c = json.loads((out / "config.json").read_text())
    c.update(config)
    (out / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    if extra_tensors:
        save_file({**load_file(out / "model.safetensors"), **extra_tensors}, str(out / "model.safetensors"))
    return ModelFiles("hf", out)


@pytest.mark.parametrize("folder, edit, message", [
    ("llama-tf5", dict(model_type="gemma2"), "model_type 'gemma2' is not supported"),
    ("llama-tf5", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope type 'yarn' is not supported"),
    ("llama3-tf4", dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope type 'dynamic' is not supported"),
    ("llama-tf5", dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
    ("llama-tf5", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("llama-tf5", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ("qwen3-tf5", dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
    ("qwen2-tf5", dict(layer_types=["full_attention", "chunked_attention"]), "layer_types .* are not supported"),
    ("gemma3-tf5", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True is not supported"),
    ("gemma3-tf5", dict(hidden_activation="gelu"), "hidden_activation='gelu' is not supported"),
    ("gemma3-tf5", dict(model_type="gemma3"), "model_type 'gemma3' is not supported .*gemma3_text"),
    ("gemma3-tf5", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1e4}}),
     "sliding_attention rope type 'linear' is not supported"),
    ("gemma3-tf5", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "chunked_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters per layer type"),
])
def test_what_would_be_served_wrong_is_refused_by_name(tmp_path, folder, edit, message):
    from agent.weights.families import UnsupportedModel

    with pytest.raises(UnsupportedModel, match=message):
        load_model(_edited(tmp_path, folder, **edit), max_position=MAX_LEN)


def test_a_tensor_nothing_reads_is_refused_by_name(tmp_path):
    from agent.weights.families import UnsupportedModel

    extra = {"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}
    with pytest.raises(UnsupportedModel, match="tensors no qwen2 layer reads .*o_proj.bias"):
        load_model(_edited(tmp_path, "qwen2-tf5", extra))
    # a Qwen2 folder labelled llama: its biases are refused, not dropped
    with pytest.raises(UnsupportedModel, match="no llama layer reads .*q_proj.bias"):
        load_model(_edited(tmp_path / "as-llama", "qwen2-tf5", model_type="llama"))
    with pytest.raises(UnsupportedModel, match="needs tensors the file lacks: model.layers.0.self_attn.k_norm"):
        load_model(_edited(tmp_path / "qwen2-as-3", "llama-tf5", model_type="qwen3"))


def test_an_unsupported_gguf_architecture_is_refused_by_name(tmp_path, byte_tokenizer_gguf):
    import gguf

    from agent.weights.families import UnsupportedModel

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    src = gguf.GGUFReader(str(byte_tokenizer_gguf)).fields
    writer.add_token_list(src["tokenizer.ggml.tokens"].contents())
    writer.add_eos_token_id(257)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="GGUF architecture 'phi3' is not supported"):
        load_model(ModelFiles("gguf", path))


def test_sliding_windows_read_from_either_layout():
    """5.x lists layer_types; 4.x Mistral slides every layer, 4.x Qwen2 from max_window_layers on
    when use_sliding_window, and a null window is no window."""
    from agent.weights.families import _layer_windows

    base = dict(num_hidden_layers=3, sliding_window=8)
    assert _layer_windows(dict(base, layer_types=["sliding_attention", "full_attention", "sliding_attention"])) \
        == (8, 0, 8)
    assert _layer_windows(dict(base, model_type="mistral")) == (8, 8, 8)
    assert _layer_windows(dict(base, model_type="mistral", sliding_window=None)) == ()
    assert _layer_windows(dict(base, model_type="qwen2", use_sliding_window=True, max_window_layers=2)) == (0, 0, 8)
    assert _layer_windows(dict(base, model_type="qwen2", use_sliding_window=False)) == ()
    # Gemma 3 before layer_types: every pattern-th layer global
    assert _layer_windows(dict(base, model_type="gemma3_text", sliding_window_pattern=2)) == (8, 0, 8)


def test_a_gemma3_gguf_reads_which_layers_slide():
    """llama.cpp fixes gemma3's pattern (every 6th layer global) unless the file lists the layers."""
    from agent.weights.gguf import gemma3_sliding

    assert gemma3_sliding(None, 7) == [True] * 5 + [False, True]
    assert gemma3_sliding(3, 3) == [True, True, False]
    assert gemma3_sliding([True, False], 2) == [True, False]


@functools.cache
def gemma3_tokenizer():
    """Read once for every dtype: its 262144 pieces' BPE merges take ~7 s to recover (Zen 3)."""
    from common.model_files import resolve_model
    from common.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("gemma3-270m"))


@pytest.mark.parametrize("dtype", ["float32", "int8", "gguf"])
def test_gemma3_270m_gguf_matches_transformers(dtype):
    """Gemma 3 270M as published (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors) against transformers
    reading the same file with its own GGUF reader (tools/make_goldens.py --gguf): its token ids are
    ours, and teacher-forced along its greedy continuation every position's top logits and
    log-sum-exp agree and so does the greedy token wherever its top two are apart. int8: the
    dequantised K-quant rows requantised per group; gguf: the file's blocks as stored."""
    from common.model_files import resolve_model

    files = resolve_model("gemma3-270m")
    z = np.load(ROOT / "tests" / "fixtures" / "gguf" / "gemma-3-270m-q4_k_m.npz")
    tok = gemma3_tokenizer()
    runner = runner_for("", dtype, files=files)
    tol = TOLERANCE[dtype]
    for i, text in enumerate(["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village"]):
        ids, n = z[f"ids{i}"], int(z[f"prompt_len{i}"])
        assert tok.encode(text) == ids[:n].tolist()
        ours = forced_logits(runner, [ids], [n])[0]
        top, want = z[f"top_ids{i}"], z[f"top{i}"]
        scale = np.abs(want).max()
        got = np.take_along_axis(ours, top, -1)
        assert np.abs(got - want).max() <= tol * scale, f"prompt {i}: top logits off by {np.abs(got - want).max()}"
        clear = want[:, 0] - want[:, 1] > 2 * tol * scale
        assert (ours.argmax(-1) == top[:, 0])[clear].all()
