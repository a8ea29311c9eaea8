"""The serving YAML: every key one row of the table, unknown and unhonoured keys named, the original's
YAMLs read, the shipped configs clean, the vocabulary checks."""
from __future__ import annotations

import re

import pytest
import yaml

from common.config import ServingConfig
from tests.helpers import ROOT


def test_vocab_checks_allow_padding_and_refuse_another_model():
    from llm_serving.boot import vocab_mismatch

    cfg = ServingConfig()
    assert vocab_mismatch(cfg, 151665, 151936) is None  # Qwen2: embedding padded past the tokenizer
    assert vocab_mismatch(cfg, 260, 272) is None
    assert "the tokenizer has 32000 ids, the model 49152" in vocab_mismatch(cfg, 32000, 49152)  # llama2 on SmolLM2
    cfg.vocab_size = 32000
    assert "model_config.vocab_size is 32000, the model has 49152" in vocab_mismatch(cfg, 49152, 49152)


def test_unknown_and_unhonoured_config_keys_are_named(tmp_path):
    from common.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("model_config:\n  batching_strategy: static\n  model_dtype: float8\n  mystery: 1\n"
                    "serving_config:\n  decode_batch_waiting_time: 0.5\nextra_section: {}\n")
    notes = load_config(path).notices
    assert any("unknown key model_config.mystery" in n for n in notes)
    assert any("unknown section 'extra_section'" in n for n in notes)
    assert any("batching_strategy 'static'" in n for n in notes)
    assert any("model_dtype 'float8'" in n for n in notes)
    assert any("decode steps never wait" in n for n in notes)
    assert load_config(path).model_dtype == "float32"


@pytest.mark.parametrize("value,dtype", [("DataType.INT8", "int8"), ("int8", "int8"), ("w8a8", "int8"),
                                         ("DataType.FLOAT32", "float32"), ("float8", "float32"),
                                         ("DataType.BFLOAT16", "bfloat16"), ("bf16", "bfloat16"),
                                         ("DataType.FLOAT16", "float16")])
def test_model_dtype_spellings(tmp_path, value, dtype):
    from common.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(f"model_config:\n  model_dtype: {value}\n")
    cfg = load_config(path)
    assert cfg.model_dtype == dtype
    assert any("model_dtype" in n for n in cfg.notices) == (value == "float8")
    with pytest.raises(ValueError, match="quant_group_size"):
        load_config(path, quant_group_size=2)


@pytest.mark.parametrize("value,flags,group", [
    ("auto", {"avx2", "avx512_vnni"}, -1), ("auto", {"avx2", "amx_int8", "avx512_vnni"}, -1),
    ("auto", {"avx2", "fma"}, 72), ("auto", {"avx2", "avx_vnni"}, 72), ("AUTO", {"avx512_vnni"}, -1),
    (64, {"avx512_vnni"}, 64), ("-1", {"avx2"}, -1), (0, {"amx_int8"}, 0)])
def test_quant_group_size_auto_is_per_channel_where_the_cpu_has_avx512_vnni_or_amx(tmp_path, value, flags, group):
    from common.config import int8_group, load_config

    path = tmp_path / "c.yaml"
    path.write_text(f"model_config:\n  quant_group_size: {value}\n")
    assert int8_group(load_config(path).quant_group_size, flags) == group
    assert ServingConfig().quant_group_size == "auto"
    with pytest.raises(ValueError, match="quant_group_size"):
        load_config(path, quant_group_size="channel")


def test_config_doc_is_the_config_table():
    """docs/config.md's key tables are generated from common/config_keys.py (python -m tools.config_doc)."""
    from common.config_keys import IGNORED_SECTIONS, KEYS
    from tools.config_doc import DOC, render

    doc = DOC.read_text()
    assert render(doc) == doc, "docs/config.md is stale: run python -m tools.config_doc"
    assert all(f"| `{k.key}` |" in doc for k in KEYS) and all(f"`{s}`" in doc for s in IGNORED_SECTIONS)


def test_a_config_key_is_one_row_of_the_table(tmp_path):
    """Loading, the range check and the notices all follow the table: a row's reader, check and
    ignored reason are what a YAML gets."""
    from common.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("model_config:\n  zactivate_len: [512]\n  seq_length: 64\npa_config:\n  decode_seq_length: 64\n"
                    "serving_config:\n  kv_cache_memory: 1GiB\n  warmup: 'False'\n")
    cfg = load_config(path)
    assert (cfg.prefill_buckets, cfg.max_model_len, cfg.kv_cache_memory, cfg.num_blocks, cfg.warmup) == \
        ([64], 64, 1 << 30, 0, False)
    assert any(n.startswith("model_config.zactivate_len: ignored") for n in cfg.notices)
    path.write_text("serving_config:\n  agent_hosts: localhost\n")
    with pytest.raises(ConfigError, match="agent_hosts = 'localhost': must be a list of hosts"):
        load_config(path)


def test_an_original_ge_yaml_is_served_as_its_ranks_or_refused(tmp_path):
    """The GE backend's `model_path` section (MindIR graphs per rank, one per port) maps to that many
    tensor-parallel ranks of the model's weights; without weights it is refused, never another model."""
    from common.config import ConfigError, load_config

    ge = {"model_path": {"prefill_model": [f"/g/prefill_rank{r}.mindir" for r in range(4)],
                         "decode_model": [f"/g/decode_rank{r}.mindir" for r in range(4)]},
          "serving_config": {"agent_ports": [61166, 61167, 61168, 61169]}}
    path = tmp_path / "ge.yaml"
    path.write_text(yaml.safe_dump({**ge, "model_config": {"model_cfg_path": "/m/predict_llama2_70b.yaml"}}))
    cfg = load_config(path)
    assert cfg.groups == [[0, 1, 2, 3]] and not any("unknown section" in n for n in cfg.notices)
    path.write_text(yaml.safe_dump({**ge, "model_config": {"model_name": "llama_70b"}}))
    with pytest.raises(ConfigError, match="MindIR graphs cannot be served here"):
        load_config(path)
    with pytest.raises(ConfigError, match="must divide the 3 agent_ports"):
        load_config(None, agent_ports=[1, 2, 3], tensor_parallel_size=2)


def test_shipped_configs_need_no_warning():

    from common.config import load_config

    assert load_config(ROOT / "configs/smollm2.yaml").notices == []


def test_speculative_config_from_yaml_and_from_vllm_json(tmp_path):
    from common.config import ConfigError, load_config, speculative_overrides

    path = tmp_path / "spec.yaml"
    path.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 5\n  prompt_lookup_max: 6\n")
    cfg = load_config(path)
    assert (cfg.spec_method, cfg.spec_tokens, cfg.spec_lookup_max, cfg.spec_lookup_min) == ("ngram", 5, 6, 2)
    assert not any("speculative" in n for n in cfg.notices)
    over = speculative_overrides('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}')
    assert over == {"spec_method": "ngram", "spec_tokens": 3, "spec_max_batch": 4}
    assert load_config(None, **over).spec_tokens == 3
    for text, says in (('{"method": "eagle"}', "eagle is not served"), ('{"method": "ngram", "k": 2}', "unknown keys ['k']"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"method": "ngram", "prompt_lookup_min": 5}', "prompt_lookup_min = 5"), ("[1]", "JSON object"),
                       ("{", "not JSON"), ('{"num_speculative_tokens": 4}', "['num_speculative_tokens'] without method")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(None, **speculative_overrides(text))
    path.write_text("speculative_config:\n  num_speculative_tokens: 5\n  prompt_lookup_max: 6\n")
    with pytest.raises(ConfigError, match=re.escape("sets ['num_speculative_tokens', 'prompt_lookup_max'] without method")):
        load_config(path)
    path.write_text("speculative_config:\n  method: null\n")
    assert load_config(path).spec_method is None  # the section with nothing set: off, as without it


def test_the_start_log_names_the_speculative_method_and_k():
    from common.config import load_config
    from llm_serving.serve import speculative_line

    cfg = load_config(None, spec_method="ngram", spec_tokens=5, spec_max_batch=8)
    assert speculative_line(cfg) == "method ngram (prompt lookup of 2-4 tokens), k = 5 tokens a step, off above 8 running"


def test_draft_model_methods_and_their_refusals(tmp_path):
    from common.config import ConfigError, load_config, speculative_overrides
    from common.memory import draft_costs
    from common.model_files import resolve_model

    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"], "model_type": "bert"}')
    for path, says in (("/nonexistent/draft", "not found"), (str(tmp_path), "'bert' is not supported")):
        cfg = load_config(None, spec_method="draft", spec_draft_model=path)
        with pytest.raises(ConfigError, match=re.escape(f"speculative_config.draft_model_path {path}: ") + ".*" + says):
            draft_costs(cfg, resolve_model(cfg.model_path, cfg.model_cfg_path))

    over = speculative_overrides('{"method": "draft", "draft_model_path": "/m/draft", "num_speculative_tokens": 4}')
    assert over == {"spec_method": "draft", "spec_draft_model": "/m/draft", "spec_tokens": 4}
    assert load_config(None, **speculative_overrides('{"method": "self_int8"}')).spec_method == "self_int8"
    for text, extra, says in (
            ('{"method": "draft"}', {}, "needs draft_model_path"),
            ('{"method": "ngram", "draft_model_path": "/m"}', {}, "only method draft reads it"),
            ('{"method": "self_int8"}', {"model_dtype": "int8"}, "the draft would be the target itself"),
            ('{"method": "self_int8"}', {"agent_ports": [1, 2], "tensor_parallel_size": 2}, "single-rank agents")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(None, **speculative_overrides(text), **extra)


def test_lora_modules_from_yaml_and_the_command_line_and_their_refusals(tmp_path):
    from common.config import ConfigError, load_config
    from common.config_values import as_adapters

    path = tmp_path / "lora.yaml"
    path.write_text("serving_config:\n  lora_modules: {ft1: /a, ft2: /b}\n  max_loras: 2\n  max_lora_rank: 8\n")
    cfg = load_config(path)
    assert (cfg.lora_modules, cfg.max_loras, cfg.max_lora_rank) == ({"ft1": "/a", "ft2": "/b"}, 2, 8)
    assert as_adapters(["ft1=/a", "ft2=/b=c"]) == {"ft1": "/a", "ft2": "/b=c"}  # vLLM's --lora-modules
    for bad in (["ft1"], ["=/a"], {"ft1": 3}):
        with pytest.raises(ValueError):
            as_adapters(bad)
    assert load_config(path, max_loras=1).max_loras == 1  # more adapters than slots: swapped in as requests want them
    for overrides, says in (({"lora_modules": {"smollm2": "/a"}}, "['smollm2'] also name the base model"),
                            ({"max_lora_rank": 0}, "max_lora_rank"),
                            ({"lora_modules": {"../../etc/passwd": "/a"}}, "'../../etc/passwd': a LoRA adapter's name"),
                            ({"lora_modules": {"c1,c2": "/a"}}, "'c1,c2'"), ({"lora_modules": {"x" * 5000: "/a"}}, "1-128 letters")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(path, **overrides)
    for served in ({"model_dtype": "int8"}, {"tensor_parallel_size": 2, "agent_ports": [61166, 61167]}):
        assert load_config(path, **served).lora_enabled  # float adapters on int8; split as their projections


def test_agent_roles_from_yaml_and_the_command_line_and_their_refusals(tmp_path):
    from common.config import ConfigError, load_config
    from common.config_values import as_roles
    from llm_serving.serve import parser

    path = tmp_path / "pd.yaml"
    path.write_text("serving_config:\n  agent_ports: [7001, 7002, 7003]\n  agent_roles: [prefill, decode, both]\n")
    cfg = load_config(path)
    assert cfg.disaggregated and [cfg.role(i) for i in range(3)] == ["prefill", "decode", "both"]
    assert not load_config(None).disaggregated and load_config(None).role(0) == "both"
    assert as_roles(parser().parse_args(["--agent-roles", "prefill, Decode"]).agent_roles) == ["prefill", "decode"]
    two = {"agent_ports": [7001, 7002]}
    for overrides, says in (({"agent_roles": ["prefill", "decode"]}, "one role per agent_ports entry (3)"),
                            ({**two, "agent_roles": ["prefill", "prefill"]}, "no agent decodes"),
                            ({**two, "agent_roles": ["decode", "decode"]}, "no agent takes prompts"),
                            ({**two, "agent_roles": ["prefill", "fast"]}, "each one of both, prefill, decode"),
                            ({**two, "agent_roles": ["prefill", "decode"], "tensor_parallel_size": 2}, "single ranks")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(path, **overrides)
    remote = load_config(path, **two, agent_roles=["prefill", "decode"], agent_ip="10.0.0.2")  # hand-over over tcp
    assert remote.disaggregated
    path.write_text("serving_config:\n  agent_ports: [7001, 7002]\n  agent_roles: [1, 2]\n")
    with pytest.raises(ConfigError, match=re.escape("agent_roles = [1, 2]: must be a list of roles (both, prefill, decode)")):
        load_config(path)


def test_deterministic_from_yaml_and_the_command_line_and_off_the_cpu_refused(tmp_path):
    from common.config import ConfigError, load_config
    from llm_serving.serve import parser

    path = tmp_path / "c.yaml"
    path.write_text("serving_config:\n  deterministic: true\n")
    assert load_config(path).deterministic and not load_config(None).deterministic
    assert parser().parse_args(["--deterministic"]).deterministic is True
    with pytest.raises(ConfigError, match="deterministic on Ascend: the batch-invariant kernels are the native CPU"):
        load_config(path, device="Ascend")


def test_model_dtype_gguf_is_read_and_what_it_cannot_run_with_is_refused(tmp_path):
    """`gguf` keeps a GGUF file's blocks; tensor parallelism and LoRA do not run on them yet (refused
    by name, not served on another dtype)."""
    from common.config import ConfigError, load_config

    path = tmp_path / "gguf.yaml"
    path.write_text("model_config:\n  model_dtype: GGUF\n")
    cfg = load_config(path)
    assert cfg.model_dtype == "gguf" and not cfg.notices
    with pytest.raises(ConfigError, match="tensor_parallel_size = 2 with model_dtype gguf"):
        load_config(None, model_dtype="gguf", agent_ports=[61166, 61167], tensor_parallel_size=2)
    path = tmp_path / "lora.yaml"
    path.write_text("serving_config:\n  lora_modules: {ft1: /a}\n")
    with pytest.raises(ConfigError, match="lora_config with model_dtype gguf"):
        load_config(path, model_dtype="gguf")
