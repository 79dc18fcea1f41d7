"""What a model is built with besides its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.layers.kernels import ElementwiseKernels
from paged_llm.layers.quantization import QuantizedLinearMethod


@dataclass(frozen=True)
class ModelContext:
    """The device and dtype, the longest position, the platform's kernel choice, this
    rank's place in the tensor-parallel group, and the formats of the weights."""

    device: torch.device
    max_position: int
    dtype: torch.dtype = torch.float32
    # The platform's choice of kernels for RMSNorm, rotary and SiLU-and-mul, as usable here.
    elementwise: ElementwiseKernels = ElementwiseKernels.TORCH
    tp: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    # The decoder layers' linear weights; None: float.
    quant_method: QuantizedLinearMethod | None = None
    # The embedding's and an untied LM head's (a tied one shares the embedding's); None:
    # float. Only a method that `quantizes_embeddings`.
    embedding_quant_method: QuantizedLinearMethod | None = None
    lm_head_quant_method: QuantizedLinearMethod | None = None
    # False: a pooling model, whose output is its hidden states (or a classifier head's):
    # it is built without the LM head, and a checkpoint's LM head is left unread.
    lm_head: bool = True
