"""Mirrors `vllm.engine.arg_utils`."""

from paged_llm.engine_args import EngineArgs

__all__ = ["EngineArgs"]
