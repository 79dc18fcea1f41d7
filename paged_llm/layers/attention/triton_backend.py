"""The Triton attention backend: the kernels of ``csrc_triton``, the GPU default."""

from __future__ import annotations

import torch

from paged_llm.layers.attention.base import AttentionBackend, AttentionMetadata
from paged_llm.layers.kernels import triton_kernels


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels of ``csrc_triton``: the GPU default. Every step shape goes through
    one varlen kernel reading device tensors only, so decode steps can be CUDA-graphed.

    On CPU it runs only under the Triton interpreter (``TRITON_INTERPRET=1``), for tests.
    """

    name = "triton"
    supports_decode_graphs = True

    def __init__(self) -> None:
        self._kernels = triton_kernels()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        self._kernels.store_kv(
            key, value, key_cache, value_cache, metadata.slot_mapping, k_scale, v_scale
        )
        out: torch.Tensor = self._kernels.paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            metadata.max_seq_len,
            scale,
            sliding_window,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return out
