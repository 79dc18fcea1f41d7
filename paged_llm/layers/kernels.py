"""Access to the Triton kernels of ``csrc_triton``, imported on first use.

Triton is not installed everywhere (macOS, Windows), and CPU runs never need it, so no
module imports it at load time.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def triton_kernels() -> ModuleType:
    import csrc_triton

    return csrc_triton
