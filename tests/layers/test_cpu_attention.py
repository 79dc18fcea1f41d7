"""The cpu attention backend (decodes through csrc_cpu's C++ kernel) against the torch
backend and the reference, and its fallback where the kernel cannot be built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import csrc_cpu
from csrc_triton import reference
from paged_llm.layers.attention import CpuAttentionBackend, KVCacheLayout, TorchAttentionBackend
from tests.csrc_triton.batches import make_batch
from tests.layers.test_attention import _metadata_of, _run_backend

# Decodes of context 1 (a one-token prompt), on both sides of block boundaries (15, 16,
# 17 tokens before the query at block size 16) and over many blocks, a fresh prefill, and
# a prefill chunk after cached context.
QUERY_LENS = (1, 1, 1, 1, 1, 1, 1, 24, 5)
CONTEXT_LENS = (0, 15, 16, 17, 31, 63, 200, 0, 40)


pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _batch(
    seed: int, block_size: int, num_queries_per_kv: int, head_dim: int, dtype: torch.dtype
) -> dict:
    torch.manual_seed(seed)
    # NOTE: unused slots hold large finite garbage: a read outside the context shows.
    return make_batch(
        QUERY_LENS,
        CONTEXT_LENS,
        2,
        num_queries_per_kv,
        head_dim,
        block_size,
        dtype,
        "cpu",
        unused_fill=1e4,
    )


@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("block_size", "num_queries_per_kv"), [(1, 1), (16, 3), (32, 4)])
def test_cpu_backend_matches_torch_backend(
    block_size: int, num_queries_per_kv: int, head_dim: int, sliding_window: int | None
) -> None:
    batch = _batch(0, block_size, num_queries_per_kv, head_dim, torch.float32)
    expected = _run_backend(batch, block_size, sliding_window, TorchAttentionBackend())
    actual = _run_backend(batch, block_size, sliding_window, CpuAttentionBackend())
    # Float32 sums in another order: a few ulps of outputs of order 1.
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "atol"),
    [
        (torch.bfloat16, torch.bfloat16, 1e-2),
        (torch.float16, torch.float16, 2e-3),
        (torch.float32, torch.float8_e4m3fn, 1e-5),
        (torch.bfloat16, torch.float8_e5m2, 1e-2),
    ],
)
def test_cache_dtypes_match_reference(
    dtype: torch.dtype, cache_dtype: torch.dtype, atol: float
) -> None:
    """Keys and values as stored, with their scales for fp8; sums in float32, so the only
    error left is the output's rounding to a 16-bit dtype."""
    batch = _batch(1, 16, 3, 64, dtype)
    k_scale, v_scale = (0.3, 1.7) if cache_dtype.itemsize == 1 else (1.0, 1.0)
    batch["key_cache"] = reference.quantize(batch["key_cache"], cache_dtype, k_scale)
    batch["value_cache"] = reference.quantize(batch["value_cache"], cache_dtype, v_scale)
    expected = reference.paged_attention(**batch, k_scale=k_scale, v_scale=v_scale)
    actual = _run_backend(batch, 16, None, CpuAttentionBackend(), k_scale, v_scale)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)


def test_batch_invariant_mode_attends_every_token_through_the_kernel() -> None:
    """Prefill tokens too, each over its own context; a sequence's rows are bit-identical
    whether the others share its step or not."""
    batch = _batch(2, 16, 3, 64, torch.float32)
    backend = CpuAttentionBackend()
    together = _run_backend(batch, 16, None, backend, batch_invariant=True)
    expected = reference.paged_attention(**batch)
    torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-5)
    # Only the fresh prefill (sequence 7), as a step of its own.
    start, end = (int(i) for i in batch["query_start_loc"][7:9])
    alone_batch = {
        **batch,
        "query": batch["query"][start:end],
        "block_tables": batch["block_tables"][7:8],
        "seq_lens": batch["seq_lens"][7:8],
        "query_start_loc": batch["query_start_loc"][7:9] - start,
    }
    alone = _run_backend(alone_batch, 16, None, backend, batch_invariant=True)
    assert torch.equal(alone, together[start:end])


@pytest.mark.usefixtures("failing_build")
def test_a_failed_build_warns_and_falls_back_to_torch() -> None:
    batch = _batch(3, 16, 3, 64, torch.float32)
    backend = CpuAttentionBackend()
    with pytest.warns(RuntimeWarning, match="could not be built"):
        actual = _run_backend(batch, 16, None, backend)
    assert not backend.has_kernel
    expected = _run_backend(batch, 16, None, TorchAttentionBackend())
    assert torch.equal(actual, expected)


def _has_vector_passes() -> bool:
    """What the kernel's build (-march=native) vectorizes on this processor: AVX-512, or
    AVX2 with FMA and F16C."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return "avx512f" in flags or {"avx2", "fma", "f16c"} <= flags


def test_the_kernel_says_which_heads_and_caches_take_its_vector_passes() -> None:
    """64- and 128-wide heads of 32- and 16-bit caches, where the processor has AVX-512 or
    AVX2; other head sizes and fp8 caches never."""
    assert csrc_cpu.load()
    vectorized = _has_vector_passes()
    for head_dim in (64, 128):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert csrc_cpu.vectorized_decode_attention(head_dim, dtype) is vectorized
    for head_dim, dtype in ((80, torch.float32), (96, torch.bfloat16), (64, torch.float8_e5m2)):
        assert not csrc_cpu.vectorized_decode_attention(head_dim, dtype)
        # So the backend keeps the cascade for them, whatever the build.
        backend = CpuAttentionBackend()
        backend.setup(KVCacheLayout(3, head_dim, torch.bfloat16, dtype, has_sliding_window=False))
        assert backend.cascade
    backend = CpuAttentionBackend()
    backend.setup(KVCacheLayout(3, 64, torch.float32, torch.float32, has_sliding_window=False))
    assert backend.cascade is not vectorized


@pytest.mark.skipif(not _has_vector_passes(), reason="this processor has no AVX-512 nor AVX2")
@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_vector_passes_give_the_generic_loops_bits(
    head_dim: int, dtype: torch.dtype, sliding_window: int | None
) -> None:
    """They add in the generic loops' order, so every output is bit-identical, for groups
    that fill and do not fill the register tiles and contexts on both sides of the key and
    row batches (8, 16) and of the blocks."""
    context_lens = torch.tensor([1, 7, 8, 9, 15, 16, 17, 33, 100, 257])
    num_kv_heads, block_size = 2, 16
    max_blocks = -(-int(context_lens.max()) // block_size)
    num_blocks = len(context_lens) * max_blocks + 1
    torch.manual_seed(7)
    cache_shape = (num_kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.randn(cache_shape).to(dtype)
    value_cache = torch.randn(cache_shape).to(dtype)
    block_tables = (torch.randperm(num_blocks - 1) + 1)[: len(context_lens) * max_blocks]
    block_tables = block_tables.view(len(context_lens), max_blocks).to(torch.int32)
    rows = torch.arange(len(context_lens))
    for group in (1, 2, 3, 4, 5, 8):
        query = torch.randn(len(context_lens), num_kv_heads * group, head_dim).to(dtype)
        outputs = []
        for vector_passes in (True, False):
            out = torch.zeros_like(query)
            csrc_cpu.decode_attention(
                query,
                key_cache,
                value_cache,
                block_tables,
                rows,
                rows,
                context_lens,
                head_dim**-0.5,
                sliding_window,
                out,
                vector_passes=vector_passes,
            )
            outputs.append(out)
        assert torch.equal(outputs[0], outputs[1]), f"group {group}"


@pytest.mark.parametrize("vectorized", [False, True])
def test_decodes_sharing_a_long_prefix_take_the_cascade_unless_the_kernel_is_vectorized(
    vectorized: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five decodes whose tables start with the same 4 blocks: beside the kernel's generic
    loops they go through the torch backend's cascade (the prefix gathered once) and the
    sixth through the kernel; beside its vector passes all six through the kernel."""
    monkeypatch.setattr(
        csrc_cpu, "vectorized_decode_attention", lambda head_dim, cache_dtype: vectorized
    )
    torch.manual_seed(5)
    batch = make_batch(
        (1, 1, 1, 1, 1, 1, 20),
        (100, 90, 130, 64, 70, 150, 30),
        2,
        3,
        64,
        16,
        torch.float32,
        "cpu",
        unused_fill=1e4,
    )
    batch["block_tables"][1:5, :4] = batch["block_tables"][0, :4]
    backend = CpuAttentionBackend()
    actual = _run_backend(batch, 16, None, backend)
    expected = reference.paged_attention(**batch)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    plan = backend.prepare(_metadata_of(batch, 16)).decodes
    if vectorized:
        assert plan.cascade is None
        assert plan.paged.token_idx.tolist() == [0, 1, 2, 3, 4, 5]
    else:
        assert plan.cascade.shared_prefix is not None
        assert len(plan.cascade.shared_prefix.token_idx) == 5
        assert plan.paged.token_idx.tolist() == [5]
