"""Mirrors `vllm.v1.sample.logits_processor.builtin` (where vLLM's examples import
`process_dict_updates` from)."""

from paged_llm.logits_processors import process_dict_updates

__all__ = ["process_dict_updates"]
