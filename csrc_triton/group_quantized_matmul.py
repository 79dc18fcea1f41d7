"""Group-quantized matmul: a weight of 4-bit (two to a byte) or 8-bit codes with a float32
scale and offset per group of input features, dequantized in the GEMM's inner loop. The
layout GGUF's types and pre-quantized int4 / int8 checkpoints are repacked into."""

import torch
import triton
import triton.language as tl

# NOTE: the interpreter's bf16 tl.dot workaround is shared with paged attention.
from csrc_triton.paged_attention import _UPCAST_DOT_OPERANDS, _dot
from csrc_triton.weight_only_matmul import BLOCK_K, BLOCK_N, _activation_tile, tile_launch


@triton.jit
def _group_quantized_matmul_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    offset_ptr,
    out_ptr,
    num_rows,
    out_features,
    in_features,
    group_size,
    stride_x_m,
    stride_x_k,
    stride_c_n,
    stride_s_n,
    stride_o_m,
    NIBBLES: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT_OPERANDS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    col_mask = cols < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        k = k_start + ks
        k_mask = k < in_features
        x = _activation_tile(x_ptr, rows, k, stride_x_m, stride_x_k, row_mask, k_mask)
        w_mask = col_mask[None, :] & k_mask[:, None]
        col_base = cols[None, :].to(tl.int64)
        if NIBBLES:
            # Feature k is the low nibble of byte k // 2 for even k, the high one for odd.
            packed = tl.load(
                codes_ptr + col_base * stride_c_n + (k // 2)[:, None], mask=w_mask, other=0
            ).to(tl.int32)
            codes = (packed >> ((k % 2) * 4)[:, None]) & 0xF
        else:
            codes = tl.load(
                codes_ptr + col_base * stride_c_n + k[:, None], mask=w_mask, other=0
            ).to(tl.int32)
        # The scale and offset change with the group along k, so they multiply each
        # weight, not the accumulator: the weight is dequantized in float32, as the
        # format's own dequantizer does, then rounded to the activations' dtype.
        group = col_base * stride_s_n + (k // group_size)[:, None]
        weight = codes.to(tl.float32) * tl.load(scale_ptr + group, mask=w_mask, other=0.0)
        if HAS_OFFSET:
            weight += tl.load(offset_ptr + group, mask=w_mask, other=0.0)
        acc += _dot(x, weight.to(x.dtype), UPCAST_DOT_OPERANDS)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_o_m + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def group_quantized_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """``x @ W.T`` for ``W[n, k] = scale[n, k // g] * code[n, k] + offset[n, k // g]``.

    Args:
        x: ``[M, K]`` activations (float32, bfloat16 or float16), any strides.
        codes: ``[N, K / 2]`` uint8, two 4-bit codes a byte (feature ``2j`` in byte ``j``'s
            low nibble, ``2j + 1`` in its high one), or ``[N, K]`` int8.
        scale: ``[N, K / g]`` float32; ``offset`` the same, or None for none.
        group_size: ``g``, consecutive input features per scale.

    Returns:
        ``[M, N]`` in the dtype of ``x``.
    """
    nibbles = codes.dtype == torch.uint8
    num_rows, in_features = x.shape
    out_features = codes.shape[0]
    if codes.shape[1] * (2 if nibbles else 1) != in_features or codes.dtype not in (
        torch.uint8,
        torch.int8,
    ):
        raise ValueError(
            f"codes must be [N, K/2] uint8 or [N, K] int8 for x [M, K], got {codes.dtype} "
            f"{tuple(codes.shape)} for x {tuple(x.shape)}"
        )
    if scale.shape != (out_features, in_features // group_size) or (
        offset is not None and offset.shape != scale.shape
    ):
        raise ValueError(
            f"scale (and offset) must be [N, K/g] = [{out_features}, "
            f"{in_features // group_size}], got {tuple(scale.shape)}"
        )
    codes, scale = codes.contiguous(), scale.contiguous().float()
    offset = None if offset is None else offset.contiguous().float()
    out = x.new_empty((num_rows, out_features))
    if num_rows == 0 or out_features == 0:
        return out
    block_m, grid = tile_launch(num_rows, out_features)
    _group_quantized_matmul_kernel[grid](
        x,
        codes,
        scale,
        scale if offset is None else offset,
        out,
        num_rows,
        out_features,
        in_features,
        group_size,
        *x.stride(),
        codes.stride(0),
        scale.stride(0),
        out.stride(0),
        NIBBLES=nibbles,
        HAS_OFFSET=offset is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        UPCAST_DOT_OPERANDS=_UPCAST_DOT_OPERANDS,
        num_warps=4,
    )
    return out
