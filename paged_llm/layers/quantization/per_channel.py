"""Weight-only int8 or fp8 with one scale per output channel, made at load time from float
weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.layers.kernels import triton_kernels
from paged_llm.layers.quantization.base import QuantizableLayer, QuantizedLinearMethod
from paged_llm.layers.weights import CheckpointPart, CheckpointTensor

# The largest magnitude of each weight dtype's codes: int8 is kept symmetric (-127..127),
# fp8 goes up to its largest finite value (448 for e4m3).
CODE_MAX: dict[torch.dtype, float] = {
    torch.int8: 127,
    torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,
}


def quantize_per_channel(
    weight: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric ``dtype`` rows of float32 ``weight`` and their scales, the row's largest
    magnitude / `CODE_MAX` (1 for an all-zero row), rounded to nearest (an fp8 cast rounds
    to nearest even itself)."""
    code_max = CODE_MAX[dtype]
    absmax = weight.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / code_max, torch.ones_like(absmax))
    scaled = (weight / scale[:, None]).clamp_(-code_max, code_max)
    return (scaled if dtype.is_floating_point else scaled.round_()).to(dtype), scale


class PerChannelLinearMethod(QuantizedLinearMethod):
    """``x @ (q * s).T`` with ``q`` in int8 or fp8 (e4m3) and one float scale ``s`` per
    output channel, made at load time from float weights (vLLM's dynamic fp8 for weights,
    per channel).

    Activations stay in the model's dtype. On CUDA the matmul is csrc_triton's
    `weight_only_matmul`, which dequantizes in the GEMM's inner loop, for both dtypes. On
    CPU only int8 runs (the platform refuses fp8 at start-up): torch's
    ``_weight_int8pack_mm`` (vectorized for bfloat16 activations; for float32 it runs a
    scalar loop, see docs/quantization.md). An embedding looks up rows of codes and
    multiplies each by its scale.
    """

    quantizes_embeddings = True

    def __init__(self, weight_dtype: torch.dtype, triton: bool) -> None:
        self.weight_dtype = weight_dtype
        self.triton = triton
        # NOTE: fp8 codes are held as their bytes: Module.to(dtype) converts every
        # floating-point tensor, fp8 included, and the model is cast after it is built.
        self.storage_dtype = torch.uint8 if weight_dtype.is_floating_point else weight_dtype

    def codes(self, layer: QuantizableLayer) -> torch.Tensor:
        """The layer's weight codes, in `weight_dtype`."""
        return layer.weight.view(self.weight_dtype)

    def create_weights(self, layer: QuantizableLayer) -> None:
        shape = (layer.out_features, layer.in_features)
        layer.weight = nn.Parameter(
            torch.empty(shape, dtype=self.storage_dtype), requires_grad=False
        )
        # NOTE: a float buffer, so the model's dtype reaches it: both kernels take the
        # scales in the activations' dtype.
        layer.register_buffer("weight_scale", torch.empty(layer.out_features))

    def load_weight(
        self, layer: QuantizableLayer, loaded: CheckpointTensor, part: CheckpointPart
    ) -> None:
        # Whole checkpoint rows, even where this rank keeps some of their columns: each
        # row's scale is the whole row's, so every rank quantizes as a single rank would.
        quantized, scale = quantize_per_channel(
            loaded.read(rows=part.rows).float(), self.weight_dtype
        )
        if part.cols is not None:
            start, size = part.cols
            quantized = quantized[:, start : start + size]
        layer.weight.data[part.out_rows].copy_(quantized.view(self.storage_dtype))
        layer.get_buffer("weight_scale")[part.out_rows] = scale

    def apply(
        self, layer: QuantizableLayer, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        qweight, scale = self.codes(layer), layer.get_buffer("weight_scale")
        if self.triton:
            out: torch.Tensor = triton_kernels().weight_only_matmul(x, qweight, scale)
        else:
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), qweight, scale)
        return out if bias is None else out.add_(bias)

    def embedding(
        self, layer: QuantizableLayer, token_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        scale = layer.get_buffer("weight_scale")
        codes = F.embedding(token_ids, layer.weight).view(self.weight_dtype)
        return codes.to(dtype) * scale[token_ids, None].to(dtype)
