"""Mirrors `vllm.v1.sample.logits_processor`."""

from paged_llm.logits_processors import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
    process_dict_updates,
)

__all__ = [
    "AdapterLogitsProcessor",
    "BatchUpdate",
    "LogitsProcessor",
    "MoveDirectionality",
    "RequestLogitsProcessor",
    "process_dict_updates",
]
