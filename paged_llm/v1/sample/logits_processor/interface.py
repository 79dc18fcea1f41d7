"""Mirrors `vllm.v1.sample.logits_processor.interface`."""

from paged_llm.logits_processors import BatchUpdate, LogitsProcessor, MoveDirectionality

__all__ = ["BatchUpdate", "LogitsProcessor", "MoveDirectionality"]
