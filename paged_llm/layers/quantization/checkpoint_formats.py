"""The pre-quantized checkpoint formats by their config.json ``quant_method``, and how a
model's ``quantization`` setting is resolved against its checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_llm.layers.quantization.awq import AwqCheckpoint
from paged_llm.layers.quantization.compressed_tensors import CompressedTensorsCheckpoint
from paged_llm.layers.quantization.gptq import GptqCheckpoint
from paged_llm.layers.quantization.prequantized import PreQuantizedCheckpoint

# quant_method -> the format, from the quantization_config and the model's config.
PRE_QUANTIZED_FORMATS: dict[str, Callable[[dict[str, Any], Any], PreQuantizedCheckpoint]] = {
    "compressed-tensors": CompressedTensorsCheckpoint,
    "gptq": GptqCheckpoint,
    "awq": AwqCheckpoint,
}


def resolve_quantization(requested: str | None, hf_config: Any) -> str | None:
    """The quantization a model runs with: ``requested`` ("dequantize": None, float), or
    the ``quant_method`` its config.json's ``quantization_config`` declares (as vLLM: None,
    or the same name, picks it up). A ValueError for a conflict, an unknown method, or what
    the format refuses."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        if requested in PRE_QUANTIZED_FORMATS:
            raise ValueError(
                f"LLM argument quantization={requested!r} loads a pre-quantized checkpoint, "
                "and this model's config.json has no quantization_config."
            )
        return None if requested == "dequantize" else requested
    config = config if isinstance(config, dict) else config.to_dict()
    method: str | None = config.get("quant_method")
    if method not in PRE_QUANTIZED_FORMATS:
        raise ValueError(
            f"This checkpoint is quantized with quant_method={method!r}; paged_llm loads "
            f"pre-quantized checkpoints of {', '.join(map(repr, PRE_QUANTIZED_FORMATS))}."
        )
    if requested not in (None, method):
        raise ValueError(
            f"LLM argument quantization={requested!r} conflicts with the checkpoint, which is "
            f"quantized with quant_method={method!r}; pass quantization=None or {method!r}."
        )
    PRE_QUANTIZED_FORMATS[method](config, hf_config)
    return method


def pre_quantized_checkpoint(
    quantization: str | None, hf_config: Any
) -> PreQuantizedCheckpoint | None:
    """The format of a checkpoint `resolve_quantization` accepted; None for other models."""
    if quantization not in PRE_QUANTIZED_FORMATS:
        return None
    config = hf_config.quantization_config
    config = config if isinstance(config, dict) else config.to_dict()
    return PRE_QUANTIZED_FORMATS[quantization](config, hf_config)
