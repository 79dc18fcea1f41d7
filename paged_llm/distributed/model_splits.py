"""The tensor-parallel sizes a model splits into, from its attention heads and MLP width."""

from __future__ import annotations

import math
from typing import Any


def _splits(tp: int, num_heads: int, num_kv_heads: int, intermediate: int) -> bool:
    """Whether ``tp`` ranks can each take an equal share of the query heads and the MLP,
    and of the KV heads or a replica of one."""
    kv_ok = num_kv_heads % tp == 0 or tp % num_kv_heads == 0
    return num_heads % tp == 0 and intermediate % tp == 0 and kv_ok


def _counts(hf_config: Any) -> tuple[int, int, int]:
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    return num_heads, num_kv_heads, hf_config.intermediate_size


def tensor_parallel_sizes(hf_config: Any) -> list[int]:
    """Every ``tensor_parallel_size`` the model splits into, ascending."""
    num_heads, num_kv_heads, intermediate = _counts(hf_config)
    return [n for n in range(1, num_heads + 1) if _splits(n, num_heads, num_kv_heads, intermediate)]


def finest_split(hf_config: Any) -> int:
    """The least common multiple of `tensor_parallel_sizes`: at any of them, a row-parallel
    layer's input of F features (the attention output's heads, the MLP's width) is split
    at multiples of F / this, which both divide exactly."""
    return math.lcm(*tensor_parallel_sizes(hf_config))
