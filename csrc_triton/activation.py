"""Gated activations for MLP blocks."""

import torch
import triton
import triton.language as tl

_BLOCK_SIZE = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    intermediate_size,
    stride_x_t,
    stride_x_n,
    stride_o_t,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate_ptr = x_ptr + row * stride_x_t + cols * stride_x_n
    gate = tl.load(gate_ptr, mask=mask, other=0.0)
    up = tl.load(gate_ptr + intermediate_size * stride_x_n, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    # Round silu to the input dtype before the product, like torch's F.silu(gate) * up.
    silu = (gate_f * tl.sigmoid(gate_f)).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o_t + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: ``silu(x[:, :I]) * x[:, I:]``.

    Args:
        x: ``[T, 2 * I]``, any strides (the fused gate/up projection output).

    Returns:
        ``[T, I]`` in the dtype of ``x``.
    """
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [T, 2 * I], got shape {tuple(x.shape)}")
    num_tokens, intermediate_size = x.shape[0], x.shape[1] // 2
    out = x.new_empty((num_tokens, intermediate_size))
    if num_tokens == 0 or intermediate_size == 0:
        return out
    block = min(_BLOCK_SIZE, triton.next_power_of_2(intermediate_size))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate_size, block))](
        x,
        out,
        intermediate_size,
        *x.stride(),
        out.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return out
