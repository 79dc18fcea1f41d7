"""A fake GPU platform: CUDA's start-up order and batching decisions over CPU tensors.

Memory accounting comes from numbers the test sets; the profiling step really runs (on
the CPU), decode batches go through the static, padded buffers of CUDA graphs (run
eagerly), and attention runs through the Triton kernel under the interpreter, as on a GPU
it runs compiled. The element-wise kernels (tested on their own in tests/csrc_triton) are
left to torch here: interpreted one row at a time, they would take most of a test's time.
"""

from __future__ import annotations

import torch

from paged_llm.layers.kernels import ElementwiseKernels
from paged_llm.platforms import CudaPlatform, DecodeGraphMode, MemorySnapshot

MIB = 2**20


class FakeGpuPlatform(CudaPlatform):
    name = "fake-gpu"
    decode_graph_mode = DecodeGraphMode.STATIC_EAGER
    elementwise_kernels = ElementwiseKernels.TORCH

    def __init__(
        self,
        total: int = 64 * MIB,
        reserved: int = 4 * MIB,
        used_by_others: int = 8 * MIB,
        profiled_peak: int = 20 * MIB,
    ) -> None:
        super().__init__(torch.device("cpu"))
        self.total = total
        self.reserved = reserved
        self.used_by_others = used_by_others
        self.profiled_peak = profiled_peak
        self.events: list[str] = []

    def memory_snapshot(self) -> MemorySnapshot:
        free = self.total - self.used_by_others - self.reserved
        return MemorySnapshot(self.total, free, self.reserved)

    def reset_peak_memory(self) -> None:
        self.events.append("reset peak")

    def peak_memory_bytes(self) -> int:
        self.events.append("read peak")
        return self.profiled_peak

    def host_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def device_count(self) -> int | None:
        return 8

    def converts_fp8_e4m3(self) -> bool:
        # The interpreter converts on any CPU, as a Hopper GPU would.
        return True

    def for_rank(self, rank: int) -> FakeGpuPlatform:
        return self

    def enter_rank_process(self, tp_size: int) -> None:
        pass
