"""Pure-torch attention over the paged cache: runs everywhere, the CPU default.

Decode attention on a CPU is bound by memory traffic: every step reads every running
sequence's keys and values. So the backend plans each step once (shared by all layers) to
read as little as it can:

- Decodes are grouped by context length, so a group's padded gather wastes little, and
  groups are cut into chunks whose gathered keys and values stay in the processor's cache
  while the two batched matmuls reread them.
- Decodes whose block tables start with the same blocks (a shared system prompt, served
  by the prefix cache) attend to that shared prefix together ("cascade" attention): its
  keys and values are gathered once and multiplied with all their queries in one matmul;
  each sequence then attends to its own suffix, and the two softmax parts are merged.

Prefill chunks run per sequence through SDPA.

Batch-invariant mode gives up the shortcuts whose floating-point sums depend on the rest of
the step: every query token, prefill or decode, attends like a decode over its own
context (no SDPA, whose kernel and splits change with the chunk's shape), and no cascade
(whose split softmax depends on which sequences share the prefix). The decode matmuls'
per-row results depend neither on the batch nor on the zero-weight padding (measured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from paged_llm.layers.attention.base import AttentionBackend, AttentionMetadata, KVCacheLayout
from paged_llm.layers.linear import onednn_linear_available

# A decode group admits sequences down to this fraction of its longest context, which
# bounds the padded (wasted) part of its gather at 1 - fraction.
_DECODE_GROUP_MIN_FILL = 2 / 3
# Gathered keys + values per chunk: small enough to stay in the processor's cache between
# the gather and the two matmuls that reread them. Decode steps of SmolLM2 with 256-token
# contexts on a 2-core Zen 5 (32 MB L3): one chunk of 64 sequences 162 ms, 4 MB chunks
# 120 ms, 8 MB 122 ms, 16 MB 142 ms; at 16 sequences 8 MB beat 4 MB (40 vs 44 ms).
_CHUNK_GATHER_BYTES = 8 * 2**20
# A shared prefix is attended once only when it saves a real gather.
_CASCADE_MIN_SEQS = 4
_CASCADE_MIN_BLOCKS = 4


@dataclass(slots=True)
class _PrefillSeq:
    query_slice: slice
    seq_len: int
    # Physical blocks of the context, and the causal mask ``[query_len, seq_len]`` of the
    # queries over it; both None when the sequence has no cached context, so this step's
    # own keys and values are all there is (and SDPA's is_causal does).
    block_ids: torch.Tensor | None
    causal_mask: torch.Tensor | None


@dataclass(slots=True)
class _DecodeChunk:
    """Decodes of similar context length, attended together over a padded context that
    starts after the shared prefix for cascade members."""

    token_idx: torch.Tensor  # [B] rows of the flat batch
    block_tables: torch.Tensor  # [B, num_blocks] int64
    context_lens: torch.Tensor  # [B] tokens of context in these blocks
    valid: torch.Tensor  # [B, num_blocks * block_size]: position < context_len
    # Rows of the shared-prefix results for these decodes (cascade members only).
    shared_rows: slice | None


@dataclass(slots=True)
class _SharedPrefix:
    block_ids: torch.Tensor  # [num_blocks] int64
    token_idx: torch.Tensor  # [members] rows of the flat batch, in chunk order


@dataclass(slots=True)
class DecodeTokens:
    """The query tokens of a step attended as decodes, over their own cached context."""

    seqs: list[int]  # sequence (row of the block tables)
    tokens: list[int]  # row of the flat batch
    context_lens: list[int]  # keys it sees: its position + 1


@dataclass(slots=True)
class _GatheredDecodes:
    chunks: list[_DecodeChunk]
    shared_prefix: _SharedPrefix | None


@dataclass(slots=True)
class StepPlan:
    prefills: list[_PrefillSeq]
    # What `_plan_decodes` made of the step's decodes (None: there are none).
    decodes: Any


def decode_tables(metadata: AttentionMetadata, decodes: DecodeTokens) -> torch.Tensor:
    """The block tables of the decodes' sequences, ``[decodes, max_blocks]`` int64."""
    device = metadata.block_tables.device
    return metadata.block_tables[torch.tensor(decodes.seqs, device=device)].long()


def _shared_prefix_blocks(
    tables: torch.Tensor, context_lens: list[int], block_size: int
) -> tuple[list[int], int]:
    """The decodes (indices into ``tables``) that start with the most common first block,
    and how many leading blocks they all share (each keeps at least one own token)."""
    first = tables[:, 0]
    values, counts = first.unique(return_counts=True)
    top = values[counts.argmax()]
    members = (first == top).nonzero().flatten().tolist()
    if len(members) < _CASCADE_MIN_SEQS:
        return [], 0
    limit = min((context_lens[i] - 1) // block_size for i in members)
    member_tables = tables[members, :limit]
    same = (member_tables == member_tables[:1]).all(dim=0)
    return members, int(same.int().cumprod(dim=0).sum())


# Queries of up to this many tokens (a decode, a speculative draft after its last token, the
# short last chunk of a prompt) are attended as decodes, each token over its own context and
# all of them batched across sequences; longer ones as a prefill per sequence. A step of 16
# drafts of 2 tokens ran in 140 ms as 16 prefills (SmolLM2-135M, 2 cores), against 70 ms
# for the 16 one-token decodes before them.
DECODE_QUERY_TOKENS = 8


class TorchAttentionBackend(AttentionBackend):
    """The cache is head-major, ``[Hkv, num_blocks, block_size, D]``, so a gather over block
    tables yields ``[Hkv, seqs, context, D]``, which batched matmuls consume as is."""

    name = "torch"
    supports_batch_invariance = True
    kv_cache_block_axis = 1

    def __init__(self) -> None:
        self.cascade = True
        self.batch_invariant = False
        # Until setup() tells the real size: float32 keys and values of one 128-dim head.
        self._kv_bytes_per_token = 2 * 128 * 4
        # NOTE: gathers land in these reused buffers, one per dtype gathered into: a fresh
        # tensor of tens of megabytes per layer would be mmap'd and page-faulted in every
        # time (4x slower, measured).
        self._workspaces: dict[torch.dtype, torch.Tensor] = {}
        # An fp8 cache's blocks are gathered here first, then converted into the workspace.
        self._fp8_workspace = torch.empty(0)

    def setup(self, layout: KVCacheLayout, batch_invariant: bool = False) -> None:
        self._kv_bytes_per_token = layout.read_bytes_per_token
        self.batch_invariant = batch_invariant
        # Cascade attention splits the softmax at the shared prefix; a sliding window would
        # cut into that prefix.
        self.cascade = not layout.has_sliding_window and not batch_invariant

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks, block_size, head_dim)

    # ----- planning, once per step ------------------------------------------------------

    def prepare(self, metadata: AttentionMetadata) -> StepPlan:
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        block_size = metadata.block_size
        decodes = DecodeTokens([], [], [])
        prefills: list[_PrefillSeq] = []
        for b, seq_len in enumerate(seq_lens):
            start, end = qsl[b], qsl[b + 1]
            if end - start <= DECODE_QUERY_TOKENS or self.batch_invariant:
                decodes.seqs.extend([b] * (end - start))
                decodes.tokens.extend(range(start, end))
                decodes.context_lens.extend(range(seq_len - (end - start) + 1, seq_len + 1))
                continue
            block_ids = causal_mask = None
            if seq_len > end - start:
                block_ids = metadata.block_tables[b, : -(-seq_len // block_size)].long()
                causal_mask = _visible(end - start, seq_len, block_ids.device)
            prefills.append(_PrefillSeq(slice(start, end), seq_len, block_ids, causal_mask))
        if not decodes.tokens:
            return StepPlan(prefills, None)
        return StepPlan(prefills, self._plan_decodes(metadata, decodes))

    def _plan_decodes(self, metadata: AttentionMetadata, decodes: DecodeTokens) -> Any:
        """The per-step plan `_attend_decodes` reads: here, chunks to gather."""
        tables = decode_tables(metadata, decodes)
        cascade = self._cascade(tables, decodes.context_lens, metadata.block_size)
        return self._gathered(metadata, decodes, tables, cascade)

    def _gathered(
        self,
        metadata: AttentionMetadata,
        decodes: DecodeTokens,
        tables: torch.Tensor,
        cascade: tuple[list[int], int],
    ) -> _GatheredDecodes:
        """Gather chunks for ``decodes`` (block tables ``tables``), the members of
        ``cascade`` (rows, shared blocks) attending to their shared prefix together."""
        block_size = metadata.block_size
        decode_tokens, context_lens = decodes.tokens, decodes.context_lens
        device = tables.device
        num_decodes = len(decode_tokens)
        # Blocks each decode skips because the shared prefix covers them.
        skipped = [0] * num_decodes
        members, num_shared = cascade
        for i in members:
            skipped[i] = num_shared
        member_set = set(members)
        chunks: list[_DecodeChunk] = []
        shared_token_idx: list[int] = []
        # Members first, so that their rows of the shared-prefix results are contiguous.
        for part in (members, [i for i in range(num_decodes) if i not in member_set]):
            for rows in self._length_chunks(part, context_lens, skipped, block_size):
                token_idx = [decode_tokens[i] for i in rows]
                shared_rows = None
                if rows[0] in member_set:
                    start = len(shared_token_idx)
                    shared_token_idx.extend(token_idx)
                    shared_rows = slice(start, len(shared_token_idx))
                chunks.append(
                    self._chunk(
                        tables, rows, token_idx, context_lens, skipped, block_size, shared_rows
                    )
                )
        shared_prefix = None
        if members:
            shared_prefix = _SharedPrefix(
                block_ids=tables[members[0], :num_shared],
                token_idx=torch.tensor(shared_token_idx, device=device),
            )
        return _GatheredDecodes(chunks, shared_prefix)

    def _cascade(
        self, tables: torch.Tensor, context_lens: list[int], block_size: int
    ) -> tuple[list[int], int]:
        """The decodes (rows of ``tables``) that attend to their shared prefix together,
        and its length in blocks; ``([], 0)`` where no prefix is worth it."""
        if not self.cascade or len(context_lens) < _CASCADE_MIN_SEQS:
            return [], 0
        members, num_shared = _shared_prefix_blocks(tables, context_lens, block_size)
        if num_shared < _CASCADE_MIN_BLOCKS:
            return [], 0
        return members, num_shared

    def _length_chunks(
        self, rows: list[int], context_lens: list[int], skipped: list[int], block_size: int
    ) -> list[list[int]]:
        """Rows grouped by similar remaining context, then cut to the gather budget."""
        remaining = {i: context_lens[i] - skipped[i] * block_size for i in rows}
        ordered = sorted(rows, key=lambda i: -remaining[i])
        chunks: list[list[int]] = []
        while ordered:
            longest = remaining[ordered[0]]
            size = 1
            while (
                size < len(ordered) and remaining[ordered[size]] >= longest * _DECODE_GROUP_MIN_FILL
            ):
                size += 1
            per_seq = -(-longest // block_size) * block_size * self._kv_bytes_per_token
            step = max(1, _CHUNK_GATHER_BYTES // per_seq)
            group, ordered = ordered[:size], ordered[size:]
            chunks.extend(group[i : i + step] for i in range(0, len(group), step))
        return chunks

    @staticmethod
    def _chunk(
        tables: torch.Tensor,
        rows: list[int],
        token_idx: list[int],
        context_lens: list[int],
        skipped: list[int],
        block_size: int,
        shared_rows: slice | None,
    ) -> _DecodeChunk:
        device = tables.device
        lens = [context_lens[i] - skipped[i] * block_size for i in rows]
        num_blocks = -(-max(lens) // block_size)
        # Each row's blocks after its skipped prefix (padding columns repeat the last one).
        columns = torch.tensor([skipped[i] for i in rows], device=device)[:, None] + torch.arange(
            num_blocks, device=device
        )
        row_index = torch.tensor(rows, device=device)[:, None]
        block_tables = tables[row_index, columns.clamp_max(tables.shape[1] - 1)]
        context = torch.tensor(lens, device=device)
        positions = torch.arange(num_blocks * block_size, device=device)
        return _DecodeChunk(
            token_idx=torch.tensor(token_idx, device=device),
            block_tables=block_tables,
            context_lens=context,
            valid=positions[None, :] < context[:, None],
            shared_rows=shared_rows,
        )

    # ----- the forward pass -------------------------------------------------------------

    def _gather(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given blocks as stored, in ``dtype``,
        ``[Hkv, *block_ids.shape[:-1], tokens, D]``."""
        num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
        # Rows of the cache seen as [Hkv * num_blocks, block_size * D]: one row per block.
        heads = torch.arange(num_kv_heads, device=block_ids.device) * num_blocks
        rows = (heads[:, None] + block_ids.reshape(1, -1)).reshape(-1)
        row_size = block_size * head_dim
        needed = 2 * rows.numel() * row_size
        workspace = self._workspaces.get(dtype)
        if workspace is None or workspace.numel() < needed:
            workspace = self._workspaces[dtype] = key_cache.new_empty(needed, dtype=dtype)
        converts = key_cache.dtype != dtype
        if converts and self._fp8_workspace.numel() < needed // 2:
            self._fp8_workspace = key_cache.new_empty(needed // 2)
        shape = (num_kv_heads, *block_ids.shape[:-1], block_ids.shape[-1] * block_size, head_dim)
        gathered = []
        for part, cache in zip(workspace[:needed].chunk(2), (key_cache, value_cache), strict=True):
            out = part.view(rows.numel(), row_size)
            if converts:
                raw = self._fp8_workspace[: needed // 2].view(rows.numel(), row_size)
                torch.index_select(cache.view(-1, row_size), 0, rows, out=raw)
                out.copy_(raw)
            else:
                torch.index_select(cache.view(-1, row_size), 0, rows, out=out)
            gathered.append(out.view(shape))
        return gathered[0], gathered[1]

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
        slots = metadata.slot_mapping
        stored_key = _quantize(key, key_cache.dtype, k_scale)
        stored_value = _quantize(value, value_cache.dtype, v_scale)
        _store(key_cache, stored_key, slots)
        _store(value_cache, stored_value, slots)
        # Attention works on K and V as stored: K's scale joins the softmax scale and V's
        # multiplies the output.
        scale = scale * k_scale
        key, value = stored_key.to(query.dtype), stored_value.to(query.dtype)
        plan: StepPlan = metadata.backend_data
        out = torch.empty_like(query)
        for seq in plan.prefills:
            if seq.block_ids is None:
                keys = key[seq.query_slice].transpose(0, 1)
                values = value[seq.query_slice].transpose(0, 1)
            else:
                keys, values = self._gather(key_cache, value_cache, seq.block_ids, query.dtype)
                keys, values = keys[:, : seq.seq_len], values[:, : seq.seq_len]
            out[seq.query_slice] = _prefill_attention(
                query[seq.query_slice], keys, values, seq, scale, sliding_window
            )
        if plan.decodes is not None:
            self._attend_decodes(
                query, key_cache, value_cache, plan.decodes, scale, sliding_window, out
            )
        return out if v_scale == 1.0 else out.mul_(v_scale)

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
        """Write the decodes' attention (before V's scale) into their rows of ``out``;
        ``decodes`` is what `_plan_decodes` made."""
        plan: _GatheredDecodes = decodes
        num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
        dtype = _matmul_dtype(query)
        shared = None
        if plan.shared_prefix is not None:
            assert sliding_window is None, "cascade attention with a sliding window"
            keys, values = self._gather(key_cache, value_cache, plan.shared_prefix.block_ids, dtype)
            queries = _by_kv_head(query[plan.shared_prefix.token_idx].to(dtype), num_kv_heads)
            # One matmul for every member's queries against the one copy of the prefix.
            flat = queries.reshape(num_kv_heads, -1, head_dim)
            partial = _partial_attention(flat, keys, values, None, scale)
            shared = PartialAttention(*(t.view(*queries.shape[:3], -1) for t in partial))
        for chunk in plan.chunks:
            keys, values = self._gather(key_cache, value_cache, chunk.block_tables, dtype)
            valid = chunk.valid
            if sliding_window is not None:
                positions = torch.arange(valid.shape[1], device=valid.device)
                valid = valid & (
                    positions[None, :] > chunk.context_lens[:, None] - 1 - sliding_window
                )
            queries = _by_kv_head(query[chunk.token_idx].to(dtype), num_kv_heads)
            mask = valid[None, :, None, :]
            if chunk.shared_rows is None:
                output = _attention(queries, keys, values, mask, scale)
            else:
                assert shared is not None
                part = _partial_attention(queries, keys, values, mask, scale)
                merged = _merge(part, PartialAttention(*(t[:, chunk.shared_rows] for t in shared)))
                output = merged.output / merged.total
            # NOTE: the merge is float32, and so are the matmuls where `_matmul_dtype` says;
            # the rows of out are the query's dtype.
            out[chunk.token_idx] = (
                output.transpose(0, 1).reshape(-1, query.shape[1], head_dim).to(query.dtype)
            )


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x / scale`` as a cache of ``dtype`` stores it (``x`` itself where that is the
    same): an fp8 cache saturates at its largest finite value, since float8_e4m3fn has no
    infinity and casts a larger value to NaN."""
    if dtype == x.dtype and scale == 1.0:
        return x
    scaled = x.float() * (1.0 / scale)
    if dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        scaled.clamp_(-limit, limit)
    return scaled.to(dtype)


def _store(cache: torch.Tensor, stored: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``[T, Hkv, D]`` into the head-major cache at the flat ``slots``."""
    if cache.dtype.itemsize == 1:
        # NOTE: as bytes: index_copy_ is not implemented for float8 on CPU.
        cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
    num_kv_heads, head_dim = stored.shape[1], stored.shape[2]
    cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, stored.transpose(0, 1))


def _by_kv_head(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, H, D]`` queries as ``[Hkv, B, G, D]``: the G query heads of each KV head."""
    num_seqs, num_heads, head_dim = query.shape
    return query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)


def _matmul_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype decode attention's gathers and matmuls run in: the query's, except 16-bit
    queries on a CPU without 16-bit GEMMs (AVX2: no oneDNN bfloat16), where torch's
    matmul runs a generic loop; there float32, as the linear layers do (one layer of 64
    bfloat16 decodes over a shared 448-token prefix: 39.5 ms on a 2-core AVX2 EPYC)."""
    if query.device.type != "cpu" or query.dtype == torch.float32:
        return query.dtype
    return query.dtype if onednn_linear_available(query.dtype) else torch.float32


def _attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of ``[Hkv, B, G, D]`` queries over ``[Hkv, B, L, D]`` keys/values."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values)


class PartialAttention(NamedTuple):
    """Softmax attention over part of the keys, before normalization, with
    ``p_j = exp(score_j - maximum)``, so parts over disjoint keys can be merged exactly."""

    output: torch.Tensor  # sum_j p_j v_j
    maximum: torch.Tensor  # the max score
    total: torch.Tensor  # sum_j p_j


def _partial_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    scale: float,
) -> PartialAttention:
    """Unnormalized softmax attention (see ``PartialAttention``)."""
    # Softmax statistics in float32 whatever the cache dtype.
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float().mul_(scale)
    if valid is not None:
        scores.masked_fill_(~valid, float("-inf"))
    maximum = scores.amax(dim=-1, keepdim=True)
    probs = scores.sub_(maximum).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    return PartialAttention(torch.matmul(probs.to(values.dtype), values).float(), maximum, total)


def _merge(first: PartialAttention, second: PartialAttention) -> PartialAttention:
    """The partial attention over the union of two disjoint key sets."""
    maximum = torch.maximum(first.maximum, second.maximum)
    weight_first = (first.maximum - maximum).exp_()
    weight_second = (second.maximum - maximum).exp_()
    return PartialAttention(
        first.output * weight_first + second.output * weight_second,
        maximum,
        first.total * weight_first + second.total * weight_second,
    )


def _visible(
    query_len: int, seq_len: int, device: torch.device, sliding_window: int | None = None
) -> torch.Tensor:
    """``[query_len, seq_len]``: which keys each of the sequence's last ``query_len``
    positions sees (itself and before, within the window if any)."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


def _prefill_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq: _PrefillSeq,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """query ``[q, H, D]`` against the sequence's keys/values ``[Hkv, seq_len, D]``."""
    # The causal mask is the step plan's, shared by every layer; a window is per layer.
    mask = seq.causal_mask
    if sliding_window is not None:
        mask = _visible(query.shape[0], seq.seq_len, query.device, sliding_window)
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
