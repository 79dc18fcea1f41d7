#!/usr/bin/env bash
# Creates a separate virtual environment with llama.cpp's Python bindings
# (llama-cpp-python, built from its source distribution for this processor: PyPI has no
# CPU wheel), for `python -m benchmarks.llama_cpp`. llama.cpp is never a
# dependency of paged_llm: it lives only in this venv.
#
# Usage: bash benchmarks/peers/setup_llama_cpp.sh [VENV_DIR]
#   VENV_DIR defaults to ~/.cache/paged_llm/llama-cpp-venv (where
#   benchmarks.llama_cpp looks).
# Idempotent. The build takes 10-20 minutes on 2 cores. The last line printed is the
# venv's python.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
VENV_DIR=${1:-$HOME/.cache/paged_llm/llama-cpp-venv}
BASE_PYTHON=${PYTHON:-python3}

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    "$BASE_PYTHON" -m venv "$VENV_DIR"
fi
VENV_PYTHON="$VENV_DIR/bin/python"
if ! "$VENV_PYTHON" -c "import llama_cpp" 2>/dev/null; then
    # GGML_NATIVE: compiled for this processor (AVX-512 / VNNI where it has them), as
    # paged_llm's own kernels are; OpenMP threads, as llama.cpp's default build.
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF" \
        "$VENV_PYTHON" -m pip install --quiet "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
echo "$VENV_PYTHON"
