"""Quantized matmuls on CPU, W8A8: the activations are quantized to int8 per block of
`activation_block` features (``d = amax / 127``, ``q = round(x * 127 / amax)``, llama.cpp's
Q8_0 activations) and multiplied by the weight's integer codes, so every route computes
``x̂ @ W.T`` for those rounded rows ``x̂ = d * q``, at any batch size; except a bfloat16
matmul of `dequantized_min_rows` rows or more, which multiplies its activations as they
are by the weight dequantized to bfloat16 (`dequantized_matmul`).

A group-quantized weight (GGUF, GPTQ, AWQ, compressed-tensors) or a per-channel int8 one is
repacked once at load time into a `CpuPackedWeight`, 16 output rows by 4 features per
64-byte vector, which csrc_cpu's ``packed_quantized_matmul`` multiplies with AVX-512 VNNI,
AVX2 or generic loops, never making a float weight. Where that cannot run (C++ kernels not
built, GPTQ act-order's per-feature groups) the weight is dequantized in torch and multiplied
by the same ``x̂``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import csrc_cpu
from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight

# Features that share one activation scale (llama.cpp's Q8_0 block) before a
# group-quantized weight, whose scales change every group anyway.
ACT_BLOCK = 32
# The same before a weight of one group (scale) a row whose layer holds its whole input,
# whose integer sums can then run over 128 features before they are scaled: the AMX pass's
# tile products take 64 at a time, and each scaling cost as much as a product.
# Perplexity of SmolLM2-135M-Instruct with int8 weights against float32 on 3,513 tokens of
# docs/architecture.md, with every layer's block one size: +0.32% per 32, +0.72% per 64,
# +1.25% per 128, +2.27% per 256, +3.85% per 1,024; see docs/quantization.md.
ROW_ACT_BLOCK = 128
# The same where the layer's input is split over ranks (o and down), if every split falls
# at a multiple of it, else `ACT_BLOCK`: blocks no split cuts round the same at any number
# of ranks. Narrower than `ROW_ACT_BLOCK` because the down projection's input carries the
# outliers: with o and down at 64, SmolLM2's perplexity moved by +0.93% and +0.91% (562
# and 3,513 tokens), at 64 and 128 by +2.13% and +1.10%.
SPLIT_ROW_ACT_BLOCK = 64
# What features are padded to where activation blocks are wider than 32: AMX's widest
# tile product.
_WIDE_FEATURE_MULTIPLE = 64
# Output rows one packed vector holds (an AVX-512 register's 16 int32 lanes).
ROWS_PER_BLOCK = 16
# Weight rows the torch route dequantizes at a time (an LM head never whole in float32).
DEQUANTIZED_ROWS = 4096
_CODE_MAX = 127.0


@dataclass(frozen=True)
class DequantizedRoute:
    """Where a bfloat16 matmul by a packed weight runs as `dequantized_matmul`: from
    ``min_rows`` activation rows, before weights of at most ``max_values`` values."""

    min_rows: int
    max_values: float = float("inf")


# The routes by the kernel's pass, whether the codes are 4-bit and the weight's activation
# block (the span whose integer sums are scaled at once): where the dequantized weight
# measured faster than the W8A8 kernel, projection by projection (2 threads, Xeon with
# AMX; best of 4-10 calls; `python -m benchmarks.linear_kernels --routes
# --model M` for SmolLM2-135M/360M and Llama-3.2-1B, docs/quantization.md). The kernel's
# float scaling of a span's sums costs about as much as its AMX products, and the bfloat16
# GEMM scales nothing, so from some size the weight's conversion pays, the sooner the
# shorter the span. us, kernel / dequantized:
# - 4-bit codes, spans of 32 (Q4_1): within 15% of each other at 112 rows on every shape
#   measured; at 2,048 rows 11,829 / 2,832 on SmolLM2-135M's gate_up, 248,823 / 74,534 on
#   Llama-3.2-1B's.
# - 8-bit codes, spans of 32 (Q8_0): at 128 rows within 8%; at 256 1,202 / 769 (576 x
#   3,072), 2,741 / 1,792 (2,048 x 2,048) and 9,842 / 8,185 (2,048 x 8,192), but past
#   2^24 values 21,640 / 26,689 (Llama-3.2-1B's gate_up) and 20,835 / 21,021 (SmolLM2's
#   LM head), which are 1.05x and 1.27x faster dequantized at 512.
# - 8-bit codes, spans of 64 (int8's o and down): at 1,536 rows 777 / 553 (576 x 576),
#   4,322 / 3,972 (2,560 x 960), 7,853 / 6,863 (2,048 x 2,048), at 1,024 the kernel ahead
#   on most; past 2^22 values the kernel is ahead at 1,536 rows (30,905 / 42,284 on
#   8,192 x 2,048; 29,065 / 37,956 on 4,096 x 4,096) and about even at 2,048.
# - 8-bit codes, spans of 128 (int8's q/k/v, gate/up, LM head): at 2,048 rows 3,789 /
#   3,062 (576 x 3,072) and 2,992 / 2,754 (960 x 1,600), at 1,536 within 14%; past 2^21
#   values the kernel ahead at 2,048 rows (8,806 / 10,170 on 960 x 5,120; Llama-3.2-1B's
#   gate_up 56,569 / 92,948).
# Other passes and layouts have no measured crossover: their kernel runs at every size.
# The first of a key's routes whose bound the weight is within applies.
_DEQUANTIZED_ROUTES = {
    ("amx", True, ACT_BLOCK): (DequantizedRoute(112),),
    ("amx", False, ACT_BLOCK): (DequantizedRoute(256, max_values=2**24), DequantizedRoute(512)),
    ("amx", False, SPLIT_ROW_ACT_BLOCK): (DequantizedRoute(1536, max_values=2**22),),
    ("amx", False, ROW_ACT_BLOCK): (DequantizedRoute(2048, max_values=2**21),),
}


@functools.cache
def kernel_isa() -> str | None:
    """The vector pass of csrc_cpu's quantized matmul this CPU runs (AMX, which takes the
    AVX-512 VNNI pass below 12 rows; else AVX-512 VNNI; else AVX2); None where the C++ kernels could not be built or only the generic loops could
    (6-90x slower than float32 on SmolLM2's layers): the torch route runs instead."""
    if not csrc_cpu.load():
        return None
    fastest = csrc_cpu.quantized_matmul_isas()[0]
    return None if fastest == "generic" else fastest


def dequantized_min_rows(isa: str, weight: CpuPackedWeight) -> float:
    """Rows from which `matmul` multiplies a bfloat16 ``x`` by ``weight`` dequantized
    (infinite where the pass has no measured crossover for that weight)."""
    num_rows, num_features = weight.shape
    for route in _DEQUANTIZED_ROUTES.get((isa, weight.nibbles, weight.act_block), ()):
        if num_rows * num_features <= route.max_values:
            return route.min_rows
    return float("inf")


def activation_block(group_size: int, num_features: int, input_split_width: int | None) -> int:
    """Features that share one activation scale before a weight of groups of ``group_size``
    over ``num_features``, in a layer whose input is whole (``input_split_width`` None) or
    split over ranks at multiples of ``input_split_width``."""
    if group_size < num_features:
        return ACT_BLOCK
    if input_split_width is None:
        return ROW_ACT_BLOCK
    return SPLIT_ROW_ACT_BLOCK if input_split_width % SPLIT_ROW_ACT_BLOCK == 0 else ACT_BLOCK


@dataclass(frozen=True)
class CpuPackedWeight:
    """A group-quantized weight in csrc_cpu's packed layout (quantized_matmul.cpp): codes
    ``[row blocks, bytes]`` (16 rows x 8 features of 4-bit pairs, or 16 x 4 int8, per 64
    bytes), scale and offset ``[row blocks, groups, 16]`` (float32, or float16 where every
    value of both is exact in it: `_narrowed`); rows padded to a multiple of 16
    and features to one of 32 (64 where its `act_block` is wider) with zero codes.
    ``act_block``: the features that share one activation scale (`activation_block`)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    shape: tuple[int, int]
    group_size: int
    nibbles: bool
    act_block: int

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.offset) if t is not None]

    def codes_of(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``row_ids``' codes ``[len, K]`` in their natural order (uint8 0-15 for
        4-bit codes, else int8)."""
        num_features = self.shape[1]
        blocks, lanes = row_ids // ROWS_PER_BLOCK, row_ids % ROWS_PER_BLOCK
        vectors = self.codes.view(self.codes.shape[0], -1, ROWS_PER_BLOCK, 4)
        picked = vectors[blocks, :, lanes]  # [len, feature blocks, 4]
        if self.nibbles:
            halves = torch.stack([picked & 0x0F, picked >> 4], dim=2)  # [len, blocks, 2, 4]
            return halves.flatten(1)[:, :num_features]
        return picked.flatten(1)[:, :num_features].view(torch.int8)

    def row_values(self, row_ids: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Rows ``row_ids`` of a ``[row blocks, groups, 16]`` tensor (the scales or the
        offsets), as ``[len, groups]``."""
        return tensor[row_ids // ROWS_PER_BLOCK, :, row_ids % ROWS_PER_BLOCK]

    def dequantize_rows(self, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``row_ids`` of the float weight (the embedding's lookup), by
        `GroupQuantizedWeight.dequantize` over their unpacked codes, one a byte."""
        offset = None if self.offset is None else self.row_values(row_ids, self.offset)
        scale = self.row_values(row_ids, self.scale)
        codes = self.codes_of(row_ids)
        rows = GroupQuantizedWeight(codes, scale, offset, 8, codes.shape[1] // scale.shape[1])
        return rows.dequantize(dtype)


def packable(weight: GroupQuantizedWeight) -> bool:
    """Whether the kernel reads this weight's groups: 16 features (Q6_K), a multiple of
    32, or whole rows; never GPTQ act-order's per-feature groups."""
    group_size, num_features = weight.group_size, weight.shape[1]
    return weight.group_index is None and (
        group_size == 16 or group_size % ACT_BLOCK == 0 or group_size >= num_features
    )


def pack(weight: GroupQuantizedWeight, input_split_width: int | None) -> CpuPackedWeight:
    """``weight`` in the kernel's layout (needs `packable`), for a layer whose input is
    split over ranks at multiples of ``input_split_width`` (None: whole)."""
    num_rows, num_features = weight.shape
    padded_rows = -num_rows % ROWS_PER_BLOCK
    act_block = activation_block(weight.group_size, num_features, input_split_width)
    padded_features = -num_features % (
        ACT_BLOCK if act_block == ACT_BLOCK else _WIDE_FEATURE_MULTIPLE
    )
    blocks = (num_rows + padded_rows) // ROWS_PER_BLOCK
    if weight.nibbles:
        codes = torch.stack([weight.codes & 0x0F, weight.codes >> 4], dim=-1).flatten(1)
    else:
        codes = weight.codes.view(torch.uint8)
    codes = F.pad(codes, (0, padded_features, 0, padded_rows))
    if weight.nibbles:
        # [block, lane, feature block of 8, half, 4] -> [block, feature block, lane, 4, half]
        grouped = codes.view(blocks, ROWS_PER_BLOCK, -1, 2, 4).permute(0, 2, 1, 4, 3)
        packed = grouped[..., 0] | (grouped[..., 1] << 4)
    else:
        packed = codes.view(blocks, ROWS_PER_BLOCK, -1, 4).permute(0, 2, 1, 3)

    def by_block(tensor: torch.Tensor) -> torch.Tensor:
        padded = F.pad(tensor, (0, 0, 0, padded_rows))
        return padded.view(blocks, ROWS_PER_BLOCK, -1).transpose(1, 2).contiguous()

    scale, offset = _narrowed(
        by_block(weight.scale), None if weight.offset is None else by_block(weight.offset)
    )
    return CpuPackedWeight(
        packed.contiguous().view(blocks, -1),
        scale,
        offset,
        weight.shape,
        weight.group_size,
        weight.nibbles,
        act_block,
    )


def _narrowed(
    scale: torch.Tensor, offset: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``scale`` and ``offset`` in float16 where every value of both is exact in it (a GGUF
    file's Q4_0, Q4_1 and Q8_0 scales are float16 numbers), else in float32: 0.625 bytes a
    4-bit weight with groups of 32 instead of 0.75, what decode reads."""
    values = [t for t in (scale, offset) if t is not None]
    exact = all(torch.equal(t.to(torch.float16).to(t.dtype), t) for t in values)
    dtype = torch.float16 if exact else torch.float32
    return scale.to(dtype), None if offset is None else offset.to(dtype)


def concatenated(first: CpuPackedWeight, second: CpuPackedWeight) -> CpuPackedWeight | None:
    """``first``'s rows then ``second``'s as one packed weight, one matmul call (a GGUF
    file's q, k and v are three tensors); None where their layouts differ or ``first``'s
    rows do not fill whole blocks."""
    if not (
        first.shape[0] % ROWS_PER_BLOCK == 0
        and first.shape[1] == second.shape[1]
        and first.group_size == second.group_size
        and first.nibbles == second.nibbles
        and first.act_block == second.act_block
        and first.scale.shape[1] == second.scale.shape[1]
        and (first.offset is None) == (second.offset is None)
    ):
        return None
    # One dtype for both (float32 unless both are float16), as the kernel reads them.
    dtype = torch.promote_types(first.scale.dtype, second.scale.dtype)
    offset = None
    if first.offset is not None and second.offset is not None:
        offset = torch.cat([first.offset.to(dtype), second.offset.to(dtype)])
    return CpuPackedWeight(
        torch.cat([first.codes, second.codes]),
        torch.cat([first.scale.to(dtype), second.scale.to(dtype)]),
        offset,
        (first.shape[0] + second.shape[0], first.shape[1]),
        first.group_size,
        first.nibbles,
        first.act_block,
    )


def rounded_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x̂ = d * q`` in float32: ``x`` rounded as the kernel rounds it, per block of
    ``block`` features (the last block may be shorter)."""
    num_rows, num_features = x.shape
    padding = -num_features % block
    blocks = F.pad(x.float(), (0, padding)).view(num_rows, -1, block)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, _CODE_MAX / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse).clamp_(-_CODE_MAX, _CODE_MAX)
    return (codes * (amax / _CODE_MAX)).view(num_rows, -1)[:, :num_features]


def packed_matmul(x: torch.Tensor, weight: CpuPackedWeight, isa: str) -> torch.Tensor:
    """``x̂ @ W.T`` in ``x``'s dtype by the kernel's pass ``isa`` (one of
    `csrc_cpu.quantized_matmul_isas`)."""
    return csrc_cpu.packed_quantized_matmul(
        x.contiguous(),
        weight.codes,
        weight.scale,
        weight.offset,
        weight.shape[0],
        weight.group_size,
        weight.act_block,
        weight.nibbles,
        isa,
    )


def dequantized_matmul(x: torch.Tensor, weight: CpuPackedWeight) -> torch.Tensor:
    """``x @ W.T`` for bfloat16 ``x``, ``W`` dequantized to bfloat16 on this call (exact
    `GroupQuantizedWeight.dequantize` values, `DEQUANTIZED_ROWS` rows at a time) and
    multiplied by oneDNN's GEMM: the activations are not rounded."""
    num_rows, num_features = weight.shape
    return _by_row_chunks(
        num_rows,
        lambda rows: F.linear(
            x,
            csrc_cpu.packed_dequantize(
                weight.codes,
                weight.scale,
                weight.offset,
                weight.group_size,
                weight.nibbles,
                rows,
                num_features,
            ),
        ),
    )


def _by_row_chunks(num_rows: int, multiply: Callable[[range], torch.Tensor]) -> torch.Tensor:
    """The outputs of ``multiply`` by each `DEQUANTIZED_ROWS` weight rows, side by side."""
    outputs = [
        multiply(range(start, min(num_rows, start + DEQUANTIZED_ROWS)))
        for start in range(0, num_rows, DEQUANTIZED_ROWS)
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def matmul(
    x: torch.Tensor,
    weight: CpuPackedWeight | GroupQuantizedWeight,
    input_split_width: int | None,
) -> torch.Tensor:
    """``x̂ @ W.T`` in ``x``'s dtype, in a layer whose input is whole or split over ranks
    (`pack`): through the kernel for a packed weight, else by dequantizing
    `DEQUANTIZED_ROWS` rows at a time in torch. A bfloat16 ``x`` of
    `dequantized_min_rows` rows or more multiplies by the bfloat16 weight instead
    (`dequantized_matmul`), unrounded."""
    if isinstance(weight, CpuPackedWeight):
        isa = kernel_isa()
        assert isa is not None, "a weight is packed only where the kernel runs"
        if x.dtype == torch.bfloat16 and x.shape[0] >= dequantized_min_rows(isa, weight):
            return dequantized_matmul(x, weight)
        return packed_matmul(x, weight, isa)
    block = activation_block(weight.group_size, weight.shape[1], input_split_width)
    rounded = rounded_activations(x, block)
    out = _by_row_chunks(
        weight.shape[0],
        lambda rows: F.linear(
            rounded, weight.rows(rows.start, len(rows)).dequantize(torch.float32)
        ),
    )
    return out.to(x.dtype)
