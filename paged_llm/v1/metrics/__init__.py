"""Mirrors `vllm.v1.metrics`."""
