"""Mirrors `vllm.lora.request`."""

from paged_llm.inputs import LoRARequest

__all__ = ["LoRARequest"]
