"""What every attention backend shares: the per-step metadata and the backend interface.

Every layer writes this step's keys and values into the cache at ``slot_mapping``, then
each query token attends to all cached tokens of its own sequence at positions up to its
own. That one rule serves prefill, chunked prefill, prefix-cache hits and decode.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# kv_cache_dtype's names (vLLM's) -> the cache's dtype; None: the model's.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(slots=True)
class AttentionMetadata:
    """Where one step's tokens sit, shared by every layer of the forward pass.

    ``query_start_loc[b]:query_start_loc[b+1]`` are sequence b's query tokens; ``seq_lens[b]``
    is its context length after this step; query token i of sequence b has position
    ``seq_lens[b] - query_len_b + i``. ``backend_data`` is what the backend precomputed
    from these once per step.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    backend_data: Any = None


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """What a backend learns of the cache once the model is built (one layer, this rank)."""

    num_kv_heads: int
    head_dim: int
    # The keys' and values' dtype as attention reads them (the model's), and as stored
    # (that, or fp8).
    compute_dtype: torch.dtype
    cache_dtype: torch.dtype
    has_sliding_window: bool

    @property
    def read_bytes_per_token(self) -> int:
        """Key and value bytes of one token in one layer, as attention reads them."""
        return self._bytes_per_token(self.compute_dtype)

    @property
    def stored_bytes_per_token(self) -> int:
        """Key and value bytes of one token in one layer, as the cache stores them."""
        return self._bytes_per_token(self.cache_dtype)

    def _bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize


class AttentionBackend(abc.ABC):
    """A way to store keys/values in the paged cache and attend over it."""

    name: ClassVar[str]
    # Whether a step can run from static device buffers alone, as a CUDA graph replays it
    # (a backend that reads host-side metadata, such as per-sequence lengths, cannot).
    supports_decode_graphs: ClassVar[bool] = False
    # Whether `setup(batch_invariant=True)` makes a query's output independent of the rest
    # of the step: of the other sequences, of how its own context was chunked or cached.
    supports_batch_invariance: ClassVar[bool] = False

    # The axis of `kv_cache_shape` that indexes blocks.
    kv_cache_block_axis: ClassVar[int] = 0

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's key (or value) cache."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def setup(self, layout: KVCacheLayout, batch_invariant: bool = False) -> None:
        """Learn the cache's layout once the model is built, and whether results must be
        batch-invariant (only where `supports_batch_invariance`)."""
        return None

    def prepare(self, metadata: AttentionMetadata) -> Any:
        """Per-step precomputation shared by all layers; stored in ``metadata.backend_data``."""
        return None

    @abc.abstractmethod
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
        """query ``[T, H, D]``, key/value ``[T, Hkv, D]``; returns ``[T, H, D]``.

        The caches hold ``key / k_scale`` and ``value / v_scale`` in their own dtype (the
        model's, or fp8); every query attends to the keys and values as stored, this
        step's own included, so a token's result does not depend on whether its context
        was computed in this step or read from the cache."""
