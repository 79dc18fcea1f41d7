"""AWQ checkpoints (``quant_method: "awq"``, AutoAWQ's ``version: "gemm"`` layout).

- ``qweight`` int32 ``[in, out / 8]``: eight 4-bit codes of consecutive output features
  per word, interleaved: value ``j`` of a word sits in nibble ``[0, 4, 1, 5, 2, 6, 3, 7][j]``
  (AutoAWQ's packer writes output ``8m + [0, 2, 4, 6, 1, 3, 5, 7][i]`` to nibble ``i``);
- ``qzeros`` int32 ``[groups, out / 8]``: the zero points, packed the same way;
- ``scales`` float16 ``[groups, out]``.

``W[n, k] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n])``.
"""

from __future__ import annotations

from typing import Any

import torch

from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight
from paged_llm.layers.quantization.prequantized import (
    PackedProjectionsCheckpoint,
    decoder_projections,
    refuse,
    require,
    unpack_int32,
)

# Nibble of each of a word's eight outputs.
AWQ_NIBBLE_OF_OUTPUT = (0, 4, 1, 5, 2, 6, 3, 7)
_SUPPORTED = (
    "4-bit weights with zero points and a group_size (or -1, per channel) in the 'gemm' "
    "layout, with every decoder projection quantized"
)


class AwqCheckpoint(PackedProjectionsCheckpoint):
    def __init__(self, config: dict[str, Any], hf_config: Any) -> None:
        bits = config.get("bits", config.get("w_bit"))
        group_size = config.get("group_size", config.get("q_group_size"))
        version = str(config.get("version", "gemm")).lower()
        if bits != 4:
            raise refuse("awq", f"{bits}-bit weights", _SUPPORTED)
        if not (group_size == -1 or (isinstance(group_size, int) and group_size > 0)):
            raise refuse("awq", f"group_size={group_size!r}", _SUPPORTED)
        if version != "gemm":
            raise refuse("awq", f"the {version!r} layout", _SUPPORTED)
        if not config.get("zero_point", True):
            raise refuse("awq", "zero_point=False", _SUPPORTED)
        skipped = config.get("modules_to_not_convert") or []
        float_projections = [
            m for m in decoder_projections(hf_config) if any(s in m for s in skipped)
        ]
        if float_projections:
            raise refuse(
                "awq", f"float decoder projections ({', '.join(float_projections[:3])})", _SUPPORTED
            )
        super().__init__(bits, group_size)

    def unpack(self, module: str, tensors: dict[str, torch.Tensor]) -> GroupQuantizedWeight:
        def outputs_unpacked(part: str) -> torch.Tensor:
            packed = require(tensors, module, part)
            return unpack_int32(packed, self.bits, dim=1, order=AWQ_NIBBLE_OF_OUTPUT).T

        codes = outputs_unpacked("qweight")
        out_features, in_features = codes.shape
        self.check_shapes(module, tensors, in_features, out_features)
        zero = outputs_unpacked("qzeros").to(torch.float32)
        scale = require(tensors, module, "scales").T
        return GroupQuantizedWeight.from_codes(codes, scale, zero, self.bits)
