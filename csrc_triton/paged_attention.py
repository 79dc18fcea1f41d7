"""Varlen causal attention over a paged KV cache: prefill, chunked prefill and decode in one kernel.

Each program owns one tile of ``BLOCK_Q`` consecutive query tokens of one sequence and all
query heads that share one KV head, so every K/V tile is loaded once per GQA group. The tile's
rows are (query token, head in group) pairs: row ``r`` is token ``r // GROUP_PAD`` of the tile
and head ``r % GROUP_PAD`` of the group. Keys are gathered position by position through the
block table, so the kernel works for any cache block size.

For decode with few sequences and long contexts, the KV range can additionally be split across
programs (flash-decoding); a second small kernel then merges the partial softmax results.
"""

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

from csrc_triton.fp8 import FP8_FORMATS

# log2(e): the kernel works in base 2 so it can use exp2.
_LOG2_E = 1.4426950408889634
_MAX_HEAD_DIM = 256
_MAX_NUM_SPLITS = 16
# The Triton interpreter multiplies the raw bits of bf16 operands in tl.dot
# (triton-lang/triton#11584), so interpreted kernels upcast dot operands to fp32 first. Read at
# import time, like @triton.jit itself.
_UPCAST_DOT_OPERANDS = knobs.runtime.interpret


@triton.jit
def _dot(a, b, UPCAST_OPERANDS: tl.constexpr):
    if UPCAST_OPERANDS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # "ieee" keeps fp32 inputs out of TF32; it is ignored for fp16/bf16 inputs.
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    split_max_ptr,
    split_sum_ptr,
    qk_scale,
    v_scale,
    sliding_window,
    num_queries_per_kv,
    head_dim,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_h,
    stride_kc_d,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_h,
    stride_vc_d,
    stride_bt_seq,
    stride_o_split,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_split_stat_split,
    stride_split_stat_t,
    USE_SLIDING_WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST_DOT_OPERANDS: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # The grid is sized for the longest query in the batch; shorter ones have nothing here.
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    # NOTE: this step's K/V are already in the cache, so query token i sits at context_len + i.
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (head_in_group < num_queries_per_kv)
    token = (q_start + q_idx).to(tl.int64)
    head = kv_head * num_queries_per_kv + head_in_group
    q_pos = context_len + q_idx
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim

    q = tl.load(
        query_ptr
        + token[:, None] * stride_q_t
        + head[:, None] * stride_q_h
        + dims[None, :] * stride_q_d,
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    # Key positions any row of this tile may see: up to the last row's own position, and
    # with a window, no earlier than the first row's window start.
    kv_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    kv_start = tl.zeros([], tl.int32)
    if USE_SLIDING_WINDOW:
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, BLOCK_N), NUM_SPLITS)
        kv_start = kv_start + split * tiles_per_split * BLOCK_N
        kv_end = tl.minimum(kv_start + tiles_per_split * BLOCK_N, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt_seq
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        k_pos = tile_start + tl.arange(0, BLOCK_N)
        k_mask = k_pos < kv_end
        # NOTE: only entries for positions < seq_len are read; trailing ones may hold anything.
        block = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
        offset = k_pos % BLOCK_SIZE
        # K is gathered transposed, [BLOCK_D, BLOCK_N], ready for q @ k.
        k = tl.load(
            key_cache_ptr
            + block[None, :] * stride_kc_block
            + offset[None, :] * stride_kc_offset
            + kv_head * stride_kc_h
            + dims[:, None] * stride_kc_d,
            mask=k_mask[None, :] & dim_mask[:, None],
            other=0.0,
        ).to(q.dtype)
        s = _dot(q, k, UPCAST_DOT_OPERANDS) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_mask[None, :]
        if USE_SLIDING_WINDOW:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 instead so that
        # exp2 gives 0 rather than NaN from (-inf) - (-inf).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr
            + block[:, None] * stride_vc_block
            + offset[:, None] * stride_vc_offset
            + kv_head * stride_vc_h
            + dims[None, :] * stride_vc_d,
            mask=k_mask[:, None] & dim_mask[None, :],
            other=0.0,
        ).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST_DOT_OPERANDS)
        m_i = m_new

    # The cache holds V / v_scale; K's scale is folded into qk_scale.
    acc = acc * v_scale
    if NUM_SPLITS == 1:
        # Padding rows never saw a key (l = 0); divide them by 1 rather than produce NaN.
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    else:
        stat_offset = split * stride_split_stat_split + token * stride_split_stat_t + head
        tl.store(split_max_ptr + stat_offset, m_i, mask=row_mask)
        tl.store(split_sum_ptr + stat_offset, l_i, mask=row_mask)
    tl.store(
        out_ptr
        + split * stride_o_split
        + token[:, None] * stride_o_t
        + head[:, None] * stride_o_h
        + dims[None, :] * stride_o_d,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


@triton.jit
def _merge_splits_kernel(
    split_out_ptr,
    split_max_ptr,
    split_sum_ptr,
    out_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_splits,
    head_dim,
    stride_so_split,
    stride_so_t,
    stride_so_h,
    stride_stat_split,
    stride_stat_t,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Padding rows past the last sequence have no partial results; leave their output alone.
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim

    stat_offset = splits * stride_stat_split + token * stride_stat_t + head
    split_max = tl.load(split_max_ptr + stat_offset, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(split_sum_ptr + stat_offset, mask=split_mask, other=0.0)
    # NOTE: every query sees at least its own key, so some split has a finite max.
    weight = tl.math.exp2(split_max - tl.max(split_max, 0))
    split_acc = tl.load(
        split_out_ptr
        + splits[:, None] * stride_so_split
        + token * stride_so_t
        + head * stride_so_h
        + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.sum(split_acc * weight[:, None], 0) / tl.sum(split_sum * weight, 0)
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + dims * stride_o_d,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _choose_num_splits(
    num_programs: int, max_query_len: int, max_seq_len: int, device: torch.device
) -> int:
    """Split the KV range only for pure decode batches too small to fill the GPU."""
    if device.type != "cuda" or max_query_len != 1:
        return 1
    num_sms = _num_sms(device)
    if num_programs >= num_sms:
        return 1
    # Each split should still stream at least ~512 keys, or the merge pass costs more than it saves.
    splits_to_fill_gpu: int = triton.cdiv(num_sms, num_programs)
    return max(1, min(_MAX_NUM_SPLITS, splits_to_fill_gpu, max_seq_len // 512))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal grouped-query attention of flat varlen queries over a paged KV cache.

    Serves prefill, chunked prefill, prefix-cache hits and decode, mixed in one batch.

    Args:
        query: ``[T, num_heads, head_dim]``; sequence ``b`` owns rows
            ``query_start_loc[b]:query_start_loc[b + 1]``. Any strides.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the dtype of ``query``
            or fp8 (``float8_e4m3fn`` / ``float8_e5m2``), read as ``key_cache * k_scale``.
        value_cache: same shape and dtype as ``key_cache``, read as ``value_cache * v_scale``.
        block_tables: ``[B, max_blocks]`` int32; only the first ``ceil(seq_lens[b] / block_size)``
            entries of row ``b`` are read.
        seq_lens: ``[B]`` int32, context length of each sequence after this step; this step's
            keys and values must already be stored in the cache.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths.
        max_query_len: upper bound on the query lengths (sizes the grid).
        max_seq_len: upper bound on ``seq_lens`` (used only to choose the split-KV path).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: if set to ``W``, a query at position ``p`` sees keys at ``p - W < k <= p``.
        out: optional ``[T, num_heads, head_dim]`` output buffer, same dtype as ``query``.
        num_splits: number of programs sharing one query tile's KV range (flash-decoding);
            ``None`` picks it from the batch shape (only pure decode on CUDA ever splits).
        k_scale: the keys' quantization scale (see :func:`csrc_triton.store_kv`).
        v_scale: the values' quantization scale.

    Returns:
        ``[T, num_heads, head_dim]`` in the dtype of ``query`` (``out`` if given). Rows past
        ``query_start_loc[B]`` are left untouched.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    num_seqs = block_tables.shape[0]
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}"
        )
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != query head_dim {head_dim}")
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported; at most {_MAX_HEAD_DIM}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if value_cache.dtype != key_cache.dtype or key_cache.dtype not in (query.dtype, *FP8_FORMATS):
        raise ValueError(
            f"cache dtypes {key_cache.dtype}/{value_cache.dtype} must both be the query dtype"
            f" {query.dtype} or both one fp8 dtype"
        )
    if seq_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} must be ({num_seqs},) and query_start_loc"
            f" {tuple(query_start_loc.shape)} must be ({num_seqs + 1},) for {num_seqs} block tables"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if num_splits is not None and not 1 <= num_splits <= _MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_NUM_SPLITS}], got {num_splits}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must match query {tuple(query.shape)} {query.dtype}"
        )
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out

    num_queries_per_kv = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(num_queries_per_kv)
    # tl.dot needs every dimension >= 16. Decode rows are mostly padding, so keep decode tiles
    # at the minimum; prefill tiles are larger to reuse each K/V tile across more queries.
    block_m = max(16 if max_query_len == 1 else 64, group_pad)
    block_q = block_m // group_pad
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Keep one K or V tile at 16 KiB so a few pipeline stages fit in shared memory.
    block_n = 64 if block_d * query.element_size() <= 256 else 32
    num_q_blocks = triton.cdiv(max_query_len, block_q)
    if num_splits is None:
        num_splits = _choose_num_splits(
            num_q_blocks * num_seqs * num_kv_heads, max_query_len, max_seq_len, query.device
        )

    if num_splits == 1:
        kernel_out, split_max, split_sum = out, out, out
        split_out_strides = (0, *out.stride())
        split_stat_strides: tuple[int, ...] = (0, 0)
    else:
        kernel_out = query.new_empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32
        )
        split_max = query.new_empty((num_splits, num_tokens, num_heads), dtype=torch.float32)
        split_sum = torch.empty_like(split_max)
        split_out_strides = kernel_out.stride()
        split_stat_strides = split_max.stride()[:2]

    _paged_attention_kernel[(num_q_blocks, num_seqs, num_kv_heads * num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        kernel_out,
        split_max,
        split_sum,
        scale * k_scale * _LOG2_E,
        v_scale,
        sliding_window or 0,
        num_queries_per_kv,
        head_dim,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_tables.stride(0),
        *split_out_strides,
        *split_stat_strides,
        USE_SLIDING_WINDOW=sliding_window is not None,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        UPCAST_DOT_OPERANDS=_UPCAST_DOT_OPERANDS,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            kernel_out,
            split_max,
            split_sum,
            out,
            query_start_loc,
            num_seqs,
            num_splits,
            head_dim,
            *kernel_out.stride()[:3],
            *split_stat_strides,
            *out.stride(),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
