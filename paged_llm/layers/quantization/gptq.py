"""GPTQ checkpoints (``quant_method: "gptq"``, AutoGPTQ / GPTQModel / optimum's layout).

- ``qweight`` int32 ``[in * bits / 32, out]``: ``32 / bits`` consecutive input features
  per word, low bits first;
- ``qzeros`` int32 ``[groups, out * bits / 32]``: the zero points, packed the same way
  along the output dim; the original (v1, ``checkpoint_format: "gptq"``) convention
  stores ``zero - 1``, ``"gptq_v2"`` the zero itself (as vLLM and GPTQModel read them);
- ``scales`` float16 ``[groups, out]``; ``g_idx`` int32 ``[in]``: each input feature's
  group, ``k // group_size`` unless the checkpoint was made with ``desc_act``, whose groups
  follow a permutation of the features (kept as the weight's ``group_index``).

``W[n, k] = scales[g, n] * (q[k, n] - zero[g, n])`` with ``g = g_idx[k]``; groups of
``group_size`` input features, one per column for ``group_size: -1``.
"""

from __future__ import annotations

from typing import Any

import torch

from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight
from paged_llm.layers.quantization.prequantized import (
    PackedProjectionsCheckpoint,
    refuse,
    require,
    unpack_int32,
)

_SUPPORTED = (
    "4- or 8-bit weights with a group_size (or -1, per channel), with or without desc_act "
    "(act-order, through g_idx), in the "
    "'gptq' or 'gptq_v2' checkpoint format, with every decoder projection quantized and "
    "the LM head float"
)


class GptqCheckpoint(PackedProjectionsCheckpoint):
    def __init__(self, config: dict[str, Any], hf_config: Any) -> None:
        bits, group_size = config.get("bits"), config.get("group_size", -1)
        if bits not in (4, 8):
            raise refuse("gptq", f"{bits}-bit weights", _SUPPORTED)
        if not (group_size == -1 or (isinstance(group_size, int) and group_size > 0)):
            raise refuse("gptq", f"group_size={group_size!r}", _SUPPORTED)
        checkpoint_format = config.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise refuse("gptq", f"checkpoint_format={checkpoint_format!r}", _SUPPORTED)
        if config.get("lm_head") or config.get("modules_in_block_to_quantize"):
            raise refuse("gptq", "a quantized LM head or a subset of the projections", _SUPPORTED)
        super().__init__(bits, group_size)
        self.stores_zero_minus_one = checkpoint_format == "gptq"

    def unpack(self, module: str, tensors: dict[str, torch.Tensor]) -> GroupQuantizedWeight:
        codes = unpack_int32(require(tensors, module, "qweight"), self.bits, dim=0).T
        out_features, in_features = codes.shape
        self.check_shapes(module, tensors, in_features, out_features)
        zero = unpack_int32(require(tensors, module, "qzeros"), self.bits, dim=1).T
        if self.stores_zero_minus_one:
            zero = zero + 1
        groups = self.num_groups(in_features)
        scale = require(tensors, module, "scales").T
        group_index = None
        if "g_idx" in tensors:
            g_idx = tensors["g_idx"].to(torch.int64)
            if tuple(g_idx.shape) != (in_features,) or not bool(
                ((g_idx >= 0) & (g_idx < groups)).all()
            ):
                raise ValueError(
                    f"GPTQ checkpoint: {module}.g_idx must give each of the {in_features} "
                    f"input features a group in [0, {groups})."
                )
            # desc_act's groups follow a permutation of the features; in order, the
            # contiguous layout needs no index.
            if not torch.equal(g_idx, torch.arange(in_features) // (in_features // groups)):
                group_index = g_idx
        zero = zero.to(torch.float32)
        return GroupQuantizedWeight.from_codes(codes, scale, zero, self.bits, group_index)
