"""LoRA adapters against transformers + PEFT (tests/fixtures/lora, written by tools/make_lora_goldens.py
from PEFT's float32 forward): two adapters of different ranks, targets and scaling (rsLoRA) on the tiny
Llama and Qwen2 fixtures, in slots of one model, and sequences of the base and of each adapter packed
into the same steps. Each sequence's logits are PEFT's within float32's tolerance (1e-4 of the largest
logit) and its greedy tokens PEFT's. Refusals: every field or tensor that cannot be served, by name."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from agent.lora import read_adapter
from common.lora import AdapterError
from agent.runner_config import RunnerConfig
from agent.weights.load import load_model
from common.memory import ModelShape, lora_bytes, weight_bytes
from common.model_files import ModelFiles
from tests.agent.goldens import ADAPTERS, FIXTURES as FAMILIES, LORA, MAX_LEN, TOLERANCE, forced_logits, lora_golden, lora_runner


@pytest.mark.parametrize("base,native,dtype", [("llama-tf5", True, "float32"), ("qwen2-tf5", True, "float32"),
                                               ("llama-tf5", False, "float32"), ("qwen2-tf5", True, "bfloat16"),
                                               ("llama-tf5", True, "int8")],
                         ids=["llama-native", "qwen2-native", "llama-plain", "qwen2-bf16", "llama-int8"])
def test_base_and_adapters_packed_together_match_peft(base, native, dtype):
    """Every prompt three times in the same steps (base, adapter 1, adapter 2): each its own reference's
    logits at every position of its greedy continuation (float32's tolerance, or bfloat16 weights' and
    A rows': tests/agent/test_families.py), and so its greedy tokens (bfloat16: where PEFT's top two
    are further apart than that)."""
    runner, tol = lora_runner(base, native, dtype=dtype), TOLERANCE[dtype]
    c = runner.cfg  # the memory plan counts the slots' bytes as they are held
    shape = ModelShape(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
                       c.head_dim, c.max_position)
    if dtype == "int8":  # the adapters' share, exactly (the plan's int8 base ignores the tiny rows' padding)
        held = sum(p.nbytes for p in runner.model.get_parameters() if p.name.startswith("lora.") or
                   p.name.endswith(".w3"))  # B rows, and the A rows beside each int8 weight
        assert held == lora_bytes(shape, 3, 16, dtype)
    else:
        planned = weight_bytes(shape, dtype) + lora_bytes(shape, 3, 16, dtype)
        assert abs(runner.model.weight_bytes - planned) <= 0.02 * planned, (runner.model.weight_bytes, planned)
    refs = {a: lora_golden(base, name) for a, name in enumerate(("base", *ADAPTERS))}
    cases = [(a, i) for a in refs for i in range(len(refs[0]))]
    seqs = [refs[a][i][0] for a, i in cases]
    prompt_lens = [len(ids) - 16 for ids in seqs]  # every continuation is 16 tokens
    got = forced_logits(runner, seqs, prompt_lens, [a for a, _ in cases])
    for (a, i), ids, n, ours in zip(cases, seqs, prompt_lens, got):
        want = refs[a][i][1][n - 1:]
        scale = np.abs(want).max()
        assert np.abs(ours - want).max() <= tol * scale, f"{base}: adapter {a}, prompt {i}"
        top2 = np.sort(want, -1)[:-1, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * tol * scale
        assert (ours.argmax(-1)[:-1] == ids[n:])[clear].all()  # the greedy continuation PEFT took
        if a:  # the adapter changes the model (at the prompt's last token): one not applied would fail here
            assert np.abs(want[0] - refs[0][i][1][n - 1]).max() > 0.1 * scale  # ours: 0.2-0.8


def _copy(tmp_path, base: str = "llama-tf5", name: str = "all16"):
    folder = tmp_path / name
    shutil.copytree(LORA / base / name, folder)
    return folder, json.loads((folder / "adapter_config.json").read_text())


def _cfg():
    return load_model(ModelFiles("hf", FAMILIES / "llama-tf5"), max_position=MAX_LEN)[0]


@pytest.mark.parametrize("field,value", [("use_dora", True), ("bias", "lora_only"), ("modules_to_save", ["lm_head"]),
                                         ("rank_pattern", {"q_proj": 4}), ("peft_type", "IA3")])
def test_variants_we_do_not_serve_are_refused_by_field(tmp_path, field, value):
    folder, c = _copy(tmp_path)
    c[field] = value
    (folder / "adapter_config.json").write_text(json.dumps(c))
    with pytest.raises(AdapterError, match=field):
        read_adapter("x", folder, _cfg(), 16)


def test_rank_over_the_limit_a_module_we_lack_and_another_base_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    cfg = _cfg()
    with pytest.raises(AdapterError, match="rank 16 is over max_lora_rank 8"):
        read_adapter("x", LORA / "llama-tf5" / "all16", cfg, 8)
    folder, _ = _copy(tmp_path)
    tensors = load_file(folder / "adapter_model.safetensors")
    head = {"base_model.model.lm_head.lora_A.weight": np.zeros((16, 64), np.float32)}
    save_file({**tensors, **head}, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="lm_head.lora_A.weight is not served"):
        read_adapter("x", folder, cfg, 16)
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    save_file({**tensors, key: np.zeros((16, 96), np.float32)}, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="another base model"):
        read_adapter("x", folder, cfg, 16)
    b = next(k for k in tensors if ".lora_B." in k)
    save_file({**tensors, b: np.where(np.arange(tensors[b].size).reshape(tensors[b].shape) == 3, np.nan,
                                      tensors[b]).astype(tensors[b].dtype)}, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="lora_B holds NaN or infinite values"):  # it loaded; each request failed
        read_adapter("x", folder, cfg, 16)


def test_the_compile_cache_keeps_lora_graphs_apart():
    """Graphs with LoRA slots take more inputs and wider projections: a server started with adapters
    never loads the cached graphs of one started without (they served non-finite logits once)."""
    from agent.runner_config import compile_cache_key
    from common.config import ServingConfig

    cfg = _cfg()
    keys = {compile_cache_key(cfg, RunnerConfig.from_serving(ServingConfig(num_blocks=64, max_model_len=MAX_LEN, **kw)))
            for kw in ({}, {"lora_modules": {"a": "/x"}}, {"lora_modules": {"a": "/x"}, "max_lora_rank": 8})}
    assert len(keys) == 3


@pytest.mark.parametrize("native,dtype", [(True, "float32"), (False, "float32"), (True, "int8")],
                         ids=["native", "plain", "int8"])
def test_a_slot_written_between_steps_serves_its_new_adapter(native, dtype):
    """An adapter written into a built model's slot (the graphs as they are) gives PEFT's logits from
    the next step on; a slot emptied gives the base model's; a rank over the slots' is refused."""
    runner, tol = lora_runner("llama-tf5", native, slots=2, dtype=dtype), TOLERANCE[dtype]  # qv8 in slot 0, all16 in 1
    cfg = runner.cfg
    refs = {name: lora_golden("llama-tf5", name) for name in ("base", *ADAPTERS)}

    def worst(name: str, adapter: int) -> float:
        seqs = [ids for ids, _ in refs[name]]
        lens = [len(ids) - 16 for ids in seqs]
        got = forced_logits(runner, seqs, lens, [adapter] * len(seqs))
        return max(float(np.abs(g - ref[n - 1:]).max() / np.abs(ref[n - 1:]).max())
                   for g, (_, ref), n in zip(got, refs[name], lens))

    all16 = runner.lora.adapters[1]
    runner.load_adapter(0, all16)  # slot 0 now holds what slot 1 holds
    assert worst("all16", 1) <= tol
    runner.load_adapter(1, read_adapter("qv8", LORA / "llama-tf5" / "qv8", cfg, 16))
    assert worst("qv8", 2) <= tol
    runner.load_adapter(0, None)
    assert worst("base", 1) <= tol
    with pytest.raises(ValueError, match="rank 16 is over max_lora_rank 8"):
        runner.lora.rank = 8
        runner.load_adapter(0, all16)


@pytest.mark.parametrize("base", ["llama-tf5", "qwen2-tf5"])
def test_llama_cpp_gguf_adapters_serve_peft_s_logits(base, tmp_path):
    """Both adapters as llama.cpp's convert_lora_to_gguf.py writes them (tools/lora_adapter.py: the
    gguf package's tensor names + .lora_a/.lora_b, Llama's Q/K lora_b rows permuted as its base rows
    are, `adapter.lora.alpha`; llama.cpp scales by alpha / r, so the rsLoRA one is written with
    alpha x sqrt(r)), read back into the slots: PEFT's logits within float32's tolerance."""
    from tools.lora_adapter import write_gguf_adapter

    runner = lora_runner(base, True)
    for slot, (name, alpha) in enumerate((("qv8", None), ("all16", 8 * 16 ** 0.5))):
        path = write_gguf_adapter(LORA / base / name, str(FAMILIES / base), tmp_path / f"{name}.gguf", alpha)
        adapter = read_adapter(name, path, runner.cfg, 16)
        assert adapter.mats.keys() == read_adapter(name, LORA / base / name, runner.cfg, 16).mats.keys()
        runner.load_adapter(slot, adapter)
    cases = [(a, ids, ref) for a, name in ((1, "qv8"), (2, "all16")) for ids, ref in lora_golden(base, name)[:3]]
    got = forced_logits(runner, [ids for _, ids, _ in cases], [len(ids) - 16 for _, ids, _ in cases],
                        [a for a, _, _ in cases])
    for (a, ids, ref), ours in zip(cases, got):
        want = ref[len(ids) - 17:]
        assert np.abs(ours - want).max() <= TOLERANCE["float32"] * np.abs(want).max(), f"{base}: adapter {a}"


def _gguf_adapter(path, arch: str = "llama", meta: dict | None = None, tensors: dict | None = None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"general.type": "adapter", "adapter.type": "lora", **(meta or {})}.items():
        (w.add_float32 if isinstance(value, float) else w.add_string)(key, value)
    for name, t in (tensors or {"blk.0.attn_v.weight.lora_a": np.zeros((4, 64), np.float32),
                                "blk.0.attn_v.weight.lora_b": np.zeros((32, 4), np.float32)}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_adapters_we_cannot_serve_are_refused_by_name(tmp_path):
    cfg = _cfg()
    assert read_adapter("x", _gguf_adapter(tmp_path / "ok.gguf", meta={"adapter.lora.alpha": 8.0}), cfg, 16).rank == 4
    zeros = {"blk.0.attn_v.weight.lora_a": np.zeros((4, 64), np.float32)}
    for n, (kw, says) in enumerate([
            (dict(meta={"general.type": "model"}), "is not a LoRA adapter GGUF"),
            (dict(arch="qwen2"), "general.architecture 'qwen2'"),
            (dict(meta={"adapter.alora.invocation_tokens": "x"}), "adapter.alora.invocation_tokens is not served"),
            (dict(tensors={**zeros, "token_embd.weight.lora_a": np.zeros((4, 64), np.float32)}),
             "token_embd.weight.lora_a is not served"),
            (dict(tensors=zeros), "lora_a without its pair"),
            (dict(tensors={**zeros, "blk.0.attn_v.weight.lora_b": np.zeros((64, 4), np.float32)}), "another base")]):
        with pytest.raises(AdapterError, match=re.escape(says)):
            read_adapter("x", _gguf_adapter(tmp_path / f"bad{n}.gguf", **kw), cfg, 16)


def test_identical_rows_of_one_adapter_on_int8_give_the_bits_one_gives_alone():
    """int8's integer sums make a row's base logits its own whatever the step holds; its adapter's
    float shrink and expand must too: six copies of one prompt on one adapter in the same steps each
    give the bits the prompt gives alone (8 identical greedy requests came back as 4-5 texts)."""
    runner = lora_runner("llama-tf5", True, dtype="int8")
    ids, _ = lora_golden("llama-tf5", "all16")[0]
    n = len(ids) - 16
    alone = forced_logits(runner, [ids], [n], [2])[0]
    for got in forced_logits(runner, [ids] * 6, [n] * 6, [2] * 6):
        np.testing.assert_array_equal(got, alone)
