"""Linear layers that pack several checkpoint matrices into one matmul."""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """One matmul for several projections of the same input (q/k/v, or gate/up).

    The checkpoint stores each projection separately; `load_shard` copies one of them
    into its rows of the packed weight.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start, size = self.offsets[shard], self.output_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(
                f"checkpoint shard {shard} has {loaded.shape[0]} rows, the model expects {size}"
            )
        param.data[start : start + size].copy_(loaded)
