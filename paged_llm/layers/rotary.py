"""Rotary position embedding (NeoX / Hugging Face "rotate_half" layout)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import csrc_cpu
from paged_llm.layers.kernels import ElementwiseKernels, triton_kernels

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config, from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    # Same expression (and float32 rounding) as transformers, so positions rotate identically.
    base = params["rope_theta"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
    inv_freq: torch.Tensor = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
    )


def compute_cos_sin_cache(
    head_dim: int, max_position: int, params: dict[str, Any], device: torch.device | str
) -> torch.Tensor:
    """``[max_position, head_dim]`` float32: cos of the angles, then sin.

    Computed on the CPU explicitly, so it is real even while the model is built on meta.
    """
    inv_freq = _inverse_frequencies(head_dim, params)
    positions = torch.arange(max_position, dtype=torch.float, device="cpu")
    freqs = positions[:, None] * inv_freq[None, :]
    # NOTE: cos and sin written into the table's halves, not concatenated: the peak is then
    # 1.5 tables, not 2.5 (it is max_position rows: 512 MiB at a million positions of 128).
    table = torch.empty(max_position, head_dim, dtype=torch.float, device="cpu")
    torch.cos(freqs, out=table[:, : head_dim // 2])
    torch.sin(freqs, out=table[:, head_dim // 2 :])
    return table.to(device)


@dataclass(frozen=True, slots=True)
class StepRotation:
    """One forward pass's rotation, looked up once and shared by every layer.

    ``cos``/``sin`` are in the activations' dtype: ``[T, 1, head_dim / 2]`` for torch's
    operators, ``[T, head_dim / 2]`` for csrc_cpu's kernel, and None with Triton kernels,
    which read the table at ``positions`` themselves.
    """

    positions: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their token's position.

    The cos/sin table is a plain attribute rather than a buffer: models are built on the
    meta device and materialized empty, and a buffer would lose its values there. It is
    computed on first use, not when the model is built: its ``max_position`` rows are only
    known to fit once the engine has checked that its KV cache can hold that many tokens.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        device: torch.device | str,
        kernels: ElementwiseKernels = ElementwiseKernels.TORCH,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.params = params
        self.device = device
        self.kernels = kernels

    @functools.cached_property
    def cos_sin_cache(self) -> torch.Tensor:
        """``[max_position, head_dim]`` float32 on the model's device (`compute_cos_sin_cache`)."""
        return compute_cos_sin_cache(self.head_dim, self.max_position, self.params, self.device)

    def step_rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotation:
        """The rotation of a forward pass over tokens at ``positions``, activations in ``dtype``."""
        if self.kernels is ElementwiseKernels.TRITON:
            return StepRotation(positions, None, None)
        # transformers rounds cos/sin to the activations' dtype and rotates in it.
        cos, sin = self.cos_sin_cache[positions].to(dtype).chunk(2, dim=-1)
        if self.kernels is ElementwiseKernels.CPU:
            return StepRotation(positions, cos, sin)
        return StepRotation(positions, cos.unsqueeze(1), sin.unsqueeze(1))

    def forward(
        self, rotation: StepRotation, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query ``[T, H, D]``, key ``[T, Hkv, D]``; returns the rotated pair.

        With Triton or CPU kernels one of them rotates both in place, through whatever views
        they are.
        """
        if rotation.cos is None or rotation.sin is None:
            triton_kernels().apply_rotary(query, key, rotation.positions, self.cos_sin_cache)
            return query, key
        if self.kernels is ElementwiseKernels.CPU:
            csrc_cpu.rotary_embedding(query, key, rotation.cos, rotation.sin)
            return query, key
        return _rotate(query, rotation.cos, rotation.sin), _rotate(key, rotation.cos, rotation.sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[x1 cos - x2 sin, x2 cos + x1 sin]``, each product rounded as transformers rounds
    it, with two temporaries instead of six."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).sub_(x2 * sin)
    torch.mul(x2, cos, out=out2).add_(x1 * sin)
    return out
