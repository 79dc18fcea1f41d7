#!/usr/bin/env bash
# Builds llama.cpp's server (llama-server) for `python -m benchmarks.llama_cpp`, from the
# llama.cpp source that PyPI's llama-cpp-python source distribution vendors (PyPI has no
# CPU build of the server, and this machine reaches no other source). llama.cpp is never a
# dependency of paged_llm: the binary lives only in BUILD_DIR.
#
# Usage: bash benchmarks/peers/setup_llama_cpp.sh [BUILD_DIR]
#   BUILD_DIR defaults to ~/.cache/paged_llm/llama-cpp (where benchmarks.llama_cpp looks).
# Idempotent. The build takes 10-20 minutes on 2 cores. The last line printed is the
# server's path.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
BUILD_DIR=${1:-$HOME/.cache/paged_llm/llama-cpp}
BASE_PYTHON=${PYTHON:-python3}
SERVER="$BUILD_DIR/build/bin/llama-server"

if [[ ! -x "$SERVER" ]]; then
    mkdir -p "$BUILD_DIR"
    SDIST="$BUILD_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    if [[ ! -f "$SDIST" ]]; then
        "$BASE_PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$BUILD_DIR"
    fi
    tar xzf "$SDIST" -C "$BUILD_DIR"
    # GGML_NATIVE: compiled for this processor (AVX-512 / VNNI where it has them), as
    # paged_llm's own kernels are; OpenMP threads, as llama.cpp's default build. Less AMX:
    # this version's AMX matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat) on the first
    # batch of SmolLM2's Q4_1 file, on a Xeon whose kernel grants AMX; an explicit -mno-*
    # wins over -march=native in either order. No web UI (it would be downloaded) and no
    # network code: the benchmark talks to it on loopback.
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$BUILD_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" \
        -B "$BUILD_DIR/build" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        >"$BUILD_DIR/build.log" 2>&1 || { tail -20 "$BUILD_DIR/build.log"; exit 1; }
    cmake --build "$BUILD_DIR/build" --target llama-server -j "$(nproc)" \
        >>"$BUILD_DIR/build.log" 2>&1 || { tail -40 "$BUILD_DIR/build.log"; exit 1; }
fi
echo "$SERVER"
