"""Weight-only matmul: int8 or fp8 weights with one scale per output channel, dequantized
in the GEMM's inner loop."""

import torch
import triton
import triton.language as tl

# NOTE: the interpreter's bf16 tl.dot workaround is shared with paged attention.
from csrc_triton.fp8 import FP8_FORMATS
from csrc_triton.paged_attention import _UPCAST_DOT_OPERANDS, _dot

# Rows of x per program when the batch is small (decode) or large (prefill). tl.dot needs
# every block dimension to be at least 16.
_SMALL_BLOCK_M = 16
_LARGE_BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64


def tile_launch(num_rows: int, out_features: int) -> tuple[int, tuple[int, int]]:
    """BLOCK_M and the grid of a weight-only matmul kernel over ``[num_rows, out_features]``."""
    block_m = _SMALL_BLOCK_M if num_rows <= _SMALL_BLOCK_M else _LARGE_BLOCK_M
    return block_m, (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, BLOCK_N))


@triton.jit
def _activation_tile(x_ptr, rows, k, stride_x_m, stride_x_k, row_mask, k_mask):
    """The ``[BLOCK_M, BLOCK_K]`` tile of ``x`` at ``rows`` x ``k``, zero outside."""
    return tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_x_m + k[None, :] * stride_x_k,
        mask=row_mask[:, None] & k_mask[None, :],
        other=0.0,
    )


@triton.jit
def _weight_only_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    num_rows,
    out_features,
    in_features,
    stride_x_m,
    stride_x_k,
    stride_w_n,
    stride_w_k,
    stride_o_m,
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
        w = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_w_n + k[:, None] * stride_w_k,
            mask=col_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        # Every int8 and fp8 value is exact in any float type the activations come in
        # (through float32: the interpreter converts int8 to bf16 wrongly); the scale
        # factors out of the sum over k, so it is applied once, to the accumulator.
        acc += _dot(x, w.to(tl.float32).to(x.dtype), UPCAST_DOT_OPERANDS)
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_o_m + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


# The weight dtypes the kernel reads.
WEIGHT_DTYPES = (torch.int8, *FP8_FORMATS)


def weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` with the weight kept in int8 or fp8.

    Args:
        x: ``[M, K]`` activations (float32, bfloat16 or float16), any strides.
        weight: ``[N, K]`` int8, ``float8_e4m3fn`` or ``float8_e5m2`` (e4m3 needs a GPU
            of compute capability 8.9 or later, as Triton converts it only there).
        scale: ``[N]``, one scale per output channel.

    Returns:
        ``[M, N]`` in the dtype of ``x``; float32 inputs are multiplied in IEEE float32
        (no TF32), so results match a float32 matmul up to summation order.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if weight.dtype not in WEIGHT_DTYPES or scale.shape != (weight.shape[0],):
        raise ValueError(
            f"weight must be one of {WEIGHT_DTYPES} with one scale per row, got "
            f"{weight.dtype} and scale shape {tuple(scale.shape)}"
        )
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    out = x.new_empty((num_rows, out_features))
    if num_rows == 0 or out_features == 0:
        return out
    block_m, grid = tile_launch(num_rows, out_features)
    _weight_only_matmul_kernel[grid](
        x,
        weight,
        scale,
        out,
        num_rows,
        out_features,
        in_features,
        *x.stride(),
        *weight.stride(),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        UPCAST_DOT_OPERANDS=_UPCAST_DOT_OPERANDS,
        num_warps=4,
    )
    return out
