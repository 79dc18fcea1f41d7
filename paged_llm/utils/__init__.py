"""Mirrors `vllm.utils`."""

from paged_llm.distributed import get_open_port
from paged_llm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser", "get_open_port"]
