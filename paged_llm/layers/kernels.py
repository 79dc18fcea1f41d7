"""Which kernels run the element-wise layers, and access to the Triton ones.

Triton is not installed everywhere (macOS, Windows), and CPU runs never need it, so no
module imports ``csrc_triton`` at load time.
"""

from __future__ import annotations

import enum
import functools
from types import ModuleType

import csrc_cpu


class ElementwiseKernels(enum.Enum):
    """What runs RMSNorm, rotary and SiLU-and-mul: a platform's choice."""

    TORCH = "torch"  # torch operators, on every device
    TRITON = "triton"  # csrc_triton's kernels for all three
    CPU = "cpu"  # csrc_cpu's RMSNorm (alone and after the residual add) and rotary; torch's SiLU

    def usable(self) -> ElementwiseKernels:
        """This choice, or TORCH where csrc_cpu's kernels could not be built here (`load`
        warns once and says why)."""
        if self is ElementwiseKernels.CPU and not csrc_cpu.load():
            return ElementwiseKernels.TORCH
        return self


@functools.cache
def triton_kernels() -> ModuleType:
    import csrc_triton

    return csrc_triton
