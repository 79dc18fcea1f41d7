"""Quantized weight formats, by vLLM's ``quantization`` names.

Each format is a `QuantizedLinearMethod`; `get_quantized_linear_method` builds the one a
setting names, for a platform that does or does not run Triton matmuls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_llm.layers.quantization.base import QuantizedLinearMethod
from paged_llm.layers.quantization.checkpoint_formats import PRE_QUANTIZED_FORMATS
from paged_llm.layers.quantization.grouped import GroupQuantizedLinearMethod
from paged_llm.layers.quantization.per_channel import PerChannelLinearMethod

# name -> the method, built with whether its matmuls run through Triton.
QUANTIZATION_METHODS: dict[str, Callable[[bool], QuantizedLinearMethod]] = {
    "int8": lambda triton: PerChannelLinearMethod(torch.int8, triton),
    # CUDA only: EngineConfig refuses it where linear layers do not run Triton.
    "fp8": lambda triton: PerChannelLinearMethod(torch.float8_e4m3fn, triton),
    "gguf": GroupQuantizedLinearMethod,
    # Pre-quantized checkpoints, unpacked into the same group-quantized layout.
    **dict.fromkeys(PRE_QUANTIZED_FORMATS, GroupQuantizedLinearMethod),
}


def get_quantized_linear_method(name: str | None, triton: bool) -> QuantizedLinearMethod | None:
    """The method of ``quantization=name`` (None: the checkpoint's float weights)."""
    return None if name is None else QUANTIZATION_METHODS[name](triton)


__all__ = ["QUANTIZATION_METHODS", "QuantizedLinearMethod", "get_quantized_linear_method"]
