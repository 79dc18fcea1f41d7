"""Attention over the paged KV cache: per-step metadata, interchangeable backends (torch
operators everywhere, torch plus a C++ decode kernel on CPU, Triton for GPU), and the layer
models use."""

from paged_llm.layers.attention.base import (
    KV_CACHE_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    KVCacheLayout,
)
from paged_llm.layers.attention.cpu_backend import CpuAttentionBackend
from paged_llm.layers.attention.layer import ATTENTION_BACKENDS, Attention, get_attention_backend
from paged_llm.layers.attention.torch_backend import TorchAttentionBackend
from paged_llm.layers.attention.triton_backend import TritonAttentionBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "KV_CACHE_DTYPES",
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuAttentionBackend",
    "KVCacheLayout",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "get_attention_backend",
]
