"""Mirrors `vllm.utils.argparse_utils`."""

from paged_llm.settings import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
