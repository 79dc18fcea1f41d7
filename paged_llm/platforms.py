"""Everything that differs between the devices paged_llm runs on, asked of one object.

The model runner, the layers and the CUDA-graph code never test ``device.type`` or
``x.is_cuda``: they ask the `Platform` of the engine what applies (memory accounting,
the KV budget, pinned copies, CUDA graphs, the Triton element-wise kernels). A platform
is chosen once, in `EngineConfig.create`, from the ``device`` argument; tests pass a fake
GPU platform there to run the GPU start-up on a CPU.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from paged_llm.layers.kernels import ElementwiseKernels

# Share of the RAM available at start-up that the KV cache may take on CPU when no
# kv_cache_memory_bytes is given.
CPU_KV_CACHE_RAM_FRACTION = 0.25


class DecodeGraphMode(enum.Enum):
    """How decode-only steps run."""

    NONE = "none"  # eagerly, over the step's own tensors
    CAPTURE = "capture"  # replayed CUDA graphs over static, padded buffers
    # The same static, padded buffers run eagerly: the graph path's batching without a GPU.
    STATIC_EAGER = "static-eager"


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """Device memory as the allocator and the driver see it, in bytes."""

    total: int
    free: int  # free on the device, whoever else uses it
    reserved: int  # held by this process's caching allocator


def triton_interpreter_enabled() -> bool:
    """Whether Triton runs kernels on CPU tensors: TRITON_INTERPRET, read as Triton reads it."""
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)


class Platform:
    """One kind of device, and what paged_llm may use of it."""

    name: ClassVar[str]
    # Capabilities; a subclass declares them, callers only read them.
    decode_graph_mode: ClassVar[DecodeGraphMode] = DecodeGraphMode.NONE
    elementwise_kernels: ClassVar[ElementwiseKernels] = ElementwiseKernels.TORCH
    # Quantized linear layers multiply, and LoRA adapters add, through csrc_triton's
    # kernels (else torch's ops).
    triton_linear: ClassVar[bool] = False
    default_attention_backend: ClassVar[str] = "torch"
    # torch.distributed backend of the tensor-parallel group.
    distributed_backend: ClassVar[str] = "gloo"
    # The setting to name when the KV cache is too small.
    kv_budget_setting: ClassVar[str] = "kv_cache_memory_bytes"
    # What `available_kv_cache_bytes` counts, for messages.
    available_memory_name: ClassVar[str]
    # dtype="auto": the checkpoint's dtype, or float32 (a CPU's fast path).
    auto_dtype_from_checkpoint: ClassVar[bool] = False
    # Linear layers run from oneDNN-packed weights (float32 and bfloat16).
    prepacks_linear_weights: ClassVar[bool] = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    # ----- vLLM's names, for scripts that ask `current_platform` --------------------------

    @property
    def device_type(self) -> str:
        return self.device.type

    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def is_cuda_alike(self) -> bool:
        return self.is_cuda()

    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def is_rocm(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def get_device_name(self, device_id: int = 0) -> str:
        if self.is_cuda():
            return torch.cuda.get_device_name(device_id)
        return "cpu"

    def device_count(self) -> int | None:
        """Devices of this kind that ranks can use; None: no limit (processes share one)."""
        return None

    def runs_triton(self) -> bool:
        """Whether Triton kernels can run on this platform's tensors."""
        return self.device.type == "cuda" or triton_interpreter_enabled()

    def kv_cache_budget_bytes(
        self,
        requested_bytes: int | None,
        gpu_memory_utilization: float,
        most_useful_bytes: int,
        profile_step: Callable[[], None],
    ) -> int:
        """Bytes the KV cache may take: ``requested_bytes`` (kv_cache_memory_bytes) when
        given, else what the platform can spare, of which at most ``most_useful_bytes``
        (max_num_seqs full-length sequences) could ever be used; ``profile_step`` runs the
        largest step once."""
        raise NotImplementedError

    def available_kv_cache_bytes(self, tp_size: int) -> int:
        """The most one of ``tp_size`` ranks' KV caches can take now, after the weights: a
        bound on kv_cache_memory_bytes and on any budget, known before profiling."""
        raise NotImplementedError

    def check_kv_cache_dtype(self, kv_cache_dtype: torch.dtype, attention_backend: str) -> None:
        """Refuse, with a ValueError that says what to use instead, a KV-cache dtype the
        attention backend cannot read here."""

    def check_quantization(self, quantization: str | None) -> None:
        """Refuse, with a ValueError that says what to use instead, a weight format whose
        matmul does not run here."""
        # NOTE: torch has no weight-only fp8 matmul on CPU: dequantizing per call measured
        # 40x float32's time, torch._scaled_mm 60x (docs/quantization.md#fp8-weights).
        if quantization == "fp8" and not self.triton_linear:
            raise ValueError(
                f"LLM argument quantization='fp8' needs a CUDA GPU (its matmul is a Triton "
                f"kernel); the {self.name} platform has no fp8 weight matmul. Use "
                "quantization='int8' (the same one byte a weight; with dtype='bfloat16' on "
                "CPU), or 'gguf' for a .gguf model."
            )

    def host_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on this platform's device, without blocking the host."""
        return tensor

    def synchronize(self) -> None:
        """Wait for queued device work."""

    def empty_cache(self) -> None:
        """Hand the allocator's unused cached memory back to the device."""

    def for_rank(self, rank: int) -> Platform:
        """The platform of tensor-parallel rank ``rank`` (rank 0 is this one)."""
        return self

    def enter_rank_process(self, tp_size: int) -> None:
        """Make this process fit to be one of ``tp_size`` ranks on the machine."""

    def replica_devices(self) -> list[str] | None:
        """The device ids data-parallel replicas divide among themselves (each gets its
        slice as CUDA_VISIBLE_DEVICES); None where they share the host's cores instead."""
        return None


class CpuPlatform(Platform):
    """The host's own processor: oneDNN and the cpu attention backend."""

    name = "cpu"
    available_memory_name = "RAM available (MemAvailable)"
    default_attention_backend = "cpu"
    elementwise_kernels = ElementwiseKernels.CPU
    prepacks_linear_weights = True

    def enter_rank_process(self, tp_size: int) -> None:
        # NOTE: ranks share the cores; more threads than cores in all makes every
        # collective wait for a rank the OS has parked.
        if tp_size > 1:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // tp_size))

    def available_kv_cache_bytes(self, tp_size: int) -> int:
        # NOTE: the ranks of one engine share the host's RAM.
        return available_ram_bytes() // tp_size

    def kv_cache_budget_bytes(
        self,
        requested_bytes: int | None,
        gpu_memory_utilization: float,
        most_useful_bytes: int,
        profile_step: Callable[[], None],
    ) -> int:
        # NOTE: profile_step is not run: a CPU has no allocator statistics to learn from,
        # so the cache takes a fixed share of free RAM, and no more than it could use.
        if requested_bytes is not None:
            return requested_bytes
        return min(int(available_ram_bytes() * CPU_KV_CACHE_RAM_FRACTION), most_useful_bytes)


class CudaPlatform(Platform):
    """An NVIDIA GPU: profiled KV sizing, pinned copies, CUDA graphs, Triton kernels."""

    name = "cuda"
    decode_graph_mode = DecodeGraphMode.CAPTURE
    elementwise_kernels = ElementwiseKernels.TRITON
    triton_linear = True
    default_attention_backend = "triton"
    distributed_backend = "nccl"
    kv_budget_setting = "gpu_memory_utilization (or kv_cache_memory_bytes)"
    available_memory_name = "free device memory"
    auto_dtype_from_checkpoint = True

    def device_count(self) -> int | None:
        return torch.cuda.device_count()

    def converts_fp8_e4m3(self) -> bool:
        """Whether Triton converts to and from e4m3 here: on compute capability 8.9 and
        later (Ada, Hopper); e5m2 converts everywhere."""
        return torch.cuda.get_device_capability(self.device) >= (8, 9)

    def check_quantization(self, quantization: str | None) -> None:
        if quantization == "fp8" and not self.converts_fp8_e4m3():
            raise ValueError(
                f"LLM argument quantization='fp8' (e4m3 weights) needs a GPU of compute "
                f"capability 8.9 or later; {torch.cuda.get_device_name(self.device)} has less. "
                "Use quantization='int8'."
            )

    def check_kv_cache_dtype(self, kv_cache_dtype: torch.dtype, attention_backend: str) -> None:
        if (
            kv_cache_dtype == torch.float8_e4m3fn
            and attention_backend == "triton"
            and not self.converts_fp8_e4m3()
        ):
            raise ValueError(
                f"kv_cache_dtype='fp8' (e4m3) needs a GPU of compute capability 8.9 or later "
                f"for the Triton attention backend; {torch.cuda.get_device_name(self.device)} "
                "has less. Use kv_cache_dtype='fp8_e5m2' or 'auto'."
            )

    def available_kv_cache_bytes(self, tp_size: int) -> int:
        # NOTE: what this process's allocator caches unused is handed back first, so it
        # counts as free.
        self.empty_cache()
        return self.memory_snapshot().free

    def kv_cache_budget_bytes(
        self,
        requested_bytes: int | None,
        gpu_memory_utilization: float,
        most_useful_bytes: int,
        profile_step: Callable[[], None],
    ) -> int:
        """What is left of ``gpu_memory_utilization`` of the device after the weights, the
        activations of one full step (measured by running one) and other processes."""
        # NOTE: the step runs even with kv_cache_memory_bytes set: it is also the warm-up
        # that compiles the kernels before graphs are captured.
        self.empty_cache()
        self.reset_peak_memory()
        profile_step()
        self.synchronize()
        peak = self.peak_memory_bytes()
        self.empty_cache()
        if requested_bytes is not None:
            return requested_bytes
        memory = self.memory_snapshot()
        # Memory other processes and the CUDA context hold is unavailable to us as well.
        used_by_others = memory.total - memory.free - memory.reserved
        return int(memory.total * gpu_memory_utilization) - peak - used_by_others

    # Memory accounting: the primitives a fake GPU replaces with numbers of its own.

    def memory_snapshot(self) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(total, free, torch.cuda.memory_reserved(self.device))

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def host_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def for_rank(self, rank: int) -> Platform:
        index = self.device.index or 0
        return type(self)(torch.device("cuda", index + rank))

    def enter_rank_process(self, tp_size: int) -> None:
        # NOTE: the ranks are processes of one machine: NCCL's bootstrap sockets need no
        # other interface than loopback (a user's own setting is kept).
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        torch.cuda.set_device(self.device)

    def replica_devices(self) -> list[str] | None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return [str(index) for index in range(torch.cuda.device_count())]
        return [device.strip() for device in visible.split(",") if device.strip()]


@functools.cache
def _current_platform() -> Platform:
    return get_platform("auto")


def __getattr__(name: str) -> Platform:
    """``current_platform`` (vLLM's ``vllm.platforms.current_platform``): the platform
    ``device="auto"`` picks on this machine, resolved on first use. The engine never reads it:
    each engine gets its platform from its own ``device`` argument."""
    if name == "current_platform":
        return _current_platform()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_platform(device: str | torch.device | Platform) -> Platform:
    """The platform for an `LLM`'s ``device`` argument."""
    if isinstance(device, Platform):
        return device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}.")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but no CUDA device is available.")
        return CudaPlatform(resolved)
    return CpuPlatform(resolved)


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
