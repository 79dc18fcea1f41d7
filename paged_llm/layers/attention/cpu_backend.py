"""The CPU default: the torch backend's cache layout and prefill path, with every decode
attended by a C++ kernel (``csrc_cpu``) that reads the paged cache in place.

The torch backend's decodes gather each sequence's keys and values into a workspace and
multiply them in two batched matmuls; the kernel reads each cached row once, where it
lies, with one task per (token, KV head) for the query heads of that KV head. Where the
kernel cannot be built (no compiler), this backend warns once and runs as the torch one.

Batch-invariant mode sends every query token through the kernel, whose per-token result
depends only on that token's query and context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import csrc_cpu
from paged_llm.layers.attention.base import AttentionMetadata
from paged_llm.layers.attention.torch_backend import DecodeTokens, TorchAttentionBackend


@dataclass(slots=True)
class _PagedDecodes:
    """The kernel's view of a step's decodes: rows of the batch, of the block tables, and
    context lengths, ``[N]`` int64 each."""

    token_idx: torch.Tensor
    seq_idx: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, as the step holds them


class CpuAttentionBackend(TorchAttentionBackend):
    """`TorchAttentionBackend` with decodes through ``csrc_cpu.decode_attention``."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.has_kernel = False

    def setup(
        self, kv_bytes_per_token: int, has_sliding_window: bool, batch_invariant: bool = False
    ) -> None:
        super().setup(kv_bytes_per_token, has_sliding_window, batch_invariant)
        self.has_kernel = csrc_cpu.load()

    def _plan_decodes(self, metadata: AttentionMetadata, decodes: DecodeTokens) -> Any:
        if not self.has_kernel:
            return super()._plan_decodes(metadata, decodes)
        return _PagedDecodes(
            token_idx=torch.tensor(decodes.tokens),
            seq_idx=torch.tensor(decodes.seqs),
            context_lens=torch.tensor(decodes.context_lens),
            block_tables=metadata.block_tables,
        )

    def _attend_decodes(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        decodes: Any,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        if not self.has_kernel:
            super()._attend_decodes(
                query, key_cache, value_cache, decodes, scale, sliding_window, out
            )
            return
        plan: _PagedDecodes = decodes
        csrc_cpu.decode_attention(
            query,
            key_cache,
            value_cache,
            plan.block_tables,
            plan.token_idx,
            plan.seq_idx,
            plan.context_lens,
            scale,
            sliding_window,
            out,
        )
