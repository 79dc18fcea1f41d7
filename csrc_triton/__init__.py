"""Triton kernels for paged_llm: plain functions over tensors, with torch references.

This is the bottom layer; it must never import ``paged_llm``.
"""

from csrc_triton import reference
from csrc_triton.activation import silu_and_mul
from csrc_triton.group_quantized_matmul import group_quantized_matmul
from csrc_triton.kv_store import store_kv
from csrc_triton.lora import lora_expand, lora_shrink
from csrc_triton.paged_attention import paged_attention
from csrc_triton.rms_norm import fused_add_rms_norm, rms_norm
from csrc_triton.rotary import apply_rotary
from csrc_triton.weight_only_matmul import weight_only_matmul

__all__ = [
    "apply_rotary",
    "fused_add_rms_norm",
    "group_quantized_matmul",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "reference",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
    "weight_only_matmul",
]
