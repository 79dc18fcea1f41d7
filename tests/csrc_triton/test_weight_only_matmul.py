from collections.abc import Callable

import pytest
import torch

from csrc_triton import reference, weight_only_matmul


def _weight(
    out_features: int, in_features: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights of ``dtype`` over its whole range, and small per-channel scales."""
    if dtype == torch.int8:
        weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    else:
        # Every value an fp8 format holds up to e4m3's largest (448), from its bit
        # patterns: subnormals and zeros included. (e5m2's values up to 57344 would make
        # float32 sums whose rounding differs with the summation order past 1e-5.)
        codes = torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8)
        values = codes.view(dtype).float()
        weight = torch.where(values.abs() <= 448, values, 0).to(dtype)
    scale = torch.rand(out_features) * 0.02 + 0.001
    return weight.to(device), scale.to(device)


@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Decode-sized and prefill-sized batches, and sizes that are not block multiples.
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 64, 128), (37, 100, 70)])
def test_matches_reference(
    rows: int,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
    device: str,
    assert_close: Callable,
) -> None:
    torch.manual_seed(0)
    weight, scale = _weight(out_features, in_features, weight_dtype, device)
    # A strided row slice: the kernel must not assume contiguous rows.
    x = torch.randn(2 * rows, in_features, device=device).to(dtype)[::2]
    scale = scale.to(dtype)
    assert_close(
        weight_only_matmul(x, weight, scale), reference.weight_only_matmul(x, weight, scale)
    )


def test_refuses_a_float_weight(device: str) -> None:
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="int8"):
        weight_only_matmul(x, torch.randn(4, 8, device=device), torch.ones(4, device=device))
