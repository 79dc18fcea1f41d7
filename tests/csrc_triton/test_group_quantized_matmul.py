"""csrc_triton.group_quantized_matmul against its torch reference, and against the
dequantization of paged_llm's own group-quantized layout."""

from collections.abc import Callable

import pytest
import torch

from csrc_triton import group_quantized_matmul, reference
from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight


def _codes(
    out_features: int, in_features: int, bits: int, group_size: int, with_offset: bool
) -> GroupQuantizedWeight:
    """Random codes of ``bits`` over their whole range with random per-group scales (and
    zero points), in the layout paged_llm keeps them; the scales shrink with the code
    range, as a real checkpoint's do, so weights stay below about 0.3."""
    groups = in_features // group_size
    codes = torch.randint(0, 2**bits, (out_features, in_features))
    scale = (torch.rand(out_features, groups) * 0.02 + 0.001) / 2 ** (bits - 4)
    zero = (
        torch.randint(0, 2**bits, (out_features, groups)).float()
        if with_offset
        else torch.zeros(out_features, groups)
    )
    return GroupQuantizedWeight.from_codes(codes, scale, zero, bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Decode- and prefill-sized batches; groups smaller than, equal to and spanning a K block;
# sizes that are not block multiples.
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "group_size"),
    [(1, 64, 128, 16), (37, 96, 70, 32), (5, 128, 20, 128)],
)
def test_matches_reference_and_the_layouts_dequantization(
    rows: int,
    in_features: int,
    out_features: int,
    group_size: int,
    dtype: torch.dtype,
    with_offset: bool,
    bits: int,
    device: str,
    assert_close: Callable,
) -> None:
    torch.manual_seed(0)
    weight = _codes(out_features, in_features, bits, group_size, with_offset).to(
        torch.device(device)
    )
    assert weight.nibbles == (bits == 4)
    # A strided row slice: the kernel must not assume contiguous rows.
    x = torch.randn(2 * rows, in_features, device=device).to(dtype)[::2]
    args = (weight.codes, weight.scale, weight.offset, weight.group_size)
    out = group_quantized_matmul(x, *args)
    assert_close(out, reference.group_quantized_matmul(x, *args))
    # The reference reads the layout as GroupQuantizedWeight.dequantize does.
    expected = (x.float() @ weight.dequantize(dtype).float().T).to(dtype)
    assert_close(out, expected)


def test_refuses_mismatched_shapes(device: str) -> None:
    x = torch.randn(2, 64, device=device)
    codes = torch.zeros(4, 16, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="codes must be"):
        group_quantized_matmul(x, codes, torch.ones(4, 2, device=device), None, 32)
    codes = torch.zeros(4, 32, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="scale"):
        group_quantized_matmul(x, codes, torch.ones(4, 3, device=device), None, 32)
