"""RMSNorm through csrc_cpu's C++ kernel against torch's operators (the transformers
expression), alone and after the residual add, and the fallback where the kernel cannot
be built."""

from __future__ import annotations

import pytest
import torch

from paged_llm.layers.kernels import ElementwiseKernels
from paged_llm.layers.layernorm import RMSNorm

EPS = 1e-5


def _norms(hidden_size: int, dtype: torch.dtype) -> tuple[RMSNorm, RMSNorm]:
    """The same random-weight norm on torch operators and on the C++ kernel."""
    torch_norm = RMSNorm(hidden_size, EPS).to(dtype)
    with torch.no_grad():
        torch_norm.weight.copy_(torch.randn(hidden_size) * 0.5 + 1)
    kernel_norm = RMSNorm(hidden_size, EPS, ElementwiseKernels.CPU).to(dtype)
    kernel_norm.load_state_dict(torch_norm.state_dict())
    return torch_norm, kernel_norm


pytestmark = pytest.mark.usefixtures("cpu_kernels")


# float32: only the order of the sum of squares differs; bfloat16: the same roundings.
TOLERANCES = {torch.float32: {"atol": 2e-6, "rtol": 2e-6}, torch.bfloat16: {"atol": 0, "rtol": 0}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden_size"), [(1, 64), (7, 576), (300, 100)])
def test_norm_matches_torch_operators(rows: int, hidden_size: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    torch_norm, kernel_norm = _norms(hidden_size, dtype)
    x = (torch.randn(rows, hidden_size) * 3).to(dtype)
    torch.testing.assert_close(kernel_norm(x), torch_norm(x), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_and_norm_match_torch_operators_and_update_in_place(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    torch_norm, kernel_norm = _norms(576, dtype)
    x, residual = (torch.randn(40, 576).to(dtype) for _ in range(2))
    expected_out, expected_sum = torch_norm(x, residual)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = kernel_norm(x_in, residual_in)
    assert out.data_ptr() == x_in.data_ptr()
    assert new_residual.data_ptr() == residual_in.data_ptr()
    assert torch.equal(new_residual, expected_sum)  # one rounding, as torch's add
    torch.testing.assert_close(out, expected_out, **TOLERANCES[dtype])


def test_rows_of_a_strided_view_are_read_where_they_are() -> None:
    torch.manual_seed(2)
    torch_norm, kernel_norm = _norms(64, torch.float32)
    wide = torch.randn(9, 200)
    rows = wide[:, 10:74]  # row stride 200
    torch.testing.assert_close(
        kernel_norm(rows), torch_norm(rows.contiguous()), **TOLERANCES[torch.float32]
    )


def test_a_row_normalizes_the_same_alone_and_in_a_batch() -> None:
    torch.manual_seed(3)
    _, kernel_norm = _norms(576, torch.float32)
    batch = torch.randn(4096, 576)  # enough rows for several threads' tasks
    together = kernel_norm(batch)
    assert torch.equal(kernel_norm(batch[4000:4001]), together[4000:4001])


def test_per_head_norms_of_3d_views_stay_on_torch() -> None:
    torch.manual_seed(4)
    torch_norm, kernel_norm = _norms(64, torch.float32)
    heads = torch.randn(5, 3, 64)
    assert torch.equal(kernel_norm(heads), torch_norm(heads))


@pytest.mark.usefixtures("failing_build")
def test_a_failed_build_makes_the_cpu_choice_torch() -> None:
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert ElementwiseKernels.CPU.usable() is ElementwiseKernels.TORCH
    assert ElementwiseKernels.TRITON.usable() is ElementwiseKernels.TRITON
