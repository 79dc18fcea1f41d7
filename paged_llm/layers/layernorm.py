"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

import csrc_cpu
from paged_llm.layers.kernels import ElementwiseKernels, triton_kernels


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        kernels: ElementwiseKernels = ElementwiseKernels.TORCH,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``.

        With Triton or CPU kernels (the platform's choice) this is one kernel, which updates
        ``x`` and ``residual`` in place. The CPU kernel takes rows ``[T, hidden]``; the
        per-head norms of Qwen3 (``[T, H, D]`` views) stay on torch.
        """
        if self.kernels is ElementwiseKernels.CPU and x.dim() == 2:
            if residual is not None:
                return csrc_cpu.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return csrc_cpu.rms_norm(x, self.weight, self.eps)
        if self.kernels is ElementwiseKernels.TRITON:
            kernels = triton_kernels()
            if residual is not None:
                normed_and_sum: tuple[torch.Tensor, torch.Tensor] = kernels.fused_add_rms_norm(
                    x, residual, self.weight, self.eps
                )
                return normed_and_sum
            normed: torch.Tensor = kernels.rms_norm(
                x.reshape(-1, x.shape[-1]), self.weight, self.eps
            )
            return normed.view(x.shape)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same operation order as transformers' LlamaRMSNorm: float32 math, cast, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
