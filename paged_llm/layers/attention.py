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

from paged_llm.layers.kernels import triton_kernels


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
class _DecodeGroup:
    """Decodes of similar context length, attended together over a padded context."""

    token_idx: torch.Tensor  # [G] rows of the flat batch
    block_tables: torch.Tensor  # [G, num_blocks] int64
    seq_lens: torch.Tensor  # [G]
    valid: torch.Tensor  # [G, num_blocks * block_size]: position < seq_len


@dataclass(slots=True)
class _TorchStepData:
    decode_groups: list[_DecodeGroup]
    prefills: list[_PrefillSeq]


# A decode group admits sequences down to this fraction of its longest context, which
# bounds the padded (wasted) part of its gather at 1 - fraction.
_DECODE_GROUP_MIN_FILL = 2 / 3


class TorchAttentionBackend(AttentionBackend):
    """Pure torch attention: runs everywhere, and is the CPU default.

    The cache is head-major, ``[Hkv, num_blocks, block_size, D]``, so a gather over block
    tables yields ``[Hkv, seqs, context, D]``, which batched matmuls consume as is. Decodes
    (one query token each) are batched by similar context length; prefill chunks run per
    sequence through SDPA.
    """

    name = "torch"

    def __init__(self) -> None:
        # NOTE: gathers land in this reused buffer: a fresh tensor of tens of megabytes per
        # layer would be mmap'd and page-faulted in every time (4x slower, measured).
        self._workspace = torch.empty(0)

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def _gather(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given blocks, ``[Hkv, *block_ids.shape[:-1], tokens, D]``."""
        num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
        # Rows of the cache seen as [Hkv * num_blocks, block_size * D]: one row per block.
        heads = torch.arange(num_kv_heads, device=block_ids.device) * num_blocks
        rows = (heads[:, None] + block_ids.reshape(1, -1)).reshape(-1)
        row_size = block_size * head_dim
        needed = 2 * rows.numel() * row_size
        if self._workspace.numel() < needed or self._workspace.dtype != key_cache.dtype:
            self._workspace = key_cache.new_empty(needed)
        shape = (num_kv_heads, *block_ids.shape[:-1], block_ids.shape[-1] * block_size, head_dim)
        gathered = []
        for part, cache in zip(
            self._workspace[:needed].chunk(2), (key_cache, value_cache), strict=True
        ):
            out = part.view(rows.numel(), row_size)
            torch.index_select(cache.view(-1, row_size), 0, rows, out=out)
            gathered.append(out.view(shape))
        return gathered[0], gathered[1]

    def prepare(self, metadata: AttentionMetadata) -> _TorchStepData:
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        block_size = metadata.block_size
        decodes: list[int] = []
        prefills: list[_PrefillSeq] = []
        for b, seq_len in enumerate(seq_lens):
            start, end = qsl[b], qsl[b + 1]
            if end - start == 1:
                decodes.append(b)
                continue
            has_context = seq_len > end - start
            block_ids = (
                metadata.block_tables[b, : -(-seq_len // block_size)].long()
                if has_context
                else None
            )
            prefills.append(_PrefillSeq(slice(start, end), seq_len, block_ids))
        decodes.sort(key=lambda b: -seq_lens[b])
        groups: list[_DecodeGroup] = []
        device = metadata.block_tables.device
        while decodes:
            longest = seq_lens[decodes[0]]
            size = 1
            while (
                size < len(decodes) and seq_lens[decodes[size]] >= longest * _DECODE_GROUP_MIN_FILL
            ):
                size += 1
            rows, decodes = decodes[:size], decodes[size:]
            rows_tensor = torch.tensor(rows, device=device)
            group_seq_lens = metadata.seq_lens[rows_tensor].long()
            num_blocks = -(-longest // block_size)
            positions = torch.arange(num_blocks * block_size, device=device)
            groups.append(
                _DecodeGroup(
                    token_idx=torch.tensor([qsl[b] for b in rows], device=device),
                    block_tables=metadata.block_tables[rows_tensor, :num_blocks].long(),
                    seq_lens=group_seq_lens,
                    valid=positions[None, :] < group_seq_lens[:, None],
                )
            )
        return _TorchStepData(groups, prefills)

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
        key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, key.transpose(0, 1))
        value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, value.transpose(0, 1))
        data: _TorchStepData = metadata.backend_data
        out = torch.empty_like(query)
        for seq in data.prefills:
            seq_query = query[seq.query_slice]
            if seq.block_ids is None:
                context = (
                    key[seq.query_slice].transpose(0, 1),
                    value[seq.query_slice].transpose(0, 1),
                )
            else:
                keys, values = self._gather(key_cache, value_cache, seq.block_ids)
                context = keys[:, : seq.seq_len], values[:, : seq.seq_len]
            out[seq.query_slice] = _prefill_attention(
                seq_query, *context, seq, scale, sliding_window
            )
        for group in data.decode_groups:
            keys, values = self._gather(key_cache, value_cache, group.block_tables)
            out[group.token_idx] = _decode_attention(
                query[group.token_idx], keys, values, group, scale, sliding_window
            )
        return out


def _prefill_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq: _PrefillSeq,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """query ``[q, H, D]`` against the sequence's keys/values ``[Hkv, seq_len, D]``."""
    query_len = query.shape[0]
    mask = None
    if seq.block_ids is not None or sliding_window is not None:
        q_pos = torch.arange(seq.seq_len - query_len, seq.seq_len, device=query.device)
        k_pos = torch.arange(seq.seq_len, device=query.device)
        distance = q_pos[:, None] - k_pos[None, :]
        mask = distance >= 0
        if sliding_window is not None:
            mask &= distance < sliding_window
    # NOTE: 4-D inputs: with 3-D ones, torch's CPU SDPA takes its unfused math path
    # (measured 2.5-4.5x slower for 256-1024 tokens).
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query token per sequence against its padded context ``[Hkv, B, L, D]``."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[0]
    q = query.view(num_seqs, num_kv_heads, -1, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # [Hkv, B, G, L]
    valid = group.valid
    if sliding_window is not None:
        positions = torch.arange(valid.shape[1], device=valid.device)
        valid = valid & (positions[None, :] > group.seq_lens[:, None] - 1 - sliding_window)
    scores.masked_fill_(~valid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    out = torch.matmul(probs, values)  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels of ``csrc_triton``: the GPU default. Every step shape goes through
    one varlen kernel reading device tensors only, so decode steps can be CUDA-graphed.

    On CPU it runs only under the Triton interpreter (``TRITON_INTERPRET=1``), for tests.
    """

    name = "triton"

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
    ) -> torch.Tensor:
        self._kernels.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        return self._kernels.paged_attention(
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
        )


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,
}


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
