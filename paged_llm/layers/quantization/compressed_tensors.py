"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, what
llm-compressor writes): weight-only int4 / int8 projections with per-channel or group
scales, symmetric or with zero points.

Read from the format's definition (the compressed-tensors library's compressors), not
through the library:

- ``pack-quantized``: ``weight_packed`` int32 ``[out, in * bits / 32]``, ``32 / bits``
  consecutive input features per word, low bits first, each stored as ``q + 2**(bits-1)``
  for the signed code ``q``; ``weight_shape`` ``[out, in]``; ``weight_scale`` ``[out,
  groups]``; asymmetric: ``weight_zero_point`` packed the same way along the output dim,
  ``[out * bits / 32, groups]``.
- ``naive-quantized`` / ``int-quantized``: ``weight`` int8 ``[out, in]`` holds ``q``;
  ``weight_scale``; asymmetric: ``weight_zero_point`` int8 ``[out, groups]``.

``W = scale * (q - zero_point)``, one group per row for the ``channel`` strategy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight
from paged_llm.layers.quantization.prequantized import (
    LINEAR_MODULES,
    LM_HEAD,
    PreQuantizedCheckpoint,
    decoder_projections,
    refuse,
    require,
    unpack_int32,
)

_METHOD = "compressed-tensors"
_PACKED = "pack-quantized"
_INT8_FORMATS = ("naive-quantized", "int-quantized")
_SUPPORTED = (
    "weight-only integer schemes (num_bits 4 or 8, type 'int', strategy 'channel' or "
    "'group', symmetric or with zero points, no activation quantization) in the "
    f"'{_PACKED}', 'naive-quantized' or 'int-quantized' formats, with the LM head in "
    "'ignore' and every decoder projection quantized"
)


@dataclass(frozen=True)
class _Scheme:
    """One config group's weight quantization, as far as the loader needs it."""

    bits: int
    symmetric: bool
    # None: one scale per output channel.
    group_size: int | None
    format: str

    @property
    def parts(self) -> tuple[str, ...]:
        """The names of the tensors that hold a projection in this format."""
        weight = ("weight_packed", "weight_shape") if self.format == _PACKED else ("weight",)
        return (*weight, "weight_scale", "weight_zero_point")


def _scheme(name: str, group: dict[str, Any], default_format: str | None) -> _Scheme:
    weights = group.get("weights")
    if weights is None:
        raise refuse(_METHOD, f"config group {name!r} without weight quantization", _SUPPORTED)
    for activations in ("input_activations", "output_activations"):
        if group.get(activations) is not None:
            raise refuse(_METHOD, f"{activations} quantization (config group {name!r})", _SUPPORTED)
    kind, bits = weights.get("type", "int"), weights.get("num_bits", 8)
    strategy = weights.get("strategy")
    if kind != "int":
        raise refuse(_METHOD, f"{kind} weights of {bits} bits (an fp8 or fp4 scheme)", _SUPPORTED)
    if bits not in (4, 8):
        raise refuse(_METHOD, f"{bits}-bit weights", _SUPPORTED)
    if strategy not in ("channel", "group"):
        raise refuse(_METHOD, f"the {strategy!r} weight strategy", _SUPPORTED)
    if weights.get("actorder") in ("group", "dynamic"):
        # NOTE: "weight" / "static" ordering only changes calibration, not the layout.
        raise refuse(_METHOD, "act-order (actorder='group', a g_idx permutation)", _SUPPORTED)
    if weights.get("dynamic") or weights.get("block_structure") is not None:
        raise refuse(_METHOD, "dynamic or block-wise weight scales", _SUPPORTED)
    compression = group.get("format") or default_format
    if compression not in (_PACKED, *_INT8_FORMATS):
        raise refuse(_METHOD, f"the {compression!r} format", _SUPPORTED)
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise refuse(_METHOD, f"group_size={group_size!r}", _SUPPORTED)
    return _Scheme(bits, bool(weights.get("symmetric", True)), group_size, compression)


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' matching of a module name: ``re:`` patterns match from the
    start, ``Linear`` (a class) matches every linear module, other targets are names."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    if target == "Linear":
        return module.rsplit(".", 1)[-1] in LINEAR_MODULES
    return target == module


class CompressedTensorsCheckpoint(PreQuantizedCheckpoint):
    """A compressed-tensors checkpoint's schemes, and the projections each applies to."""

    def __init__(self, config: dict[str, Any], hf_config: Any) -> None:
        if config.get("quantization_status", "compressed") != "compressed":
            raise refuse(
                _METHOD,
                f"quantization_status={config['quantization_status']!r} (not compressed)",
                _SUPPORTED,
            )
        if config.get("kv_cache_scheme") is not None:
            raise refuse(_METHOD, "a kv_cache_scheme (use LLM's kv_cache_dtype='fp8')", _SUPPORTED)
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise refuse(_METHOD, f"{sparsity['format']!r} sparsity (e.g. 2:4)", _SUPPORTED)
        if config.get("transform_config"):
            raise refuse(_METHOD, "transforms (transform_config)", _SUPPORTED)
        groups = config.get("config_groups") or {}
        self.groups = [
            (list(group.get("targets", [])), _scheme(name, group, config.get("format")))
            for name, group in groups.items()
        ]
        self.ignore: list[str] = list(config.get("ignore") or [])
        if self.scheme(LM_HEAD) is not None and not getattr(
            hf_config, "tie_word_embeddings", False
        ):
            raise refuse(_METHOD, "a quantized LM head (lm_head not in 'ignore')", _SUPPORTED)
        float_projections = [m for m in decoder_projections(hf_config) if self.scheme(m) is None]
        if float_projections:
            raise refuse(
                _METHOD,
                f"float decoder projections ({', '.join(float_projections[:3])}, ... left out "
                "by its targets / ignore)",
                _SUPPORTED,
            )

    def scheme(self, module: str) -> _Scheme | None:
        """The scheme of a module: that of the first config group that targets it, None
        for a module that no group targets or that 'ignore' lists."""
        if module.rsplit(".", 1)[-1] not in LINEAR_MODULES:
            return None
        if any(_matches(module, target) for target in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(module, target) for target in targets):
                return scheme
        return None

    def quantized_module(self, tensor_name: str) -> str | None:
        module, _, part = tensor_name.rpartition(".")
        scheme = self.scheme(module)
        return module if scheme is not None and part in scheme.parts else None

    def unpack(self, module: str, tensors: dict[str, torch.Tensor]) -> GroupQuantizedWeight:
        scheme = self.scheme(module)
        assert scheme is not None  # NOTE: only the tensors of quantized modules come here
        scale = require(tensors, module, "weight_scale")
        if scheme.format == _PACKED:
            out_features, in_features = require(tensors, module, "weight_shape").tolist()
            packed = require(tensors, module, "weight_packed")
            codes = unpack_int32(packed, scheme.bits, dim=1)[:, :in_features]
            # Codes and zero points are both stored shifted by 2**(bits - 1): subtract
            # them as stored (a symmetric scheme's zero point is 0, stored as the shift).
            if scheme.symmetric:
                zero = torch.full_like(scale, 1 << (scheme.bits - 1), dtype=torch.float32)
            else:
                packed_zero = require(tensors, module, "weight_zero_point")
                zero = unpack_int32(packed_zero, scheme.bits, dim=0)[:out_features].float()
            bits = scheme.bits
        else:
            weight = require(tensors, module, "weight")
            out_features, in_features = weight.shape
            # Signed int8 codes (of any num_bits up to 8), shifted to unsigned as packed ones.
            codes = weight.to(torch.int32) + 128
            zero = torch.full_like(scale, 128, dtype=torch.float32)
            if not scheme.symmetric:
                zero = zero + require(tensors, module, "weight_zero_point").to(torch.float32)
            bits = 8
        expected_groups = 1 if scheme.group_size is None else in_features // scheme.group_size
        if tuple(scale.shape) != (out_features, expected_groups) or zero.shape != scale.shape:
            raise ValueError(
                f"compressed-tensors checkpoint: {module}'s weight_scale has shape "
                f"{tuple(scale.shape)} (zero points {tuple(zero.shape)}); a [{out_features}, "
                f"{in_features}] weight with group_size={scheme.group_size} needs "
                f"({out_features}, {expected_groups})."
            )
        return GroupQuantizedWeight.from_codes(codes, scale, zero, bits)
