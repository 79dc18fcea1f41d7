"""Mirrors `vllm.lora`."""
