"""Scatter this step's keys and values into the paged KV cache."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    head_dim,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_h,
    stride_kc_d,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_h,
    stride_vc_d,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    # int64: slot * stride can exceed 2**31 in a large cache.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # NOTE: slot -1 marks a padded token (e.g. a CUDA-graph batch slot) that owns no cache slot.
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    key = tl.load(key_ptr + token * stride_k_t + heads * stride_k_h + dims * stride_k_d, mask=mask)
    value = tl.load(
        value_ptr + token * stride_v_t + heads * stride_v_h + dims * stride_v_d, mask=mask
    )
    key_dst = block * stride_kc_block + offset * stride_kc_offset
    value_dst = block * stride_vc_block + offset * stride_vc_offset
    tl.store(
        key_cache_ptr + key_dst + heads * stride_kc_h + dims * stride_kc_d,
        key.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        value_cache_ptr + value_dst + heads * stride_vc_h + dims * stride_vc_d,
        value.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its slot of the paged KV cache.

    Args:
        key: ``[T, num_kv_heads, head_dim]``; any strides (e.g. a view into a fused qkv tensor).
        value: ``[T, num_kv_heads, head_dim]``; any strides.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        value_cache: same shape as ``key_cache``, written in place.
        slot_mapping: ``[T]`` int32 or int64; token ``t`` goes to flat slot
            ``slot_mapping[t] = block * block_size + offset``. Slot ``-1`` skips the token.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if key_cache.shape != value_cache.shape or key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must both"
            f" be [num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != ({num_tokens},)")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
