"""The flat (varlen) batch of one step, built on the host with numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_llm.layers.attention import AttentionBackend, AttentionMetadata
from paged_llm.platforms import Platform


@dataclass(slots=True)
class HostBatch:
    """Every scheduled token of every sequence, flattened without padding."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: block * block_size + offset of each token
    query_start_loc: np.ndarray  # [B + 1] int64
    seq_lens: np.ndarray  # [B] int64: context length after this step
    block_tables: np.ndarray  # [B, max_blocks] int32, zero-padded
    # Rows whose logits are sampled: each sampling sequence's last ``1 + len(draft)``.
    logits_indices: np.ndarray
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def padded_array(rows: list[list[int]], fill: int, dtype: type[np.integer]) -> np.ndarray:
    """Rows of different lengths as one array, right-padded with ``fill`` (at least one
    column, so an empty batch of rows still has a shape to index)."""
    width = max((len(row) for row in rows), default=0)
    array = np.full((len(rows), max(width, 1)), fill, dtype=dtype)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return array


def build_host_batch(
    token_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    block_tables: list[list[int]],
    samples: list[bool],
    block_size: int,
    drafts: list[list[int]] | None = None,
) -> HostBatch:
    """Flat batch arrays for sequences with these tokens, computed counts, step sizes and
    block tables; a sequence's draft tokens (speculative decoding) follow its tokens and are
    part of its step. Per-token work is vectorized; only the gathering of each sequence's
    new tokens and block table is a Python loop."""
    num_seqs = len(token_ids)
    drafts = drafts or [[]] * num_seqs
    step_ids: list[int] = []
    for ids, draft, start, count in zip(
        token_ids, drafts, num_computed, num_scheduled, strict=True
    ):
        # A draft's step reaches past the tokens: the slice ends with them.
        step_ids.extend(ids[start : start + count])
        step_ids.extend(draft)
    computed = np.asarray(num_computed, dtype=np.int64)
    scheduled = np.asarray(num_scheduled, dtype=np.int64)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_index = np.repeat(np.arange(num_seqs), scheduled)
    positions = np.arange(num_tokens) - query_start_loc[seq_index] + computed[seq_index]
    table_array = padded_array(block_tables, 0, np.int32)
    slot_mapping = (
        table_array[seq_index, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    return HostBatch(
        input_ids=np.asarray(step_ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=computed + scheduled,
        block_tables=table_array,
        logits_indices=_logits_indices(query_start_loc, samples, drafts),
        max_query_len=int(scheduled.max()),
    )


def _logits_indices(
    query_start_loc: np.ndarray, samples: list[bool], drafts: list[list[int]]
) -> np.ndarray:
    """The last ``1 + len(draft)`` rows of each sampling sequence, in order."""
    ends = query_start_loc[1:][np.asarray(samples, dtype=bool)]
    num_rows = np.asarray(
        [1 + len(draft) for draft, sample in zip(drafts, samples, strict=True) if sample],
        dtype=np.int64,
    )
    if len(num_rows) == 0 or num_rows.max() == 1:
        last_rows: np.ndarray = ends - 1
        return last_rows
    # Row j of a sequence's group counts back from its end: end - num_rows + j.
    group_starts = np.repeat(ends - num_rows, num_rows)
    offsets = np.arange(int(num_rows.sum())) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    indices: np.ndarray = group_starts + offsets
    return indices


def to_device(
    array: np.ndarray, platform: Platform, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Host array to device tensor, as the platform copies (pinned, not blocking, on CUDA)."""
    tensor = torch.from_numpy(array)
    if dtype is not None:
        tensor = tensor.to(dtype)
    return platform.host_to_device(tensor)


def attention_metadata(
    batch: HostBatch, block_size: int, backend: AttentionBackend, platform: Platform
) -> AttentionMetadata:
    metadata = AttentionMetadata(
        slot_mapping=to_device(batch.slot_mapping, platform),
        query_start_loc=to_device(batch.query_start_loc, platform, torch.int32),
        seq_lens=to_device(batch.seq_lens, platform, torch.int32),
        block_tables=to_device(batch.block_tables, platform),
        query_start_loc_cpu=batch.query_start_loc.tolist(),
        seq_lens_cpu=batch.seq_lens.tolist(),
        max_query_len=batch.max_query_len,
        max_seq_len=int(batch.seq_lens.max()),
        block_size=block_size,
    )
    metadata.backend_data = backend.prepare(metadata)
    return metadata
