"""The seam between a `Linear` layer and the format its weight is kept in."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from paged_llm.layers.linear import CheckpointPart, Linear
    from paged_llm.layers.weights import CheckpointTensor


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
    def create_weights(self, layer: Linear) -> None:
        """Replace the layer's float ``weight`` by the format's tensors."""

    @abstractmethod
    def load_weight(self, layer: Linear, loaded: CheckpointTensor, part: CheckpointPart) -> None:
        """Fill ``part.out_rows`` of the layer's weight from float checkpoint weight
        ``loaded``, of which this rank keeps ``part.rows`` and ``part.cols``."""

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 - optional
        """Check or finish the layer's tensors once every checkpoint tensor is loaded."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for the layer's quantized ``W``, in the dtype of ``x``."""

    def embedding(self, layer: Linear, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``token_ids`` of the layer's weight in ``dtype`` (vLLM's ``embedding``),
        dequantizing only those rows."""
        raise NotImplementedError(f"{type(self).__name__} does not quantize embeddings.")
