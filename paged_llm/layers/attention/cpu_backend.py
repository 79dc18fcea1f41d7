"""The CPU default: the torch backend's cache layout and prefill path, with every decode
attended by a C++ kernel (``csrc_cpu``) that reads the paged cache in place.

The torch backend's decodes gather each sequence's keys and values into a workspace and
multiply them in two batched matmuls; the kernel reads each cached row once, where it
lies, with one task per (token, KV head) for the query heads of that KV head. Where the
kernel has no vector passes for the heads and cache (`csrc_cpu.vectorized_decode_attention`:
neither AVX-512 nor AVX2, other head sizes, fp8 caches), decodes that share a long prefix
(a system prompt, served by the prefix cache) take the torch backend's cascade instead,
which reads the prefix once for all of them: one layer of 64 decodes over a shared 448 of
600 tokens takes 7.7 ms there against 8.4 ms through the kernel's generic loops on a Zen 3
(docs/benchmarks.md, "Decode attention and the CPU kernels"). Where the kernel cannot be built (no compiler), this backend warns
once and runs as the torch one.

Batch-invariant mode sends every query token through the kernel, whose per-token result
depends only on that token's query and context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import csrc_cpu
from paged_llm.layers.attention.base import AttentionMetadata, KVCacheLayout
from paged_llm.layers.attention.torch_backend import (
    DecodeTokens,
    TorchAttentionBackend,
    decode_tables,
)


@dataclass(slots=True)
class _PagedDecodes:
    """The kernel's view of some decodes: rows of the batch, of the block tables, and
    context lengths, ``[N]`` int64 each."""

    token_idx: torch.Tensor
    seq_idx: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, as the step holds them


@dataclass(slots=True)
class _CpuDecodes:
    paged: _PagedDecodes | None
    # Decodes sharing a long prefix, attended by the torch backend's cascade path (the
    # prefix read once for all of them).
    cascade: Any


class CpuAttentionBackend(TorchAttentionBackend):
    """`TorchAttentionBackend` with decodes through ``csrc_cpu.decode_attention``."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.has_kernel = False

    def setup(self, layout: KVCacheLayout, batch_invariant: bool = False) -> None:
        super().setup(layout, batch_invariant)
        self.has_kernel = csrc_cpu.load()
        # NOTE: the cascade reads a shared prefix once, but through a gather and torch's
        # matmuls; the kernel's vector passes, reading the prefix per decode from the
        # processor's cache, beat it: 64 decodes of 600 tokens sharing 448, one layer, 2
        # threads, 1.69 ms against the cascade's 3.52 on a Zen 5 with AVX-512 (float32;
        # bfloat16 1.41 / 3.73), 4.2 against 6.9 ms on a Zen 3 with AVX2 (bfloat16 3.6 /
        # 6.7). Its generic loops do not (13.9 / 9.1 ms CPU on an AVX2 EPYC).
        if self.has_kernel and csrc_cpu.vectorized_decode_attention(
            layout.head_dim, layout.cache_dtype
        ):
            self.cascade = False

    def _plan_decodes(self, metadata: AttentionMetadata, decodes: DecodeTokens) -> Any:
        if not self.has_kernel:
            return super()._plan_decodes(metadata, decodes)
        tables = decode_tables(metadata, decodes)
        members, num_shared = self._cascade(tables, decodes.context_lens, metadata.block_size)
        member_set = set(members)
        rest = [i for i in range(len(decodes.tokens)) if i not in member_set]
        cascade = None
        if members:
            # The members' own plan: all of them share the prefix already found.
            cascade = self._gathered(
                metadata,
                _subset(decodes, members),
                tables[members],
                (list(range(len(members))), num_shared),
            )
        return _CpuDecodes(
            paged=self._paged(metadata, _subset(decodes, rest)) if rest else None,
            cascade=cascade,
        )

    @staticmethod
    def _paged(metadata: AttentionMetadata, decodes: DecodeTokens) -> _PagedDecodes:
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
        plan: _CpuDecodes = decodes
        if plan.cascade is not None:
            super()._attend_decodes(
                query, key_cache, value_cache, plan.cascade, scale, sliding_window, out
            )
        if plan.paged is not None:
            csrc_cpu.decode_attention(
                query,
                key_cache,
                value_cache,
                plan.paged.block_tables,
                plan.paged.token_idx,
                plan.paged.seq_idx,
                plan.paged.context_lens,
                scale,
                sliding_window,
                out,
            )


def _subset(decodes: DecodeTokens, rows: list[int]) -> DecodeTokens:
    return DecodeTokens(
        [decodes.seqs[i] for i in rows],
        [decodes.tokens[i] for i in rows],
        [decodes.context_lens[i] for i in rows],
    )
