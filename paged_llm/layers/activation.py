"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.layers.kernels import triton_kernels


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input ``[T, 2 * I]`` holding ``[gate | up]``.

    With ``use_triton`` (the platform's choice) this is one Triton kernel: one read of the
    input, one write of the output.
    """

    def __init__(self, use_triton: bool = False) -> None:
        super().__init__()
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            return triton_kernels().silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        # In place on silu's fresh output: one large temporary instead of two (measured
        # 14.6 -> 9.1 ms with the down projection, 2048 tokens of SmolLM2 on CPU).
        return F.silu(gate).mul_(up)
