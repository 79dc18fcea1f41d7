"""The attention layer of a model, and the choice of backend."""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.layers.attention.base import AttentionBackend, AttentionMetadata
from paged_llm.layers.attention.cpu_backend import CpuAttentionBackend
from paged_llm.layers.attention.torch_backend import TorchAttentionBackend
from paged_llm.layers.attention.triton_backend import TritonAttentionBackend

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "cpu": CpuAttentionBackend,
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,
}


def get_attention_backend(name: str) -> AttentionBackend:
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"Unknown attention backend {name!r}; choose one of {sorted(ATTENTION_BACKENDS)}."
        ) from None


class Attention(nn.Module):
    """The attention operation of one layer; the model runner binds its cache tensors."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend: AttentionBackend = TorchAttentionBackend()
        self.key_cache = torch.empty(0)
        self.value_cache = torch.empty(0)
        # The cache holds K / k_scale and V / v_scale. 1.0, vLLM's default without
        # calibrated scales: fp8 keeps a relative precision, and this family's keys and
        # values (|K| <= 21, |V| <= 16 in SmolLM2) sit far inside e4m3's range of 448;
        # scales computed from the data measured no better (docs/quantization.md).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.backend.forward(
            query,
            key,
            value,
            self.key_cache,
            self.value_cache,
            metadata,
            self.scale,
            self.sliding_window,
            self.k_scale,
            self.v_scale,
        )
