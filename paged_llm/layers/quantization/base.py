"""The seam between a `Linear` layer and the format its weight is kept in."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from paged_llm.layers.linear import Linear


class QuantizedLinearMethod(ABC):
    """How a `Linear` keeps a quantized weight and multiplies by it (vLLM's
    ``LinearMethodBase``): one object per format, shared by every layer it quantizes.

    The layer is built and loaded as a float layer (the loader fills ``layer.weight``,
    tensor-parallel sharding included); `process_weights_after_loading` then replaces the
    float weight by the format's tensors, and `apply` multiplies by them.
    """

    @abstractmethod
    def process_weights_after_loading(self, layer: Linear) -> None:
        """Quantize ``layer.weight`` (this rank's shard) into the layer's own tensors and
        drop the float copy."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for the layer's quantized ``W``, in the dtype of ``x``."""
