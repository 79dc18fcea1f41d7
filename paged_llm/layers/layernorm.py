"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.layers.kernels import triton_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = use_triton

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``.

        With ``use_triton`` (the platform's choice) this is one Triton kernel, which updates
        ``residual`` in place.
        """
        if self.use_triton:
            kernels = triton_kernels()
            if residual is not None:
                return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same operation order as transformers' LlamaRMSNorm: float32 math, cast, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
