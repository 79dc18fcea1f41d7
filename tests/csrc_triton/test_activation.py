from collections.abc import Callable

import pytest
import torch

from csrc_triton import reference, silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("intermediate_size", [64, 100, 2500])
def test_matches_reference(
    intermediate_size: int, dtype: torch.dtype, device: str, assert_close: Callable
) -> None:
    torch.manual_seed(0)
    # A strided row slice: the kernel must not assume contiguous rows.
    x = torch.randn(9, 2 * intermediate_size, dtype=dtype, device=device)[::2]
    assert_close(silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.gpu
def test_large_bf16(device: str, assert_close: Callable) -> None:
    torch.manual_seed(1)
    x = torch.randn(4096, 2 * 14336, dtype=torch.bfloat16, device=device)
    assert_close(silu_and_mul(x), reference.silu_and_mul(x))
