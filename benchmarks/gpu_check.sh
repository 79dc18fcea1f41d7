#!/usr/bin/env bash
# The GPU session's one prepared run: GPU tests, kernel tests compiled for the GPU, then
# the GPU benchmarks (random-weight models from published configs; no download needed).
# Usage, from the repository root: OUT=results_dir bash benchmarks/gpu_check.sh
set -uo pipefail
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"

python -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.log"
python -m pytest -q -x tests/csrc_triton 2>&1 | tee "$out/kernel_tests.log"

python -m benchmarks.decode_step --device cuda --random-weights-config llama-3.2-1b \
    --batch-sizes 1,16,64 --context-len 512 --out "$out/decode_llama-3.2-1b.json" 2>&1 | tee "$out/decode.log"
python -m benchmarks.decode_step --device cuda --random-weights-config llama-3.2-1b \
    --batch-sizes 1,16,64 --context-len 512 --enforce-eager --out "$out/decode_llama-3.2-1b_eager.json" 2>&1 | tee -a "$out/decode.log"
python -m benchmarks.throughput --device cuda --workload a --num-requests 256 \
    --input-len 128 1024 --output-len 128 512 --random-weights-config qwen3-0.6b \
    --engines paged_llm,hf_static64,hf_cb --out "$out/throughput_a_qwen3-0.6b.json" 2>&1 | tee "$out/throughput.log"
