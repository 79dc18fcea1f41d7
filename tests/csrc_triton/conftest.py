"""Kernel test setup: device and tolerances (tests/conftest.py turns on the interpreter)."""

from collections.abc import Callable

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# fp32 is checked tightly. bf16/fp16 allow about one unit in the last place of the output
# (the Triton interpreter truncates fp32 -> bf16 where the GPU and torch round to nearest).
_TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.fixture
def device() -> str:
    """Device for test tensors: the GPU when there is one, else CPU (interpreted kernels)."""
    return DEVICE


@pytest.fixture
def assert_close() -> Callable[..., None]:
    """``torch.testing.assert_close`` with this suite's tolerance for ``dtype``.

    ``dtype`` defaults to the expected tensor's; pass the input dtype when a kernel rounds
    through it before producing a wider output.
    """

    def check(
        actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None
    ) -> None:
        torch.testing.assert_close(actual, expected, **_TOLERANCES[dtype or expected.dtype])

    return check
