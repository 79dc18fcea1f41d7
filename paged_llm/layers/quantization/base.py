"""The seam between a `Linear` layer and the format its weight is kept in."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar, Protocol

import torch

from paged_llm.layers.quantization.cpu_matmul import CpuPackedWeight
from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight
from paged_llm.layers.weights import CheckpointPart, CheckpointTensor


class QuantizableLayer(Protocol):
    """What a `QuantizedLinearMethod` sees of the layer it quantizes (a `Linear`): its
    shape, its ``weight``, its buffers, and how its checkpoint tensors map onto it.

    NOTE: declared here rather than imported from layers.linear, which imports this
    package: quantization stays below the layers that use it.
    """

    in_features: int
    out_features: int
    # The float weight, or whatever the method's `create_weights` put in its place.
    weight: torch.Tensor
    # Quantized weights by checkpoint shard: a `GroupQuantizedLinearMethod`'s, and on CPU
    # any method's in the kernel's packed layout.
    quantized_pieces: dict[int, GroupQuantizedWeight | CpuPackedWeight]

    @property
    def input_split_width(self) -> int | None:
        """None where it holds its whole input; for a row-parallel projection, the width
        its input features are split over the ranks at multiples of, at any number of
        ranks: on CPU its activations are then rounded in blocks that divide it, which
        every split keeps whole, so that each rank rounds as a single rank would."""

    @property
    def num_checkpoint_shards(self) -> int | None:
        """How many checkpoint tensors fill the weight; None: one, under the layer's name."""

    def checkpoint_part(self, loaded: CheckpointTensor, shard: int | None) -> CheckpointPart:
        """What this rank keeps of checkpoint weight ``loaded``."""

    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None: ...

    def get_buffer(self, target: str) -> torch.Tensor: ...

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]: ...


def keep_piece(
    layer: QuantizableLayer, shard: int, piece: GroupQuantizedWeight | CpuPackedWeight
) -> None:
    """Make ``piece`` the layer's quantized weight for checkpoint shard ``shard``, its
    tensors buffers of the layer (so that what walks a model's tensors, `weight_memory`,
    counts them, and a piece it replaces is freed)."""
    drop_piece(layer, shard)
    layer.quantized_pieces[shard] = piece
    for i, tensor in enumerate(piece.tensors):
        layer.register_buffer(f"quantized_piece{shard}_{i}", tensor, persistent=False)


def drop_piece(layer: QuantizableLayer, shard: int) -> None:
    """Remove the layer's quantized weight for ``shard`` and its buffers, if any."""
    layer.quantized_pieces.pop(shard, None)
    prefix = f"quantized_piece{shard}_"
    for name, _ in list(layer.named_buffers(recurse=False)):
        if name.startswith(prefix):
            layer.register_buffer(name, None, persistent=False)


class QuantizedLinearMethod(ABC):
    """How a `Linear` keeps a quantized weight and multiplies by it (vLLM's
    ``LinearMethodBase``): one object per format, shared by every layer it quantizes.

    The layer calls `create_weights` when it is built (on the meta device, before any
    memory is allocated), so no float copy of a quantized weight is ever materialized; the
    loader hands each float checkpoint weight to `load_weight` with the part this rank
    keeps; `apply` multiplies.

    A format that also keeps a vocabulary's rows (the embedding's lookup table, the LM
    head) declares `quantizes_embeddings` and looks rows up with `embedding`.
    """

    quantizes_embeddings: ClassVar[bool] = False
    # Whether the format quantizes float checkpoint weights as it loads them (int8, fp8),
    # or only keeps tensors that arrive quantized (a GGUF file, a pre-quantized checkpoint).
    quantizes_at_load: ClassVar[bool] = True

    @abstractmethod
    def create_weights(self, layer: QuantizableLayer) -> None:
        """Replace the layer's float ``weight`` by the format's tensors."""

    @abstractmethod
    def load_weight(
        self, layer: QuantizableLayer, loaded: CheckpointTensor, part: CheckpointPart
    ) -> None:
        """Fill ``part.out_rows`` of the layer's weight from float checkpoint weight
        ``loaded``, of which this rank keeps ``part.rows`` and ``part.cols``."""

    def process_weights_after_loading(self, layer: QuantizableLayer) -> None:  # noqa: B027 - optional
        """Check or finish the layer's tensors once every checkpoint tensor is loaded."""

    @abstractmethod
    def apply(
        self, layer: QuantizableLayer, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for the layer's quantized ``W``, in the dtype of ``x``."""

    def embedding(
        self, layer: QuantizableLayer, token_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows ``token_ids`` of the layer's weight in ``dtype`` (vLLM's ``embedding``),
        dequantizing only those rows."""
        raise NotImplementedError(f"{type(self).__name__} does not quantize embeddings.")
