from collections.abc import Callable

import pytest
import torch

from csrc_triton import fused_add_rms_norm, reference, rms_norm

EPS = 1e-6
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_inputs(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, weight_dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (a strided column slice, as kernels may get), ``residual`` and ``weight``."""
    x = torch.randn(num_tokens, hidden_size + 8, dtype=dtype, device=device)[:, 3 : 3 + hidden_size]
    residual = torch.randn(num_tokens, hidden_size, dtype=dtype, device=device)
    weight = 1 + 0.1 * torch.randn(hidden_size, dtype=weight_dtype, device=device)
    return x, residual, weight


@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["same", "fp32_weight"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 100, 2048])
def test_rms_norm(
    hidden_size: int,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None,
    device: str,
    assert_close: Callable,
) -> None:
    torch.manual_seed(0)
    x, _, weight = make_inputs(5, hidden_size, dtype, weight_dtype or dtype, device)
    # The normalized value is rounded to x's dtype before the fp32 weight scales it.
    assert_close(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 100, 2048])
def test_fused_add_rms_norm(
    hidden_size: int, dtype: torch.dtype, device: str, assert_close: Callable
) -> None:
    torch.manual_seed(1)
    x, residual, weight = make_inputs(5, hidden_size, dtype, dtype, device)
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, weight, EPS)
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert new_residual is residual
    assert_close(new_residual, expected_residual)
    assert_close(out, expected_out)


@pytest.mark.gpu
def test_large_bf16(device: str, assert_close: Callable) -> None:
    torch.manual_seed(2)
    x, residual, weight = make_inputs(4096, 4096, torch.bfloat16, torch.bfloat16, device)
    assert_close(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, weight, EPS)
    out, residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert_close(residual, expected_residual)
    assert_close(out, expected_out)
