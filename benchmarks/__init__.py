"""Benchmarks of paged_llm against transformers: ``throughput`` (offline batch) and
``latency`` (TTFT and inter-token latency against concurrency). Run them as modules from the
repository root, e.g. ``python -m benchmarks.throughput``; see docs/benchmarks.md."""
