"""csrc_cpu's quantized matmul over the packed layout against a float64 torch reference,
on every pass this machine's build has, and the packing's round trip."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import csrc_cpu
from paged_llm.layers.linear import Linear, use_fixed_row_tiles
from paged_llm.layers.quantization import cpu_matmul, get_quantized_linear_method
from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight
from paged_llm.layers.weights import CheckpointTensor

if not csrc_cpu.load():
    pytest.skip("csrc_cpu's kernels could not be built here", allow_module_level=True)

ISAS = csrc_cpu.quantized_matmul_isas()
# |kernel - reference| <= BOUND * sum_k |W[n, k]| * |x̂[m, k]|: the integer sums are exact,
# so only float32 roundings of the partial sums remain (a few per span, K / 16 spans).
BOUND = 1e-5


def reference(
    x: torch.Tensor, weight: GroupQuantizedWeight, input_split_width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x̂ @ W.T`` in float64, with x̂ rounded as the kernel documents (written out here,
    not `cpu_matmul.rounded_activations`): per block of 32 features; before a weight of
    one group a row, of 128 in a layer whose input is whole, and of 64 in one whose input
    is split over ranks at multiples of 64; the last block shorter; and the scale of its
    rounding error (``|x̂| @ |W|.T``)."""
    num_rows, num_features = x.shape
    if weight.group_size < num_features:
        block = 32
    elif input_split_width is None:
        block = 128
    else:
        block = 64 if input_split_width % 64 == 0 else 32
    padded = torch.nn.functional.pad(x.float(), (0, -num_features % block))
    blocks = padded.view(num_rows, -1, block)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse).clamp(-127, 127)
    rounded = (codes * (amax / 127)).view(num_rows, -1)[:, :num_features].double()
    w = weight.dequantize(torch.float64)
    return rounded @ w.T, rounded.abs() @ w.abs().T


def random_weight(
    rows: int, features: int, bits: int, group_size: int, offset: bool
) -> GroupQuantizedWeight:
    groups = max(1, features // group_size)
    codes = torch.randint(0, 2**bits, (rows, features))
    scale = torch.rand(rows, groups) * 0.02
    zero = (
        torch.randint(0, 2**bits, (rows, groups)).float() if offset else torch.zeros(rows, groups)
    )
    return GroupQuantizedWeight.from_codes(codes, scale, zero, bits)


def packed_matmul(
    x: torch.Tensor, weight: GroupQuantizedWeight, isa: str, input_split_width: int | None = None
) -> torch.Tensor:
    return cpu_matmul.packed_matmul(x, cpu_matmul.pack(weight, input_split_width), isa)


# (bits, group size: 0 for one group a row).
LAYOUTS = [
    (4, 32),  # GGUF Q4_0 / Q4_1 / Q4_K
    (6, 16),  # Q6_K's groups of 16, two to an activation block
    (8, 32),  # Q8_0
    (4, 128),  # GPTQ / AWQ group 128
    (8, 0),  # int8 per channel
    (4, 0),  # GPTQ / compressed-tensors int4 per channel
    (4, 64),
]
# (rows, out_features, in_features): row counts past a tile (16 on AMX, 6 and 8 on AVX-512,
# 2 on AVX2) and below AMX's 12 (the VNNI pass),
# output rows not a multiple of 16, and features not a multiple of 32 (per channel).
SHAPES = [
    (1, 7, 256),
    (5, 97, 384),
    (13, 33, 768),
    (3, 5, 96),
    (20, 40, 96),
    (9, 17, 72),
    (97, 50, 160),
    (37, 16, 64),
]
CASES = [
    (*layout, *shape)
    for layout in LAYOUTS
    for shape in SHAPES
    if shape[2] % (layout[1] or shape[2]) == 0
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group_size", "rows", "out_features", "in_features"), CASES)
def test_kernel_matches_the_reference(
    isa: str, bits: int, group_size: int, rows: int, out_features: int, in_features: int
) -> None:
    group = group_size or in_features
    torch.manual_seed(rows * 1000 + out_features)
    weight = random_weight(out_features, in_features, bits, group, offset=bits != 8)
    x = torch.randn(rows, in_features) * 3
    out = packed_matmul(x, weight, isa)
    expected, scale = reference(x, weight)
    assert ((out.double() - expected).abs() <= BOUND * scale + 1e-30).all()


@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_activations_give_bfloat16_results_of_the_same_sums(isa: str) -> None:
    torch.manual_seed(0)
    weight = random_weight(40, 256, 4, 32, offset=True)
    x = (torch.randn(3, 256) * 2).bfloat16()
    out = packed_matmul(x, weight, isa)
    expected, _ = reference(x.float(), weight)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("rows", "in_features", "input_split_width"),
    [(3, 96, 32), (20, 160, 32), (17, 192, 96), (37, 256, 64), (5, 384, 192)],
)
def test_a_layer_whose_input_is_split_rounds_in_blocks_every_split_keeps_whole(
    isa: str, rows: int, in_features: int, input_split_width: int
) -> None:
    """A row-parallel layer's rank holds a slice of the input cut at a multiple of
    ``input_split_width``: before a per-row weight its blocks are 64 wide where that
    divides the width, else 32, as a single rank's are, where a whole input takes blocks of
    128."""
    torch.manual_seed(rows)
    weight = random_weight(24, in_features, 8, in_features, offset=False)
    x = torch.randn(rows, in_features) * 3
    for split_width in (input_split_width, None):
        out = packed_matmul(x, weight, isa, split_width)
        expected, scale = reference(x, weight, split_width)
        assert ((out.double() - expected).abs() <= BOUND * scale + 1e-30).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group_size", "offset"), [(4, 32, True), (8, 32, False)])
@pytest.mark.parametrize("rows", [1, 13, 37, 97])
def test_scales_exact_in_float16_are_kept_so_and_multiply_the_same(
    isa: str, bits: int, group_size: int, offset: bool, rows: int
) -> None:
    """GGUF's Q4_1 and Q8_0 scales and offsets are float16 numbers: packed as float16
    (the bytes decode reads), they give exactly the float32-stored weight's product."""
    torch.manual_seed(rows)
    weight = random_weight(50, 160, bits, group_size, offset)
    weight = GroupQuantizedWeight(
        weight.codes,
        weight.scale.half().float(),
        None if weight.offset is None else weight.offset.half().float(),
        bits,
        group_size,
    )
    packed = cpu_matmul.pack(weight, None)
    assert packed.scale.dtype == torch.float16
    assert packed.offset is None or packed.offset.dtype == torch.float16
    as_float32 = dataclasses.replace(
        packed,
        scale=packed.scale.float(),
        offset=None if packed.offset is None else packed.offset.float(),
    )
    x = torch.randn(rows, 160)
    out = cpu_matmul.packed_matmul(x, packed, isa)
    assert torch.equal(out, cpu_matmul.packed_matmul(x, as_float32, isa))
    expected, scale = reference(x, weight)
    assert ((out.double() - expected).abs() <= BOUND * scale + 1e-30).all()


def test_scales_not_exact_in_float16_stay_float32() -> None:
    weight = random_weight(20, 64, 4, 32, offset=True)
    packed = cpu_matmul.pack(weight, None)
    assert packed.scale.dtype == packed.offset.dtype == torch.float32


def test_zero_activations_give_zero() -> None:
    weight = random_weight(9, 64, 4, 32, offset=True)
    assert (packed_matmul(torch.zeros(2, 64), weight, ISAS[0]) == 0).all()


@pytest.mark.parametrize(
    ("bits", "group_size", "in_features"), [(4, 32, 96), (6, 16, 64), (8, 72, 72)]
)
def test_packed_rows_unpack_to_the_same_codes_and_weights(
    bits: int, group_size: int, in_features: int
) -> None:
    weight = random_weight(21, in_features, bits, group_size, offset=bits != 8)
    packed = cpu_matmul.pack(weight, input_split_width=None)
    rows = torch.tensor([20, 0, 17, 5])
    assert torch.equal(
        packed.dequantize_rows(rows, torch.float32), weight.dequantize(torch.float32)[rows]
    )


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, 192)])
@pytest.mark.parametrize("input_split_width", [None, 96, 64])
def test_the_torch_route_computes_the_same_product(
    bits: int, group_size: int, input_split_width: int | None
) -> None:
    """Where the kernel cannot run (act-order groups, no C++ build) torch multiplies the
    same rounded activations."""
    torch.manual_seed(2)
    weight = random_weight(70, 192, bits, group_size, offset=bits != 8)
    x = torch.randn(6, 192)
    expected, scale = reference(x, weight, input_split_width)
    for route in (weight, cpu_matmul.pack(weight, input_split_width)):
        out = cpu_matmul.matmul(x, route, input_split_width)
        assert ((out.double() - expected).abs() <= BOUND * scale + 1e-12).all()


# (rows, out_features, in_features, first row): whole and partial row blocks, features
# not a multiple of a packed vector's 4 or 8, and a range that starts past row 0.
DEQUANTIZED_RANGES = [(33, 33, 96, 0), (40, 97, 160, 16), (7, 7, 72, 0), (64, 80, 64, 32)]
DEQUANTIZE_CASES = [
    (*layout, *shape)
    for layout in LAYOUTS
    for shape in DEQUANTIZED_RANGES
    if shape[2] % (layout[1] or shape[2]) == 0
]


@pytest.mark.parametrize(
    ("bits", "group_size", "rows", "out_features", "in_features", "start"), DEQUANTIZE_CASES
)
@pytest.mark.parametrize("float16_scales", [False, True])
def test_packed_rows_dequantize_to_bfloat16_bit_for_bit(
    bits: int,
    group_size: int,
    rows: int,
    out_features: int,
    in_features: int,
    start: int,
    float16_scales: bool,
) -> None:
    """`csrc_cpu.packed_dequantize` makes the values torch's dequantize makes, rounded once
    to bfloat16, from float32 or float16 scales and offsets."""
    group = group_size or in_features
    torch.manual_seed(rows + in_features)
    weight = random_weight(out_features, in_features, bits, group, offset=bits != 8)
    if float16_scales:
        weight = dataclasses.replace(
            weight,
            scale=weight.scale.half().float(),
            offset=None if weight.offset is None else weight.offset.half().float(),
        )
    packed = cpu_matmul.pack(weight, None)
    assert (packed.scale.dtype == torch.float16) == float16_scales
    stop = min(out_features, start + rows)
    dequantized = csrc_cpu.packed_dequantize(
        packed.codes,
        packed.scale,
        packed.offset,
        packed.group_size,
        packed.nibbles,
        range(start, stop),
        in_features,
    )
    expected = weight.dequantize(torch.bfloat16)[start:stop]
    assert torch.equal(dequantized.view(torch.int16), expected.view(torch.int16))


def rows_from_crossover(isa: str, weight: cpu_matmul.CpuPackedWeight, otherwise: int) -> int:
    """The rows from which ``weight``'s bfloat16 matmul takes the dequantized route, or
    ``otherwise`` (rows that stand for "any") where its pass has no crossover for it."""
    crossover = cpu_matmul.dequantized_min_rows(isa, weight)
    return otherwise if crossover == float("inf") else int(crossover)


# (bits, group size: 0 for one group a row, input split width): a weight of each
# activation block, 32 (4- and 8-bit codes), 64 (int8's o and down) and 128 (q/k/v, ...).
ROUTED_LAYOUTS = [(4, 32, None), (8, 32, None), (8, 0, 64), (8, 0, None)]


@pytest.mark.parametrize(("bits", "group_size", "input_split_width"), ROUTED_LAYOUTS)
def test_bfloat16_activations_from_the_crossover_multiply_the_dequantized_weight(
    bits: int, group_size: int, input_split_width: int | None
) -> None:
    """From `dequantized_min_rows` rows (where this CPU's pass has a measured crossover for
    the weight) a bfloat16 matmul is the bfloat16 GEMM by the dequantized weight, its
    activations unrounded; a row fewer, the kernel's W8A8 product."""
    isa = cpu_matmul.kernel_isa()
    assert isa is not None
    torch.manual_seed(bits)
    in_features = 128
    weight = random_weight(40, in_features, bits, group_size or in_features, offset=bits != 8)
    packed = cpu_matmul.pack(weight, input_split_width)
    crossover = cpu_matmul.dequantized_min_rows(isa, packed)
    # Without a measured crossover, the kernel at every size: 4,096 rows stand for "any".
    rows = rows_from_crossover(isa, packed, otherwise=4096)
    x = torch.randn(rows, in_features).bfloat16()
    dequantized_product = torch.nn.functional.linear(x, weight.dequantize(torch.bfloat16))
    for count in (rows - 1, rows):
        out = cpu_matmul.matmul(x[:count], packed, input_split_width)
        if count >= crossover:
            assert torch.equal(out, dequantized_product[:count])
        else:
            assert torch.equal(out, cpu_matmul.packed_matmul(x[:count], packed, isa))


# (bits, group size, input split width, a shape past the size bound of that layout's
# route): int8's o and down past 2^22 values, its other projections past 2^21, Q8_0 past
# 2^24.
LARGE_WEIGHTS = [
    (8, 0, 64, (2048, 2112)),
    (8, 0, None, (2048, 1040)),
    (8, 32, None, (4096, 4128)),
]


@pytest.mark.parametrize(("bits", "group_size", "input_split_width", "shape"), LARGE_WEIGHTS)
def test_bfloat16_activations_before_a_large_weight_stay_on_the_kernel_longer(
    bits: int, group_size: int, input_split_width: int | None, shape: tuple[int, int]
) -> None:
    """Past its route's size bound, an 8-bit weight is multiplied by the W8A8 kernel at the
    rows where a small one of its layout takes the dequantized weight: there the kernel
    measured as fast or faster (int8 at every size, Q8_0 up to 511 rows)."""
    isa = cpu_matmul.kernel_isa()
    assert isa is not None
    torch.manual_seed(7)
    small_weight = random_weight(40, 128, bits, group_size or 128, offset=False)
    small = cpu_matmul.pack(small_weight, input_split_width)
    large_weight = random_weight(*shape, bits, group_size or shape[1], offset=False)
    large = cpu_matmul.pack(large_weight, input_split_width)
    assert small.act_block == large.act_block
    rows = rows_from_crossover(isa, small, otherwise=4096)
    assert cpu_matmul.dequantized_min_rows(isa, large) > rows
    x = torch.randn(rows, shape[1]).bfloat16()
    out = cpu_matmul.matmul(x, large, input_split_width)
    assert torch.equal(out, cpu_matmul.packed_matmul(x, large, isa))


def test_batch_invariant_row_tiles_keep_every_row_on_the_kernel() -> None:
    """`use_fixed_row_tiles` multiplies 16 rows a call, below every crossover: a row's
    product is the kernel's whatever the batch, which batch_invariant=True relies on."""
    isa = cpu_matmul.kernel_isa()
    assert isa is not None
    torch.manual_seed(5)
    method = get_quantized_linear_method("int8", triton=False)
    layer = Linear(64, 48, False, method).to(torch.bfloat16)
    # An input split at 16 features: activation blocks of 32, the earliest 8-bit crossover.
    layer.input_split_width = 16
    layer.load_weight(layer.weight, CheckpointTensor("weight", torch.randn(48, 64)), None)
    method.process_weights_after_loading(layer)
    use_fixed_row_tiles(layer)
    (packed,) = layer.quantized_pieces.values()
    assert isinstance(packed, cpu_matmul.CpuPackedWeight)
    assert packed.act_block == cpu_matmul.ACT_BLOCK
    rows = max(2000, rows_from_crossover(isa, packed, otherwise=2000))
    x = torch.randn(rows, 64).bfloat16()
    with torch.no_grad():
        batched = layer(x)
    alone = torch.cat(
        [cpu_matmul.packed_matmul(x[i : i + 16], packed, isa) for i in range(0, rows, 16)]
    )
    assert torch.equal(batched, alone)
