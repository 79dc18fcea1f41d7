"""Linear layers: a oneDNN fast path on CPU, and packing of several projections into one."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# Batch size oneDNN tunes a packed weight for; measured flat from 16 to 2048 rows.
_PACK_BATCH_HINT = 64


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's packed-weight linear (x86 builds do)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
            torch.ops.mkldnn, "_reorder_linear_weight"
        )
    except RuntimeError:
        return False


class Linear(nn.Linear):
    """``nn.Linear`` that can run from a oneDNN-packed copy of its weight on CPU.

    torch's CPU matmul goes through MKL, which on AMD processors takes a generic code path:
    measured on a 2-core Zen 5, float32 GEMMs of this model's shapes ran at 110-200
    GFLOP/s through MKL and 390-470 through oneDNN with a packed weight.
    """

    packed_weight: torch.Tensor | None = None

    def prepack(self, keep_dense_weight: bool) -> None:
        """Pack the weight for oneDNN; drop the dense copy unless another module shares it."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            self.weight.detach(), _PACK_BATCH_HINT
        )
        if not keep_dense_weight:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)


def prepack_for_cpu(model: nn.Module) -> None:
    """Switch every `Linear` of a CPU model to oneDNN, when this torch build has it."""
    if not onednn_linear_available():
        return
    uses = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack(keep_dense_weight=uses[id(module.weight)] > 1)


class PackedLinear(Linear):
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
