"""Group-quantized weights (`GroupQuantizedWeight`) kept packed and dequantized on the fly
in the matmul."""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.layers.kernels import triton_kernels
from paged_llm.layers.quantization import cpu_matmul
from paged_llm.layers.quantization.base import (
    QuantizableLayer,
    QuantizedLinearMethod,
    drop_piece,
    keep_piece,
)
from paged_llm.layers.quantization.cpu_matmul import CpuPackedWeight
from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight
from paged_llm.layers.weights import CheckpointPart, CheckpointTensor


class GroupQuantizedTensor(CheckpointTensor):
    """A checkpoint tensor held as a `GroupQuantizedWeight`; `read` returns this rank's
    rows or columns of it, still quantized."""

    def __init__(self, name: str, weight: GroupQuantizedWeight) -> None:
        self.name = name
        self.weight = weight
        self.shape = weight.shape

    def read_quantized(
        self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> GroupQuantizedWeight:
        weight = self.weight if rows is None else self.weight.rows(*rows)
        return weight if cols is None else weight.cols(*cols)


class GroupQuantizedLinearMethod(QuantizedLinearMethod):
    """A layer whose checkpoint tensors (one per packed projection) arrive group-quantized,
    each in its own bit width and group size (a GGUF file mixes types in one layer). On
    CUDA each projection multiplies through csrc_triton's group-quantized kernel, which
    dequantizes in the GEMM's inner loop (GPTQ act-order's per-feature groups, which it does
    not read, take torch's dequantization); on CPU through `cpu_matmul`'s W8A8 routes. An
    embedding dequantizes the rows it looks up.
    """

    quantizes_embeddings = True
    quantizes_at_load = False

    def __init__(self, triton: bool) -> None:
        self.triton = triton

    def create_weights(self, layer: QuantizableLayer) -> None:
        # An empty placeholder: the weight arrives as pieces, through `load_quantized`.
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def load_weight(
        self, layer: QuantizableLayer, loaded: CheckpointTensor, part: CheckpointPart
    ) -> None:
        """The float copy of a weight that arrives quantized is not read."""

    def load_quantized(
        self, layer: QuantizableLayer, loaded: GroupQuantizedTensor, shard: int | None
    ) -> None:
        """Keep this rank's part of one checkpoint tensor as piece ``shard`` of the layer."""
        part = layer.checkpoint_part(loaded, shard)
        piece = loaded.read_quantized(part.rows, part.cols).to(layer.weight.device)
        keep_piece(layer, shard or 0, piece)

    def process_weights_after_loading(self, layer: QuantizableLayer) -> None:
        pieces = layer.quantized_pieces
        expected = layer.num_checkpoint_shards or 1
        if sorted(pieces) != list(range(expected)):
            raise ValueError(
                f"A layer of {expected} projection(s) got quantized weights for "
                f"{len(pieces)}; with a quantized checkpoint (a GGUF file, "
                "or a pre-quantized Hugging Face one) every decoder projection must be stored "
                "quantized."
            )
        # NOTE: sorted in place: a tied LM head holds the embedding's same dict.
        ordered = sorted(pieces.items())
        pieces.clear()
        pieces.update(ordered)
        if not self.triton and cpu_matmul.kernel_isa() is not None:
            self._pack_for_cpu(layer)

    def _pack_for_cpu(self, layer: QuantizableLayer) -> None:
        """Repack the pieces for csrc_cpu's kernel, consecutive ones of one layout joined
        into one (measured: a GGUF SmolLM2 decode step made 211 matmul calls, 7 a layer,
        which were 78% of its time at one sequence)."""
        packed: list[GroupQuantizedWeight | CpuPackedWeight] = []
        for piece in layer.quantized_pieces.values():
            if isinstance(piece, GroupQuantizedWeight) and cpu_matmul.packable(piece):
                piece = cpu_matmul.pack(piece, layer.input_split_width)
            previous = packed[-1] if packed else None
            joined = (
                cpu_matmul.concatenated(previous, piece)
                if isinstance(previous, CpuPackedWeight) and isinstance(piece, CpuPackedWeight)
                else None
            )
            if joined is None:
                packed.append(piece)
            else:
                packed[-1] = joined
        # NOTE: in place: a tied LM head holds the embedding's same dict (and finds its
        # one piece packed already).
        for shard in list(layer.quantized_pieces):
            drop_piece(layer, shard)
        for shard, piece in enumerate(packed):
            keep_piece(layer, shard, piece)

    def apply(
        self, layer: QuantizableLayer, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        outputs = [self._multiply(layer, x, piece) for piece in layer.quantized_pieces.values()]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return out if bias is None else out.add_(bias)

    def _multiply(
        self,
        layer: QuantizableLayer,
        x: torch.Tensor,
        piece: GroupQuantizedWeight | CpuPackedWeight,
    ) -> torch.Tensor:
        if self.triton and isinstance(piece, GroupQuantizedWeight) and piece.group_index is None:
            out: torch.Tensor = triton_kernels().group_quantized_matmul(
                x, piece.codes, piece.scale, piece.offset, piece.group_size
            )
            return out
        return cpu_matmul.matmul(x, piece, layer.input_split_width)

    def embedding(
        self, layer: QuantizableLayer, token_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        (table,) = layer.quantized_pieces.values()
        if isinstance(table, CpuPackedWeight):
            return table.dequantize_rows(token_ids, dtype)
        return table.take(token_ids).dequantize(dtype)
