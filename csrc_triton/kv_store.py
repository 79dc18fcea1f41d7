"""Scatter this step's keys and values into the paged KV cache, quantized to fp8 where the
cache is fp8."""

import torch
import triton
import triton.language as tl

from csrc_triton.fp8 import FP8_FORMATS


@triton.jit
def _round_to_fp8(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX: tl.constexpr):
    """fp32 ``x`` saturated to ``[-MAX, MAX]`` and rounded to the nearest value of the fp8
    format (ties to even), still in fp32, so the cast that follows is exact.

    NOTE: rounded here, not by the cast: the Triton interpreter's fp32 -> fp8 cast drops the
    carry of a mantissa that rounds up into the next power of two (7.94 -> 4.0).
    """
    magnitude = tl.minimum(tl.abs(x), MAX)
    # The exponent from the bits (exact, unlike log2), at least the smallest normal one:
    # below it the format's subnormals have that exponent's spacing.
    exponent = tl.maximum((magnitude.to(tl.int32, bitcast=True) >> 23) - 127, MIN_EXPONENT)
    # Powers of two built from their bits, so both multiplications are exact.
    step = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - exponent + MANTISSA_BITS) << 23).to(tl.float32, bitcast=True)
    # Adding and subtracting 1.5 * 2**23 rounds |y| < 2**22 to an integer, ties to even.
    rounded = ((magnitude * inv_step + 12582912.0) - 12582912.0) * step
    # The sign from the sign bit, so that what rounds to zero keeps it (-0.001 -> -0.0).
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -rounded, rounded)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_inv_scale,
    v_inv_scale,
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
    FP8: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXPONENT: tl.constexpr,
    FP8_MAX: tl.constexpr,
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
    key = key.to(tl.float32) * k_inv_scale
    value = value.to(tl.float32) * v_inv_scale
    if FP8:
        key = _round_to_fp8(key, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_MAX)
        value = _round_to_fp8(value, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_MAX)
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's key and value into its slot of the paged KV cache.

    The cache holds ``key / k_scale`` and ``value / v_scale`` (multiplied by the float32
    reciprocal of the scale) in its own dtype; an fp8 cache saturates at its largest finite
    value and rounds to nearest, ties to even, as torch's cast does.

    Args:
        key: ``[T, num_kv_heads, head_dim]``; any strides (e.g. a view into a fused qkv tensor).
        value: ``[T, num_kv_heads, head_dim]``; any strides.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place;
            the dtype of ``key`` or wider, or ``float8_e4m3fn`` / ``float8_e5m2``.
        value_cache: same shape and dtype as ``key_cache``, written in place.
        slot_mapping: ``[T]`` int32 or int64; token ``t`` goes to flat slot
            ``slot_mapping[t] = block * block_size + offset``. Slot ``-1`` skips the token.
        k_scale: the keys' quantization scale (positive).
        v_scale: the values' quantization scale (positive).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if key_cache.shape != value_cache.shape or key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must both"
            f" be [num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}"
        )
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"k_scale and v_scale must be positive, got {k_scale} and {v_scale}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != ({num_tokens},)")
    if num_tokens == 0:
        return
    fp8 = FP8_FORMATS.get(key_cache.dtype)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8 is not None,
        FP8_MANTISSA_BITS=0 if fp8 is None else fp8.mantissa_bits,
        FP8_MIN_EXPONENT=0 if fp8 is None else fp8.min_exponent,
        FP8_MAX=0.0 if fp8 is None else fp8.max,
        num_warps=4,
    )
