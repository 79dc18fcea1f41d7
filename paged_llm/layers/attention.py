"""Attention over the paged KV cache, with interchangeable backends.

Every layer writes this step's keys and values into the cache at ``slot_mapping``, then
each query token attends to all cached tokens of its own sequence at positions up to its
own. That one rule serves prefill, chunked prefill, prefix-cache hits and decode.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn


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


class AttentionBackend(abc.ABC):
    """A way to store keys/values in the paged cache and attend over it."""

    name: ClassVar[str]

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's key (or value) cache."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

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
    ) -> torch.Tensor:
        """query ``[T, H, D]``, key/value ``[T, Hkv, D]``; returns ``[T, H, D]``."""


@dataclass(slots=True)
class _PrefillSeq:
    query_slice: slice
    seq_len: int
    # Physical blocks of the context; None when the sequence has no cached context, so
    # this step's own keys and values are all there is.
    block_ids: torch.Tensor | None


@dataclass(slots=True)
class _TorchStepData:
    decode_token_idx: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    # [num_decodes, max_context] True where a cached position exists.
    decode_valid: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    prefills: list[_PrefillSeq]


class TorchAttentionBackend(AttentionBackend):
    """Pure torch attention: runs everywhere, and is the CPU default.

    Decodes (one query token each) are batched into one gather over the block tables
    and one batched matmul; prefill chunks run per sequence through SDPA.
    """

    name = "torch"

    def prepare(self, metadata: AttentionMetadata) -> _TorchStepData:
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        block_size = metadata.block_size
        decode_idx: list[int] = []
        decode_rows: list[int] = []
        prefills: list[_PrefillSeq] = []
        for b, seq_len in enumerate(seq_lens):
            start, end = qsl[b], qsl[b + 1]
            if end - start == 1:
                decode_idx.append(start)
                decode_rows.append(b)
                continue
            has_context = seq_len > end - start
            block_ids = (
                metadata.block_tables[b, : -(-seq_len // block_size)].long()
                if has_context
                else None
            )
            prefills.append(_PrefillSeq(slice(start, end), seq_len, block_ids))
        if not decode_idx:
            return _TorchStepData(None, None, None, None, prefills)
        device = metadata.block_tables.device
        rows = torch.tensor(decode_rows, device=device)
        decode_seq_lens = metadata.seq_lens[rows].long()
        max_len = max(seq_lens[b] for b in decode_rows)
        num_blocks = -(-max_len // block_size)
        block_tables = metadata.block_tables[rows, :num_blocks].long()
        positions = torch.arange(num_blocks * block_size, device=device)
        valid = positions[None, :] < decode_seq_lens[:, None]
        return _TorchStepData(
            torch.tensor(decode_idx, device=device), block_tables, valid, decode_seq_lens, prefills
        )

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
    ) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        slots = metadata.slot_mapping
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)
        data: _TorchStepData = metadata.backend_data
        out = torch.empty_like(query)
        for seq in data.prefills:
            out[seq.query_slice] = _prefill_attention(
                query[seq.query_slice],
                key[seq.query_slice],
                value[seq.query_slice],
                key_cache,
                value_cache,
                seq,
                scale,
                sliding_window,
            )
        if data.decode_token_idx is not None:
            out[data.decode_token_idx] = _decode_attention(
                query[data.decode_token_idx], key_cache, value_cache, data, scale, sliding_window
            )
        return out


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[..., num_blocks * block_size, Hkv, D]`` tokens of the given blocks, in order."""
    gathered = cache[block_ids]
    return gathered.reshape(*block_ids.shape[:-1], -1, *cache.shape[2:])


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq: _PrefillSeq,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    query_len = query.shape[0]
    if seq.block_ids is not None:
        key = _gather_context(key_cache, seq.block_ids)[: seq.seq_len]
        value = _gather_context(value_cache, seq.block_ids)[: seq.seq_len]
    mask = None
    if seq.block_ids is not None or sliding_window is not None:
        q_pos = torch.arange(seq.seq_len - query_len, seq.seq_len, device=query.device)
        k_pos = torch.arange(seq.seq_len, device=query.device)
        distance = q_pos[:, None] - k_pos[None, :]
        mask = distance >= 0
        if sliding_window is not None:
            mask &= distance < sliding_window
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        key.transpose(0, 1),
        value.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    data: _TorchStepData,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = _gather_context(key_cache, data.decode_block_tables)  # [B, L, Hkv, D]
    values = _gather_context(value_cache, data.decode_block_tables)
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", q, keys) * scale
    valid = data.decode_valid
    if sliding_window is not None:
        positions = torch.arange(valid.shape[1], device=valid.device)
        valid = valid & (positions[None, :] > data.decode_seq_lens[:, None] - 1 - sliding_window)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    out = torch.einsum("bhgl,blhd->bhgd", probs, values)
    return out.reshape(num_seqs, num_heads, head_dim)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def get_attention_backend(name: str) -> AttentionBackend:
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"Unknown attention backend {name!r}; choose one of {sorted(ATTENTION_BACKENDS)}."
        ) from None


class Attention(nn.Module):
    """The attention operation of one layer; the model runner binds its cache tensors."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend: AttentionBackend = TorchAttentionBackend()
        self.key_cache = torch.empty(0)
        self.value_cache = torch.empty(0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.backend.forward(
            query,
            key,
            value,
            self.key_cache,
            self.value_cache,
            metadata,
            self.scale,
            self.sliding_window,
        )
