"""C++ CPU kernels for paged_llm, compiled by ``torch.utils.cpp_extension`` on first use.

Importing this package compiles nothing; `load` builds the extension (once per machine and
source version, into torch's extension cache, ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``) and says whether the kernels can run. The build uses
``-march=native``: the library is compiled on the machine that runs it, and a copied cache
directory would need the same processor.

This is the bottom layer; it must never import ``paged_llm``.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import time
import warnings
from pathlib import Path
from typing import IO

import torch

# NOTE: a child of the library's logger by name only (this layer never imports paged_llm),
# so the library's logging settings apply.
logger = logging.getLogger("paged_llm.csrc_cpu")

_NAME = "paged_llm_cpu"
_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("paged_attention.cpp", "quantized_matmul.cpp", "rms_norm.cpp", "rotary.cpp")
]
# NOTE: -fopenmp makes at::parallel_for run on torch's OpenMP pool (the soname matches the
# libgomp torch loaded, so the process keeps one pool and torch.set_num_threads applies).
# -fno-trapping-math lets loops with comparisons (exp's clamp) vectorize; it changes no
# result, only whether floating-point exceptions may be raised.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
# The file in the build directory whose flock a process holds while it builds or loads the
# kernels. The kernel releases an flock when its holder dies, however it dies.
BUILD_LOCK_FILE = "paged_llm_build.lock"
# How long `load` waits for another live process's build (one takes 20-40 s on 2 cores)
# before running on torch operators instead.
BUILD_WAIT_SECONDS = 300.0
# torch's own lock file (``lock``, created just before it runs ninja in the directory) is
# taken for a killed build's once it is this old and no process runs in the directory.
_TORCH_LOCK_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.2


@functools.cache
def load() -> bool:
    """Build and load the kernels on first call; False (with one warning that says why)
    where they cannot be built, e.g. without a C++ compiler, or while another process has
    been building them for over `BUILD_WAIT_SECONDS`."""
    try:
        return _build_and_load()
    except Exception as error:  # a build can fail in many ways: compiler, headers, ninja
        warnings.warn(
            f"paged_llm's C++ CPU kernels could not be built ({_reason(error)}); decode attention, "
            "RMSNorm, rotary and quantized matmuls run on torch operators instead (slower). Set "
            "CXX to a working C++17 compiler to use them.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False


def _build_and_load() -> bool:
    """`load`'s work, once no other build runs in the directory: False (with a warning) if
    one still does after `BUILD_WAIT_SECONDS`."""
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(_NAME, verbose=False)).resolve()
    with open(build_dir / BUILD_LOCK_FILE, "a") as lock:
        if not _wait_for_other_builds(lock, build_dir):
            warnings.warn(
                f"paged_llm's C++ CPU kernels are still being built by another process after "
                f"{BUILD_WAIT_SECONDS:.0f} s ({build_dir}); decode attention, RMSNorm, rotary and "
                "quantized matmuls run on torch operators instead (slower). A later start uses "
                "the kernels once that build has ended.",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        # Said because the first start on a machine is otherwise silent for half a minute;
        # whether anything compiles is ninja's decision, this only foresees it.
        library = build_dir / f"{_NAME}.so"
        newest_source = max(
            path.stat().st_mtime
            for path in Path(__file__).parent.iterdir()
            if path.suffix in (".cpp", ".h")
        )
        compiles = not library.exists() or library.stat().st_mtime < newest_source
        if compiles:
            logger.info(
                "building paged_llm's CPU kernels (once per machine, ~30 s) into %s", build_dir
            )
        start = time.monotonic()
        cpp_extension.load(
            name=_NAME,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        if compiles:
            logger.info("built paged_llm's CPU kernels in %.0f s", time.monotonic() - start)
    return True


def _wait_for_other_builds(lock: IO[str], build_dir: Path) -> bool:
    """Take the build's flock on ``lock`` and see torch's lock file gone, waiting up to
    `BUILD_WAIT_SECONDS` for a live build (and saying so); False if one still runs then."""
    deadline = time.monotonic() + BUILD_WAIT_SECONDS
    waiting = False
    while not (_try_flock(lock) and _torch_lock_released(build_dir)):
        if time.monotonic() >= deadline:
            return False
        if not waiting:
            logger.warning("waiting for another process building the CPU kernels: %s", build_dir)
            waiting = True
        time.sleep(_POLL_SECONDS)
    return True


def _try_flock(lock: IO[str]) -> bool:
    """Take (or keep) an exclusive flock on ``lock`` if no other open file holds one."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _torch_lock_released(build_dir: Path) -> bool:
    """Whether torch's lock file in ``build_dir`` is gone, or was left by a build that was
    killed (and is removed): torch would wait for it forever.

    Called under the flock, so no build of ours runs; one that does not take it (an older
    paged_llm, a killed build's compilers, which outlive it) runs ninja in the directory.
    """
    torch_lock = build_dir / "lock"
    try:
        age = time.time() - torch_lock.stat().st_mtime
    except FileNotFoundError:
        return True
    if age < _TORCH_LOCK_GRACE_SECONDS or _process_runs_in(build_dir):
        return False
    torch_lock.unlink(missing_ok=True)
    return True


def _process_runs_in(directory: Path) -> bool:
    """Whether a process we may look at has ``directory`` as its working directory
    (Linux's /proc; False where there is none)."""
    for process in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(process / "cwd") == str(directory):
                return True
        except OSError:  # gone meanwhile, or another user's
            continue
    return False


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_idx: torch.Tensor,
    seq_idx: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    vector_passes: bool = True,
) -> None:
    """Attention of the query tokens ``token_idx`` over their paged context, into ``out``.

    query and out ``[T, H, D]`` (float32, bfloat16 or float16, heads contiguous);
    key_cache and value_cache ``[Hkv, num_blocks, block_size, D]`` as stored (the query's
    dtype or fp8; keys divided by their scale, so ``scale`` includes it); block_tables
    ``[B, max_blocks]`` int32; token_idx, seq_idx (the block-table row of each token) and
    context_lens (the keys it sees: positions ``< context_len``, the last
    ``sliding_window`` of them if given) ``[N]`` int64. Rows of ``out`` not in token_idx
    are left as they were. ``vector_passes=False`` runs the generic loops where the
    vector passes (`vectorized_decode_attention`) would, which give the same bits (a test
    holds them to it). Needs `load` to have returned True.
    """
    torch.ops.paged_llm_cpu.decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        token_idx,
        seq_idx,
        context_lens,
        scale,
        sliding_window or 0,
        vector_passes,
        out,
    )


def vectorized_decode_attention(head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether `decode_attention` over a cache of ``cache_dtype`` with heads of
    ``head_dim`` runs vector passes here (AVX-512, or AVX2 with FMA and F16C; others take
    its generic loops). Needs `load`."""
    return bool(torch.ops.paged_llm_cpu.vectorized_decode_attention(head_dim, cache_dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``[N, D]`` (rows contiguous), scaled by ``weight``
    ``[D]`` in ``x``'s dtype: transformers' LlamaRMSNorm in one pass. Needs `load`."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.ops.paged_llm_cpu.rms_norm(x, weight, eps, out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, both in place: ``residual`` becomes the
    sum and ``x`` its norm (shapes and dtypes as `rms_norm`'s). Needs `load`."""
    torch.ops.paged_llm_cpu.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates query ``[T, H, D]`` and key ``[T, Hkv, D]`` (heads contiguous, tokens at any
    stride) in place by ``cos`` and ``sin`` ``[T, D / 2]`` (rows contiguous), all four in
    one dtype: transformers' ``x * cos + rotate_half(x) * sin`` with its roundings. Needs
    `load`."""
    torch.ops.paged_llm_cpu.rotary_embedding(query, key, cos, sin)


# `packed_quantized_matmul`'s passes, by the ``isa`` it takes.
QUANTIZED_MATMUL_ISAS = {"generic": 0, "avx2": 1, "avx512_vnni": 2, "amx": 3}


def quantized_matmul_isas() -> list[str]:
    """The passes of `packed_quantized_matmul` this build has, fastest first ("generic"
    always). Needs `load`."""
    names = {code: name for name, code in QUANTIZED_MATMUL_ISAS.items()}
    return [names[code] for code in torch.ops.paged_llm_cpu.quantized_matmul_isas()]


def packed_quantized_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    out_features: int,
    group_size: int,
    act_block: int,
    nibbles: bool,
    isa: str,
) -> torch.Tensor:
    """``x̂ @ W.T`` in ``x``'s dtype, ``x`` ``[M, K]`` float32 or bfloat16 with contiguous
    rows, for ``W[n, k] = scale[n, k // group_size] * code[n, k] + offset[n, ...]`` in the
    layout quantized_matmul.cpp describes (codes ``[row blocks, bytes]`` uint8, 4-bit pairs
    if ``nibbles`` else int8; scale and offset ``[row blocks, groups, 16]`` float32, or both
    float16), and
    ``x̂`` the activations rounded to int8 per block of ``act_block`` features (32, or a
    multiple of 64 for a weight of one group a row; a row's last block may be shorter):
    ``d = amax / 127``, ``q = round(x * 127 / amax)``, ``x̂ = d * q``. Exact integer sums; float32 rounding of
    their scaled sums only. ``isa`` is one of `quantized_matmul_isas`. Needs `load`."""
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    torch.ops.paged_llm_cpu.packed_quantized_matmul(
        x,
        codes,
        scale,
        offset,
        out_features,
        group_size,
        act_block,
        nibbles,
        QUANTIZED_MATMUL_ISAS[isa],
        out,
    )
    return out


def packed_dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    nibbles: bool,
    rows: range,
    num_features: int,
) -> torch.Tensor:
    """Rows ``rows`` (a step-1 range starting at a multiple of 16) of the weight
    `packed_quantized_matmul` multiplies by, ``[len(rows), num_features]`` in bfloat16:
    ``scale * code + offset`` rounded to float32 after the product and after the sum, then
    once to bfloat16, bit for bit what dequantizing in torch gives. Needs `load`."""
    out = torch.empty(len(rows), num_features, dtype=torch.bfloat16)
    torch.ops.paged_llm_cpu.packed_dequantize(
        codes, scale, offset, group_size, nibbles, rows.start, out
    )
    return out


def _reason(error: Exception) -> str:
    """The line of a failed build's output that says what went wrong."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    cause = next((line for line in lines if "error:" in line or "not found" in line), lines[0])
    return cause[:300]
