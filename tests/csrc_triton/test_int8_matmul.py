from collections.abc import Callable

import pytest
import torch

from csrc_triton import int8_weight_matmul, reference


def _int8_weight(out_features: int, in_features: int, device: str) -> tuple[torch.Tensor, ...]:
    weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    scale = torch.rand(out_features) * 0.02 + 0.001
    return weight.to(device), scale.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Decode-sized and prefill-sized batches, and sizes that are not block multiples.
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 64, 128), (37, 100, 70)])
def test_matches_reference(
    rows: int,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device: str,
    assert_close: Callable,
) -> None:
    torch.manual_seed(0)
    weight, scale = _int8_weight(out_features, in_features, device)
    # A strided row slice: the kernel must not assume contiguous rows.
    x = torch.randn(2 * rows, in_features, device=device).to(dtype)[::2]
    scale = scale.to(dtype)
    assert_close(
        int8_weight_matmul(x, weight, scale), reference.int8_weight_matmul(x, weight, scale)
    )


def test_refuses_a_float_weight(device: str) -> None:
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="int8"):
        int8_weight_matmul(x, torch.randn(4, 8, device=device), torch.ones(4, device=device))
