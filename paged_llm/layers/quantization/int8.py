"""Weight-only int8 with one scale per output channel, made at load time from float weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_llm.layers.kernels import triton_kernels
from paged_llm.layers.quantization.base import QuantizedLinearMethod

if TYPE_CHECKING:
    from paged_llm.layers.linear import Linear

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 rows of ``weight`` and their scales, ``absmax / 127`` per row.

    ``absmax`` is each row's largest magnitude over the whole checkpoint row, of which
    ``weight`` may hold only some columns (a row-parallel shard), so every rank quantizes
    its part with the scale the whole row gets. An all-zero row gets scale 1.
    """
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    quantized = torch.round(weight / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return quantized.to(torch.int8), scale


class Int8LinearMethod(QuantizedLinearMethod):
    """``x @ (q * s).T`` with int8 ``q`` and one float scale ``s`` per output channel.

    Activations stay in the model's dtype. On CPU the matmul is torch's
    ``_weight_int8pack_mm`` (vectorized for bfloat16 activations; for float32 it runs a
    scalar loop, see docs/quantization.md); on CUDA it is csrc_triton's
    `int8_weight_matmul`, which dequantizes in the GEMM's inner loop.
    """

    def __init__(self, triton: bool) -> None:
        self.triton = triton

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = layer.weight.detach()
        quantized, scale = quantize_int8(weight.float(), layer.row_absmax(weight.float()))
        layer.register_buffer("qweight", quantized)
        # NOTE: scales in the activations' dtype: both kernels take them so.
        layer.register_buffer("weight_scale", scale.to(weight.dtype))
        layer.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, scale = layer.get_buffer("qweight"), layer.get_buffer("weight_scale")
        if self.triton:
            out = triton_kernels().int8_weight_matmul(x, qweight, scale)
        else:
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), qweight, scale)
        return out if bias is None else out.add_(bias)
