"""LLM_SERVING_MAX_ISA: one cap read in one place (common.cpu) by the kernels' build, oneDNN, the
int8 recipe and the tests' gates; the kinds seen, each reached from an AMX Xeon's flags."""
from __future__ import annotations

import pytest

from common.config import CHANNEL_GROUP, QUANT_GROUP_SIZE, ConfigError, int8_group, load_config
from common.cpu import ISA_ENV, ISA_LEVELS, apply_isa_cap, capped, compiler_isa_flags, cpu_flags, describe, native_flags

# An AMX Xeon's flags (Sapphire Rapids), the vector and matrix ones that decide a path
SPR = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
       "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize("cap, kept, group", [
    ("avx2", {"sse4_2", "avx", "avx2", "fma", "f16c"}, QUANT_GROUP_SIZE),  # AMD Zen 3
    ("avx512", {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}, QUANT_GROUP_SIZE),
    ("avx512_vnni", SPR - {"avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}, CHANNEL_GROUP),  # Zen 4
    ("amx", SPR, CHANNEL_GROUP), (None, SPR, CHANNEL_GROUP)])
def test_each_level_keeps_the_flags_of_its_kind_and_the_int8_recipe_follows(cap, kept, group):
    assert capped(SPR, cap) == kept
    assert int8_group("auto", capped(SPR, cap)) == group


@pytest.fixture
def no_cap_left():
    """Torn down after the test's monkeypatch (requested before it): oneDNN's cap is what it was. One
    left set would cap the oneDNN of every agent a later test in this worker starts, under uncapped flags."""
    import os

    before = os.environ.get("ONEDNN_MAX_CPU_ISA")
    yield
    assert os.environ.get("ONEDNN_MAX_CPU_ISA") == before


def test_the_cap_reaches_every_reader(no_cap_left, monkeypatch):
    # set, then deleted: monkeypatch records the value it had (none) and restores it after the test.
    # A bare delenv of an unset variable records nothing, and apply_isa_cap's "AVX2" then outlived
    # the test: agents a later test in this worker started ran oneDNN capped under uncapped flags.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv(ISA_ENV, "AVX2")  # any case
    assert not {f for f in cpu_flags() if f.startswith(("avx512", "amx"))} and "avx_vnni" not in cpu_flags()
    assert "-mno-avx512f" in compiler_isa_flags()
    below = capped(native_flags(), "avx2") != native_flags()  # false on an AVX2-only CPU (Zen 3)
    assert describe().endswith(f"; capped at avx2 by {ISA_ENV})" if below else "caps nothing here: this CPU has no more than that)")
    assert apply_isa_cap() == "avx2"
    import os

    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")  # one the user set is kept
    apply_isa_cap()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"


def test_amx_is_no_cap_at_all(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "amx")
    assert ISA_LEVELS["amx"] == ((), [], None) and compiler_isa_flags() == []
    assert describe().endswith(f"; {ISA_ENV}=amx caps nothing here: this CPU has no more than that)")  # not "AMX ran"


def test_an_unknown_level_stops_the_start_with_one_line_naming_the_variable(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("model_config:\n  model_dtype: int8\n")
    monkeypatch.setenv(ISA_ENV, "avx1024")
    with pytest.raises(ConfigError, match=f"{ISA_ENV}='avx1024': expected one of avx2, avx512, avx512_vnni, amx"):
        load_config(path)


def test_the_test_script_runs_the_kinds_below_this_cpu():
    """tools/test.sh's second passes: an AMX Xeon runs Zen 4's and Zen 3's paths, a Zen 4 Zen 3's,
    a Zen 3 none."""
    from common.cpu import kinds_below

    zen4 = capped(SPR, "avx512_vnni")
    assert kinds_below(SPR) == ["avx2", "avx512_vnni"]
    assert kinds_below(zen4) == ["avx2"]
    assert kinds_below(capped(SPR, "avx2")) == []
