"""Mirrors `vllm.v1.sample`."""
