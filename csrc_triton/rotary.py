"""Rotary position embedding (NeoX / HF rotate_half style), applied in place."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    num_heads,
    half_dim,
    stride_t,
    stride_h,
    stride_d,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half_dim)
    x1_ptr = x_ptr + token * stride_t + heads * stride_h + dims * stride_d
    x2_ptr = x1_ptr + half_dim * stride_d
    x1 = tl.load(x1_ptr, mask=mask, other=0.0)
    x2 = tl.load(x2_ptr, mask=mask, other=0.0)
    x1_f = x1.to(tl.float32)
    x2_f = x2.to(tl.float32)
    tl.store(x1_ptr, (x1_f * cos - x2_f * sin).to(x1.dtype), mask=mask)
    tl.store(x2_ptr, (x2_f * cos + x1_f * sin).to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,
    key_ptr,
    positions_ptr,
    cos_sin_cache_ptr,
    num_heads,
    num_kv_heads,
    half_dim,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_cache_pos,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cache_row = cos_sin_cache_ptr + position * stride_cache_pos
    # Shared by every query and key head of this token.
    cos = tl.load(cache_row + dims, mask=dims < half_dim, other=0.0)
    sin = tl.load(cache_row + half_dim + dims, mask=dims < half_dim, other=0.0)
    _rotate_heads(
        query_ptr,
        token,
        num_heads,
        half_dim,
        stride_q_t,
        stride_q_h,
        stride_q_d,
        cos,
        sin,
        BLOCK_Q_HEADS,
        BLOCK_HALF,
    )
    _rotate_heads(
        key_ptr,
        token,
        num_kv_heads,
        half_dim,
        stride_k_t,
        stride_k_h,
        stride_k_d,
        cos,
        sin,
        BLOCK_K_HEADS,
        BLOCK_HALF,
    )


def apply_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate ``query`` and ``key`` in place by their tokens' positions.

    With ``x1, x2`` the first and second halves of each head,
    ``x1' = x1 * cos - x2 * sin`` and ``x2' = x2 * cos + x1 * sin``, computed in fp32.

    Args:
        query: ``[T, num_heads, head_dim]``; any strides (writes go through views).
        key: ``[T, num_kv_heads, head_dim]``; any strides.
        positions: ``[T]`` int64 token positions.
        cos_sin_cache: ``[max_position, head_dim]`` fp32; columns ``[:head_dim // 2]`` hold
            ``cos(pos * inv_freq)`` and ``[head_dim // 2:]`` hold ``sin(pos * inv_freq)``.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape != (num_tokens, num_kv_heads, head_dim):
        raise ValueError(
            f"key shape {tuple(key.shape)} must be ({num_tokens}, num_kv_heads, {head_dim})"
        )
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions shape {tuple(positions.shape)} != ({num_tokens},)")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache shape {tuple(cos_sin_cache.shape)} must be [max_position, {head_dim}]"
        )
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache rows must be contiguous")
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos_sin_cache,
        num_heads,
        num_kv_heads,
        head_dim // 2,
        *query.stride(),
        *key.stride(),
        cos_sin_cache.stride(0),
        BLOCK_Q_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_K_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        num_warps=4,
    )
