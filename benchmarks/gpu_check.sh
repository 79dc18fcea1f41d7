#!/usr/bin/env bash
# The GPU session's one prepared run (under 8 minutes on one H200): the GPU tests, the
# kernel tests compiled for the GPU, then the decode-step roofline and throughput
# (paged_llm vs transformers) on random-weight Qwen3-0.6B and Llama-3.2-1B (published
# configs; no download), and the first model's quantized weights against its bfloat16
# (docs/quantization.md). Every figure lands as JSON under $OUT.
# Usage, from the repository root: OUT=results_dir bash benchmarks/gpu_check.sh
# SMOKE_MODEL=<tiny model dir> runs the same steps on the CPU at toy sizes with that
# model's tokenizer and a tiny config, so a test keeps this script's commands valid.
set -uo pipefail
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The GPU machine's image has a python3 but may have no python.
command -v python >/dev/null || python() { python3 "$@"; }
status=0
run() {  # run a step, keep going if it fails, and remember the failure
    "$@" || { echo "FAILED: $*" | tee -a "$out/failures.txt"; status=1; }
}

if [[ -n "${SMOKE_MODEL:-}" ]]; then
    device=cpu
    configs=("$SMOKE_CONFIG")
    model_args=(--model "$SMOKE_MODEL")
    decode_args=(--batch-sizes 1,2 --context-len 32)
    modes=(eager)  # a CPU has no graphs: the graphs run would repeat the eager one
    throughput_args=(--num-requests 4 --input-len 8 32 --output-len 4 8 --engines paged_llm,hf_static4)
    quantized_args=(--num-requests 4 --input-len 8 32 --output-len 4 8 --quantization int8)
    tests=(tests/engine/test_gpu_start_up.py -k budget)
    kernel_tests=(tests/csrc_triton/test_rms_norm.py)
else
    device=cuda
    configs=(qwen3-0.6b llama-3.2-1b)
    model_args=()
    decode_args=(--batch-sizes 1,16,64 --context-len 512)
    modes=(graphs eager)
    throughput_args=(--num-requests 256 --input-len 128 1024 --output-len 128 512
        --engines paged_llm,hf_static64,hf_cb)
    # fp8 weights need compute capability 8.9 (an H100 or H200 has 9.0).
    # Last and small: the whole script must fit one 10-minute device call.
    quantized_args=(--num-requests 64 --input-len 128 1024 --output-len 128 256
        --quantization int8,fp8)
    # Only the files that hold GPU tests: the GPU machine lacks the optional extras
    # (xgrammar, ray, lm-eval, ...) that other test modules import when collected.
    mapfile -t gpu_test_files < <(grep -rl "mark.gpu" tests)
    tests=(--durations=10 -m gpu "${gpu_test_files[@]}")
    # pytest-xdist (in the GPU image): each test compiles its kernels, and 16 cores compile at once.
    kernel_tests=(-n 8 tests/csrc_triton)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
fi
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"

run python -m pytest -q "${tests[@]}" 2>&1 | tee "$out/gpu_tests.log"
run python -m pytest -q "${kernel_tests[@]}" 2>&1 | tee "$out/kernel_tests.log"

for config in "${configs[@]}"; do
    name=$(basename "$config" .json)
    for mode in "${modes[@]}"; do
        flag=()
        [[ $mode == eager ]] && flag=(--enforce-eager)
        run python -m benchmarks.decode_step --device "$device" "${model_args[@]}" \
            --random-weights-config "$config" "${decode_args[@]}" "${flag[@]}" \
            --out "$out/decode_${name}_${mode}.json" 2>&1 | tee -a "$out/decode.log"
    done
    run python -m benchmarks.throughput --device "$device" "${model_args[@]}" --workload a \
        --random-weights-config "$config" "${throughput_args[@]}" \
        --out "$out/throughput_a_${name}.json" 2>&1 | tee -a "$out/throughput.log"
done
first=$(basename "${configs[0]}" .json)
run python -m benchmarks.throughput --device "$device" "${model_args[@]}" --workload a \
    --random-weights-config "${configs[0]}" --engines paged_llm --skip-roofline \
    "${quantized_args[@]}" --out "$out/quantized_a_${first}.json" 2>&1 | tee "$out/quantized.log"
exit $status
