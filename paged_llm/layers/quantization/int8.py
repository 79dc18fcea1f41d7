"""Weight-only int8 with one scale per output channel, made at load time from float weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.layers.kernels import triton_kernels
from paged_llm.layers.quantization.base import QuantizedLinearMethod

if TYPE_CHECKING:
    from paged_llm.layers.linear import CheckpointPart, Linear
    from paged_llm.layers.weights import CheckpointTensor

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 rows of float32 ``weight`` and their scales, the row's largest
    magnitude / 127 (1 for an all-zero row)."""
    absmax = weight.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    quantized = torch.round(weight / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return quantized.to(torch.int8), scale


class Int8LinearMethod(QuantizedLinearMethod):
    """``x @ (q * s).T`` with int8 ``q`` and one float scale ``s`` per output channel.

    Activations stay in the model's dtype. On CPU the matmul is torch's
    ``_weight_int8pack_mm`` (vectorized for bfloat16 activations; for float32 it runs a
    scalar loop, see docs/quantization.md); on CUDA it is csrc_triton's
    `int8_weight_matmul`, which dequantizes in the GEMM's inner loop. An embedding looks up
    int8 rows and multiplies each by its scale.
    """

    quantizes_embeddings = True

    def __init__(self, triton: bool) -> None:
        self.triton = triton

    def create_weights(self, layer: Linear) -> None:
        shape = (layer.out_features, layer.in_features)
        layer.weight = nn.Parameter(torch.empty(shape, dtype=torch.int8), requires_grad=False)
        # NOTE: a float buffer, so the model's dtype reaches it: both kernels take the
        # scales in the activations' dtype.
        layer.register_buffer("weight_scale", torch.empty(layer.out_features))

    def load_weight(self, layer: Linear, loaded: CheckpointTensor, part: CheckpointPart) -> None:
        # Whole checkpoint rows, even where this rank keeps some of their columns: each
        # row's scale is the whole row's, so every rank quantizes as a single rank would.
        quantized, scale = quantize_int8(loaded.read(rows=part.rows).float())
        if part.cols is not None:
            start, size = part.cols
            quantized = quantized[:, start : start + size]
        layer.weight.data[part.out_rows].copy_(quantized)
        layer.get_buffer("weight_scale")[part.out_rows] = scale

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, scale = layer.weight, layer.get_buffer("weight_scale")
        if self.triton:
            out = triton_kernels().int8_weight_matmul(x, qweight, scale)
        else:
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), qweight, scale)
        return out if bias is None else out.add_(bias)

    def embedding(self, layer: Linear, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scale = layer.get_buffer("weight_scale")
        return F.embedding(token_ids, layer.weight).to(dtype) * scale[token_ids, None].to(dtype)
