"""What a model is built with besides its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.layers.quantization import QuantizedLinearMethod


@dataclass(frozen=True)
class ModelContext:
    """The device, the longest position, the platform's kernel choice, this rank's place
    in the tensor-parallel group, and the format of the decoder layers' linear weights."""

    device: torch.device
    max_position: int
    # The platform's choice: Triton kernels for RMSNorm, rotary and SiLU-and-mul.
    triton_elementwise: bool = False
    tp: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    # None: float weights. The embedding and the LM head always stay float (as vLLM's).
    quant_method: QuantizedLinearMethod | None = None
