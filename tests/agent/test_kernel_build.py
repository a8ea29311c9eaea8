"""The native kernel library's build: into its cache once per source, flags and CPU; without a
compiler, or switched off, the model falls back to plain MindSpore ops and says why. Not in the
LLM_SERVING_MAX_ISA pass: a fresh build costs ~30 s and does not change with the CPU kind."""
from __future__ import annotations

from agent import kernels as native


def test_without_compiler_or_when_disabled_the_model_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached: a build would be needed
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert native.library() is None
    assert "no C++ compiler" in caplog.text
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("LLM_SERVING_NATIVE", "0")
    caplog.clear()
    assert native.library() is None
    assert "native kernels off (LLM_SERVING_NATIVE=0)" in caplog.text  # never silently slow
    monkeypatch.delenv("LLM_SERVING_NATIVE")
    assert native.library() is not None  # and builds into the fresh cache
    assert list((tmp_path / "llm-serving" / "kernels").glob("kernels-*.so"))
