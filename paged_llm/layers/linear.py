"""Linear layers: a oneDNN fast path on CPU, projections packed into one matmul, their
tensor-parallel forms (column-parallel packs, row-parallel with one all-reduce), and
quantized weights through a `QuantizedLinearMethod`."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.layers.lora import LoRAShard, LoRASlots
from paged_llm.layers.quantization import QuantizedLinearMethod
from paged_llm.layers.quantization.cpu_matmul import CpuPackedWeight
from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight
from paged_llm.layers.weights import CheckpointPart, CheckpointTensor

# Batch size oneDNN tunes a packed weight for; measured flat from 16 to 2048 rows.
_PACK_BATCH_HINT = 64
# Where the processor has no bfloat16 GEMM (no AVX-512 BF16 / AMX / AVX-NE-CONVERT), torch
# multiplies bfloat16 through a generic loop: measured on a 2-core AVX2 EPYC, a 64-row
# matmul of SmolLM2's layers took 5-7x longer than converting the weight to float32 and
# running a float32 GEMM. From this many rows the conversion pays; below it (a lone
# decode) the bfloat16 matrix-vector loop, reading half the bytes, is faster.
_FLOAT32_GEMM_MIN_ROWS = 4
# Weight rows converted at a time: 256 rows of a 576-wide layer are 590 KB of float32,
# which stay in the core's cache between the conversion and the GEMM that reads them
# (and a 49,152-row LM head never needs a float32 copy of itself).
_FLOAT32_GEMM_CHUNK_ROWS = 256


@functools.cache
def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether this torch build and processor run oneDNN's packed-weight linear in ``dtype``
    (x86 builds do in float32; bfloat16 needs AVX-512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        if not (
            hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        ):
            return False
        return dtype == torch.float32 or (
            dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except RuntimeError:
        return False


class Linear(nn.Linear):
    """``nn.Linear`` that can run from a oneDNN-packed copy of its weight on CPU, or from
    a quantized weight that its ``quant_method`` keeps.

    torch's CPU matmul goes through MKL, which on AMD processors takes a generic code path:
    measured on a 2-core Zen 5, float32 GEMMs of this model's shapes ran at 110-200
    GFLOP/s through MKL and 390-470 through oneDNN with a packed weight.
    """

    # The weight oneDNN multiplies with, once `prepack` has run: a buffer (not saved), so
    # that what counts the model's buffers counts it.
    onednn_weight: torch.Tensor | None
    # Rows per matmul call when results must not depend on the batch (see
    # `use_fixed_row_tiles`); None runs the whole batch in one call.
    row_tile: int | None = None
    # Whether a bfloat16 weight multiplies as float32 from `_FLOAT32_GEMM_MIN_ROWS` rows
    # (see `prepack_for_cpu`).
    float32_gemm: bool = False
    # False for a layer whose weight is only looked up (the embedding): nothing to pack.
    multiplies: ClassVar[bool] = True
    # None: it holds its whole input; else the width its input is split over the ranks at
    # multiples of, at any number of ranks (see `QuantizableLayer`).
    input_split_width: int | None = None
    # The LoRA adapters added to its output, where the engine serves adapters.
    lora: LoRASlots | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quant_method: QuantizedLinearMethod | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("onednn_weight", None, persistent=False)
        self.quant_method = quant_method
        # Quantized weights by checkpoint shard (see `QuantizableLayer`).
        self.quantized_pieces: dict[int, GroupQuantizedWeight | CpuPackedWeight] = {}
        if quant_method is not None:
            quant_method.create_weights(self)

    @property
    def num_checkpoint_shards(self) -> int | None:
        """How many checkpoint tensors fill the weight; None: one, under the layer's name."""
        return None

    def checkpoint_part(self, loaded: CheckpointTensor, shard: int | None) -> CheckpointPart:
        """What this rank keeps of checkpoint weight ``loaded``; a ValueError if its shape
        does not fit."""
        loaded.check_shape((self.out_features, self.in_features))
        return CheckpointPart(None, None, slice(None))

    def lora_shard(self) -> LoRAShard:
        """What this rank keeps of an adapter of this projection."""
        return LoRAShard(((0, self.out_features),), (0, self.in_features))

    def param_part(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard: int | None
    ) -> CheckpointPart:
        """What this rank keeps of ``loaded`` for ``param`` (the weight or the bias); a
        ValueError, changing nothing, if its shape does not fit."""
        if param is self.weight:
            return self.checkpoint_part(loaded, shard)
        loaded.check_shape(tuple(param.shape))
        return CheckpointPart(None, None, slice(None))

    def load_weight(self, param: nn.Parameter, loaded: CheckpointTensor, shard: int | None) -> None:
        part = self.param_part(param, loaded, shard)
        if param is self.weight:
            self.store_weight(loaded, part)
        else:
            param.data[part.out_rows].copy_(loaded.read(rows=part.rows))

    @property
    def prepacked(self) -> bool:
        """Whether the matmul runs from a oneDNN-packed copy, the dense weight dropped."""
        return self.onednn_weight is not None and self.weight.numel() == 0

    def unpack(self) -> None:
        """Bring back the dense weight a `prepack` dropped (oneDNN's reorder back, exact)."""
        assert self.onednn_weight is not None
        self.weight = nn.Parameter(self.onednn_weight.to_dense(), requires_grad=False)
        self.onednn_weight = None

    def store_weight(self, loaded: CheckpointTensor, part: CheckpointPart) -> None:
        """Fill ``part.out_rows`` of the weight from a float checkpoint weight, in the
        layer's format."""
        if self.quant_method is not None:
            self.quant_method.load_weight(self, loaded, part)
        else:
            self.weight.data[part.out_rows].copy_(loaded.read(rows=part.rows, cols=part.cols))

    def prepack(self, keep_dense_weight: bool) -> None:
        """Run the matmul through oneDNN: from a packed copy of the weight, the dense one
        dropped; or, where another module reads the dense weight too (a tied embedding),
        from that same dense weight.

        NOTE: a packed copy beside a tied embedding held SmolLM2's largest matrix twice
        (113 MB of its 538 MB); oneDNN on the plain layout gives the same results and
        measured 10-20% slower than packed on that matrix, still about 2x MKL.
        """
        if keep_dense_weight:
            self.onednn_weight = self.weight.detach()
            return
        self.pack(self.weight.detach())

    def pack(self, dense: torch.Tensor) -> None:
        """Multiply from a packed copy of ``dense`` (``[out_features, in_features]``), the
        dense weight dropped."""
        self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(
            dense.contiguous(), _PACK_BATCH_HINT
        )
        self.weight = nn.Parameter(dense.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.row_tile is None:
            out = self._matmul_call(x, bias)
        else:
            tile = self.row_tile
            num_rows = x.shape[0]
            padded = F.pad(x, (0, 0, 0, -num_rows % tile))
            out = torch.cat([self._matmul_call(rows, bias) for rows in padded.split(tile)])
            out = out[:num_rows]
        if self.lora is not None:
            self.lora.add_to(out, x)
        return out

    def _matmul_call(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        if self.onednn_weight is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.onednn_weight, bias, "none", [], ""
            )
            return out
        if self.float32_gemm and x.shape[0] >= _FLOAT32_GEMM_MIN_ROWS:
            return multiply_as_float32(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


def multiply_as_float32(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32 GEMMs over `_FLOAT32_GEMM_CHUNK_ROWS`-row
    float32 copies of the weight, returned in ``x``'s dtype. A bfloat16 product is exact in
    float32 and torch's bfloat16 GEMM accumulates in float32 too, so only the order of the
    additions differs."""
    x32 = x.float()
    out = torch.cat(
        [F.linear(x32, chunk.float()) for chunk in weight.split(_FLOAT32_GEMM_CHUNK_ROWS)],
        dim=-1,
    )
    if bias is not None:
        out += bias
    return out.to(x.dtype)


def prepack_for_cpu(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every unquantized `Linear` of a CPU model its fastest matmul here: oneDNN where
    it runs in ``dtype``, else, for bfloat16 weights, float32 GEMMs over converted chunks."""
    linears = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.quant_method is None and m.multiplies
    ]
    if not onednn_linear_available(dtype):
        for module in linears:
            module.float32_gemm = dtype == torch.bfloat16
        return
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    for module in linears:
        module.prepack(keep_dense_weight=uses[id(module.weight)] > 1)
    return_freed_heap_memory()


def return_freed_heap_memory() -> None:
    """Give the heap's free pages back to the OS, where the C library can (glibc).

    NOTE: the dense weights freed by packing sit in the heap between live allocations,
    which glibc does not return on its own: 38 MB of SmolLM2's resident size.
    """
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every quantized `Linear`'s method check or finish what loading gave it."""
    for module in model.modules():
        if isinstance(module, Linear) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)


# A GEMM library picks its kernel, and with it the order of each row's additions, from
# the shape: measured with MKL here, a float32 row's result differs at M = 1-3, 5-7 and
# 9-11 from its result in a larger batch. Calls of one fixed shape make every row's
# result depend on that row alone.
BATCH_INVARIANT_ROW_TILE = 16


def use_fixed_row_tiles(model: nn.Module) -> None:
    """Make every `Linear` of the model batch-invariant: each call multiplies fixed tiles
    of `BATCH_INVARIANT_ROW_TILE` rows (the last one zero-padded)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.row_tile = BATCH_INVARIANT_ROW_TILE


@dataclass(frozen=True, slots=True)
class RowShard:
    """The checkpoint rows ``[start, start + size)`` one projection keeps on this rank, of
    the ``num_rows`` its checkpoint tensor has."""

    start: int
    size: int
    num_rows: int

    @classmethod
    def of_heads(
        cls, tp: TensorParallelGroup, num_heads: int, head_dim: int
    ) -> tuple[RowShard, int]:
        """This rank's whole heads of a projection with ``num_heads`` (at least one; the
        config's checks refuse fewer), and how many.

        With fewer heads than ranks each head is replicated on ``size // num_heads``
        consecutive ranks, so every rank holds one whole head.
        """
        heads_per_rank = max(num_heads // tp.size, 1)
        first_head = tp.rank * num_heads // tp.size
        shard = cls(first_head * head_dim, heads_per_rank * head_dim, num_heads * head_dim)
        return shard, heads_per_rank

    @classmethod
    def of_rows(cls, tp: TensorParallelGroup, num_rows: int) -> RowShard:
        """This rank's equal share of a projection's ``num_rows`` (divisible by the ranks)."""
        return cls(*tp.shard_range(num_rows), num_rows)


class PackedLinear(Linear):
    """One matmul for several projections of the same input (q/k/v, or gate/up), each
    split over the tensor-parallel ranks by output rows (column parallel).

    The checkpoint stores each projection separately and whole; `load_weight` copies this
    rank's rows of one of them into its place in the packed weight.
    """

    def __init__(
        self,
        in_features: int,
        shards: list[RowShard],
        bias: bool,
        quant_method: QuantizedLinearMethod | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard.size for shard in shards), bias, quant_method)
        self.shards = shards
        self.output_sizes = [shard.size for shard in shards]
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(shards))]

    @property
    def num_checkpoint_shards(self) -> int:
        return len(self.shards)

    def lora_shard(self) -> LoRAShard:
        return LoRAShard(
            tuple((shard.start, shard.size) for shard in self.shards), (0, self.in_features)
        )

    def checkpoint_part(self, loaded: CheckpointTensor, shard: int | None) -> CheckpointPart:
        return self._part(loaded, shard, (self.in_features,))

    def _part(
        self, loaded: CheckpointTensor, shard: int | None, row_shape: tuple[int, ...]
    ) -> CheckpointPart:
        """This rank's part of projection ``shard``, whose checkpoint tensor must have
        the projection's rows of ``row_shape`` each (a weight's features, a bias's none)."""
        if shard is None:
            raise ValueError(
                f"Checkpoint weight {loaded.name!r} is already packed; paged_llm loads the "
                "separate projections (q_proj, k_proj, v_proj, gate_proj, up_proj)."
            )
        part = self.shards[shard]
        loaded.check_shape((part.num_rows, *row_shape))
        offset = self.offsets[shard]
        return CheckpointPart((part.start, part.size), None, slice(offset, offset + part.size))

    def param_part(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard: int | None
    ) -> CheckpointPart:
        if param is self.weight:
            return self.checkpoint_part(loaded, shard)
        return self._part(loaded, shard, ())


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks (the attention output
    and MLP down projections): each rank multiplies its share, one all-reduce sums them."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallelGroup,
        quant_method: QuantizedLinearMethod | None = None,
        *,
        finest_split: int,
    ) -> None:
        """``finest_split``: the model's `model_splits.finest_split`, which every number
        of ranks divides."""
        super().__init__(in_features // tp.size, out_features, bias, quant_method)
        self.tp = tp
        self.input_split_width = in_features // finest_split

    def lora_shard(self) -> LoRAShard:
        return LoRAShard(
            ((0, self.out_features),), (self.tp.rank * self.in_features, self.in_features)
        )

    def checkpoint_part(self, loaded: CheckpointTensor, shard: int | None) -> CheckpointPart:
        loaded.check_shape((self.out_features, self.in_features * self.tp.size))
        return CheckpointPart(
            None, (self.tp.rank * self.in_features, self.in_features), slice(None)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._matmul(x, self.bias)
        # The bias joins after the sum, so it is added once.
        out = self.tp.all_reduce(self._matmul(x, None))
        return out if self.bias is None else out.add_(self.bias)
