"""Pre-quantized Hugging Face checkpoints: a checkpoint whose config.json carries a
``quantization_config`` (compressed-tensors, GPTQ, AWQ) and whose decoder projections are
stored as packed integer codes with group scales and zero points.

Each format is a `PreQuantizedCheckpoint` that says which checkpoint tensors are the
quantized form of a projection and unpacks them, once at load time, into a
`GroupQuantizedWeight` (``W = scale * (code - zero)`` is ``code * scale + offset`` with
``offset = -scale * zero``); `GroupQuantizedLinearMethod` then keeps and multiplies by it,
so the CPU path, the tensor-parallel sharding of codes, scales and offsets, and the
memory accounting are the ones GGUF files use. The formats are read from their
specifications with torch alone: inference needs none of the libraries that write them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight

# transformers' names of every linear module of the architectures paged_llm runs: the
# decoder projections, which a pre-quantized checkpoint may store quantized, and the LM
# head, which stays float here.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LM_HEAD = "lm_head"
LINEAR_MODULES = (*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS, LM_HEAD)


def decoder_projections(hf_config: Any) -> list[str]:
    """The module names of every decoder projection of a model, in transformers' naming."""
    return [
        f"model.layers.{i}.{block}.{projection}"
        for i in range(hf_config.num_hidden_layers)
        for block, projections in (("self_attn", ATTENTION_PROJECTIONS), ("mlp", MLP_PROJECTIONS))
        for projection in projections
    ]


class PreQuantizedCheckpoint(ABC):
    """One pre-quantized checkpoint's format, built from its ``quantization_config``;
    refuses, at construction, what it cannot load, with what it supports."""

    @abstractmethod
    def quantized_module(self, tensor_name: str) -> str | None:
        """The projection (module name) a checkpoint tensor is part of the quantized form
        of; None for a tensor loaded as a float weight."""

    @abstractmethod
    def unpack(self, module: str, tensors: dict[str, torch.Tensor]) -> GroupQuantizedWeight:
        """The weight ``[out, in]`` of ``module`` from its quantized tensors, by the last
        component of their names; a ValueError if one is missing or malformed."""


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The unsigned ``bits``-bit values packed ``32 // bits`` to an int32 along ``dim``:
    value ``j`` of each word in bits ``[bits * order[j], bits * (order[j] + 1))`` (``order``
    None: in bits ``[bits * j, ...)``, low bits first). Returns int32, ``dim`` widened."""
    per_word = 32 // bits
    positions = torch.arange(per_word) if order is None else torch.tensor(order)
    shifts = (positions * bits).to(torch.int32)
    moved = packed.to(torch.int32).movedim(dim, -1)
    # NOTE: an arithmetic shift of a negative word fills with ones; the mask drops them.
    values = (moved[..., None] >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2).movedim(-1, dim)


def require(tensors: dict[str, torch.Tensor], module: str, part: str) -> torch.Tensor:
    if part not in tensors:
        raise ValueError(
            f"Pre-quantized checkpoint: {module} lacks its {part!r} tensor (it has "
            f"{sorted(tensors)})."
        )
    return tensors[part]


def refuse(method: str, what: str, supported: str) -> ValueError:
    return ValueError(
        f"This {method} checkpoint uses {what}, which paged_llm cannot load; it loads {supported}."
    )


class PackedProjectionsCheckpoint(PreQuantizedCheckpoint):
    """The GPTQ / AWQ layout: every decoder projection stored as ``qweight``, ``qzeros``
    and ``scales`` (and GPTQ's ``g_idx``), each ``[.., out]`` with the input dim first;
    the LM head stays float."""

    PARTS = ("qweight", "qzeros", "scales", "g_idx")
    PROJECTIONS = (*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS)

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits = bits
        # -1 (per output channel) stays -1: the number of groups is then 1.
        self.group_size = group_size

    def quantized_module(self, tensor_name: str) -> str | None:
        module, _, part = tensor_name.rpartition(".")
        is_projection = module.rpartition(".")[2] in self.PROJECTIONS
        return module if is_projection and part in self.PARTS else None

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def check_shapes(
        self, module: str, tensors: dict[str, torch.Tensor], in_features: int, out_features: int
    ) -> None:
        """The scales, and the zeros packed along the output dim, fit the weight."""
        groups = self.num_groups(in_features)
        expected = {
            "scales": (groups, out_features),
            "qzeros": (groups, out_features * self.bits // 32),
        }
        for part, shape in expected.items():
            actual = tuple(require(tensors, module, part).shape)
            if actual != shape:
                raise ValueError(
                    f"Pre-quantized checkpoint: {module}.{part} has shape {actual}; a "
                    f"[{out_features}, {in_features}] weight of {self.bits} bits with "
                    f"group_size={self.group_size} needs {shape}."
                )
