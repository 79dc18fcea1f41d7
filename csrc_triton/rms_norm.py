"""RMSNorm, alone or fused with the residual add that precedes it."""

import torch
import triton
import triton.language as tl

# One program holds a whole row in registers; wider rows would spill.
_MAX_HIDDEN_SIZE = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    hidden_size,
    eps,
    stride_x_t,
    stride_x_n,
    stride_r_t,
    stride_r_n,
    stride_w,
    stride_o_t,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x_t + cols * stride_x_n, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * stride_r_t + cols * stride_r_n
        residual = tl.load(residual_row, mask=mask, other=0.0)
        # Round the sum to the input dtype before normalizing, as the unfused torch code does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_row, x, mask=mask)

    # HF LlamaRMSNorm: normalize in fp32, round to the input dtype, then scale by the weight.
    h = x.to(tl.float32)
    variance = tl.sum(h * h, 0) / hidden_size
    h = (h * tl.math.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols * stride_w, mask=mask)
    out = weight.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o_t + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, N], got shape {tuple(x.shape)}")
    num_tokens, hidden_size = x.shape
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden_size},)")
    if hidden_size > _MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden size {hidden_size} is not supported; at most {_MAX_HIDDEN_SIZE}")
    # torch's type promotion of `weight * h`, which HF uses.
    out = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    if num_tokens == 0:
        return out
    block_n = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        hidden_size,
        eps,
        *x.stride(),
        *(x if residual is None else residual).stride(),
        weight.stride(0),
        out.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        num_warps=min(16, max(1, block_n // 256)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalize each row of ``x`` and scale by ``weight``, exactly as HF's LlamaRMSNorm.

    Args:
        x: ``[T, N]``, any strides.
        weight: ``[N]``.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        ``[T, N]`` in ``torch.promote_types(weight.dtype, x.dtype)``.
    """
    return _rms_norm(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``x`` into ``residual`` in place, then RMS-normalize the sum.

    Args:
        x: ``[T, N]``, any strides.
        residual: ``[T, N]``, same dtype as ``x``; overwritten with ``x + residual``.
        weight: ``[N]``.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        ``(rms_norm(x + residual), residual)``; the second item is the updated ``residual``.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x"
            f" {tuple(x.shape)} {x.dtype}"
        )
    return _rms_norm(x, residual, weight, eps), residual
