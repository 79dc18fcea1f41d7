"""What a model is built with besides its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paged_llm.distributed.group import TensorParallelGroup


@dataclass(frozen=True)
class ModelContext:
    """The device, the longest position, the platform's kernel choice and this rank's
    place in the tensor-parallel group."""

    device: torch.device
    max_position: int
    # The platform's choice: Triton kernels for RMSNorm, rotary and SiLU-and-mul.
    triton_elementwise: bool = False
    tp: TensorParallelGroup = field(default_factory=TensorParallelGroup)
