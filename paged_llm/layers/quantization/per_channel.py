"""Weight-only int8 or fp8 with one scale per output channel, made at load time from float
weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.layers.kernels import triton_kernels
from paged_llm.layers.quantization import cpu_matmul
from paged_llm.layers.quantization.base import (
    QuantizableLayer,
    QuantizedLinearMethod,
    drop_piece,
    keep_piece,
)
from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight
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

    On CUDA activations stay in the model's dtype and the matmul is csrc_triton's
    `weight_only_matmul`, which dequantizes in the GEMM's inner loop, for both dtypes. On
    CPU only int8 runs (the platform refuses fp8 at start-up), through `cpu_matmul`'s W8A8
    routes. An embedding looks up rows of codes and multiplies each by its scale.
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
        if layer.quantized_pieces:
            self._unpack(layer)
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

    def process_weights_after_loading(self, layer: QuantizableLayer) -> None:
        # On CPU the codes move into the kernel's packed layout, the dense copy dropped.
        # NOTE: a tied LM head shares the embedding's weight and pieces: packed once.
        if self.triton or cpu_matmul.kernel_isa() is None or layer.quantized_pieces:
            return
        keep_piece(layer, 0, cpu_matmul.pack(self._group_quantized(layer), layer.input_split_width))
        # NOTE: `.data`, not new tensors: a tied LM head holds these same tensor objects.
        layer.weight.data = layer.weight.data.new_empty(0)
        scale = layer.get_buffer("weight_scale")
        scale.data = scale.data.new_empty(0)

    def _group_quantized(self, layer: QuantizableLayer) -> GroupQuantizedWeight:
        """The dense codes as a group-quantized weight of one group a row."""
        codes, scale = self.codes(layer), layer.get_buffer("weight_scale")
        return GroupQuantizedWeight(codes, scale.float()[:, None], None, 8, codes.shape[1])

    def _unpack(self, layer: QuantizableLayer) -> None:
        """Bring back the dense codes and scales packing dropped (exact: the packed scales
        are float32 copies of them), for new weights to fill."""
        piece = layer.quantized_pieces[0]
        assert isinstance(piece, cpu_matmul.CpuPackedWeight)
        rows = torch.arange(piece.shape[0])
        layer.weight.data = piece.codes_of(rows).contiguous().view(self.storage_dtype)
        scale = layer.get_buffer("weight_scale")
        scale.data = piece.row_values(rows, piece.scale)[:, 0].to(scale.dtype)
        drop_piece(layer, 0)

    def apply(
        self, layer: QuantizableLayer, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.triton:
            qweight, scale = self.codes(layer), layer.get_buffer("weight_scale")
            out: torch.Tensor = triton_kernels().weight_only_matmul(x, qweight, scale)
        else:
            weight = layer.quantized_pieces.get(0) or self._group_quantized(layer)
            out = cpu_matmul.matmul(x, weight, layer.input_split_width)
        return out if bias is None else out.add_(bias)

    def embedding(
        self, layer: QuantizableLayer, token_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        packed = layer.quantized_pieces.get(0)
        if isinstance(packed, cpu_matmul.CpuPackedWeight):
            return packed.dequantize_rows(token_ids, dtype)
        scale = layer.get_buffer("weight_scale")
        codes = F.embedding(token_ids, layer.weight).view(self.weight_dtype)
        return codes.to(dtype) * scale[token_ids, None].to(dtype)
