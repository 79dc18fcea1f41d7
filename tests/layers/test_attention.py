"""The torch attention backend against the reference implementation of paged attention."""

from __future__ import annotations

import pytest
import torch

from csrc_triton import reference
from paged_llm.layers.attention import (
    AttentionMetadata,
    KVCacheLayout,
    TorchAttentionBackend,
    torch_backend,
)
from tests.csrc_triton.batches import make_batch

# Decodes mid-block and across many blocks, a fresh prefill, a chunked prefill after cached
# context, and a prefix hit ending on a block boundary, all in one batch.
QUERY_LENS = (1, 1, 70, 9, 3, 1)
CONTEXT_LENS = (37, 80, 0, 50, 16, 15)


def _slot_mapping(batch: dict, block_size: int) -> torch.Tensor:
    slots = []
    for seq, (start, end) in enumerate(
        zip(batch["query_start_loc"][:-1], batch["query_start_loc"][1:], strict=True)
    ):
        seq_len = int(batch["seq_lens"][seq])
        positions = torch.arange(seq_len - (end - start), seq_len)
        blocks = batch["block_tables"][seq, positions // block_size].long()
        slots.append(blocks * block_size + positions % block_size)
    return torch.cat(slots)


def _metadata_of(batch: dict, block_size: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=_slot_mapping(batch, block_size),
        query_start_loc=batch["query_start_loc"],
        seq_lens=batch["seq_lens"],
        block_tables=batch["block_tables"].clamp_min(0),
        query_start_loc_cpu=batch["query_start_loc"].tolist(),
        seq_lens_cpu=batch["seq_lens"].tolist(),
        max_query_len=batch["max_query_len"],
        max_seq_len=batch["max_seq_len"],
        block_size=block_size,
    )


def _run_backend(
    batch: dict,
    block_size: int,
    sliding_window: int | None,
    backend: TorchAttentionBackend,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The backend's attention over a token-major test batch."""
    num_kv_heads, head_dim = batch["key_cache"].shape[2:]
    metadata = _metadata_of(batch, block_size)
    slots = metadata.slot_mapping
    # This step's keys and values are those already in the cache, dequantized: storing
    # them again must change nothing.
    key = batch["key_cache"].view(-1, num_kv_heads, head_dim)[slots].float() * k_scale
    value = batch["value_cache"].view(-1, num_kv_heads, head_dim)[slots].float() * v_scale
    layout = KVCacheLayout(
        num_kv_heads,
        head_dim,
        batch["query"].dtype,
        batch["key_cache"].dtype,
        has_sliding_window=sliding_window is not None,
    )
    backend.setup(layout, batch_invariant)
    metadata.backend_data = backend.prepare(metadata)
    # The batch's caches are token-major; this backend keeps its cache head-major.
    key_cache = batch["key_cache"].permute(2, 0, 1, 3).contiguous()
    value_cache = batch["value_cache"].permute(2, 0, 1, 3).contiguous()
    assert key_cache.shape == backend.kv_cache_shape(
        *batch["key_cache"].shape[:2], num_kv_heads, head_dim
    )
    out = backend.forward(
        batch["query"],
        key,
        value,
        key_cache,
        value_cache,
        metadata,
        batch["scale"],
        sliding_window,
        k_scale,
        v_scale,
    )
    for stored, given in ((key_cache, batch["key_cache"]), (value_cache, batch["value_cache"])):
        assert torch.equal(stored.view(torch.uint8), given.permute(2, 0, 1, 3).view(torch.uint8))
    return out


@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_queries_per_kv", [1, 2, 4])
def test_torch_backend_matches_reference(
    num_queries_per_kv: int, head_dim: int, sliding_window: int | None
) -> None:
    torch.manual_seed(0)
    # NOTE: unused slots hold large finite garbage rather than NaN: the engine zero-fills its
    # cache, and this backend reads whole blocks and masks their unused tail.
    batch = make_batch(
        QUERY_LENS,
        CONTEXT_LENS,
        2,
        num_queries_per_kv,
        head_dim,
        16,
        torch.float32,
        "cpu",
        unused_fill=1e4,
    )
    expected = reference.paged_attention(**batch, sliding_window=sliding_window)
    actual = _run_backend(batch, 16, sliding_window, TorchAttentionBackend())
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("has_16bit_gemm", [True, False])
def test_bfloat16_decodes_multiply_in_float32_where_the_cpu_has_no_bfloat16_gemm(
    has_16bit_gemm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's bfloat16 matmul is a generic loop without bfloat16 GEMM instructions, so
    decodes gather and multiply in float32 there, and still return bfloat16 rows."""
    monkeypatch.setattr(torch_backend, "onednn_linear_available", lambda dtype: has_16bit_gemm)
    torch.manual_seed(5)
    batch = make_batch(
        (1, 1, 1, 1, 1),
        (100, 90, 130, 64, 70),
        2,
        3,
        64,
        16,
        torch.bfloat16,
        "cpu",
        unused_fill=1e4,
    )
    batch["block_tables"][1:4, :4] = batch["block_tables"][0, :4]  # a cascade too
    backend = TorchAttentionBackend()
    actual = _run_backend(batch, 16, None, backend)
    assert actual.dtype == torch.bfloat16
    assert set(backend._workspaces) == {torch.bfloat16 if has_16bit_gemm else torch.float32}
    expected = reference.paged_attention(**batch)
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_matches_reference(cache_dtype: torch.dtype) -> None:
    """An fp8 cache with scales, in a batch of decodes (five sharing a prefix, attended
    once), prefills fresh and chunked: every query, a fresh prefill's included, attends to
    the keys and values as the cache stores them, as the reference does."""
    torch.manual_seed(4)
    k_scale, v_scale = 0.3, 1.7
    batch = make_batch(
        (1, 1, 1, 1, 1, 1, 40, 9),
        (100, 90, 130, 64, 70, 150, 0, 30),
        2,
        3,
        64,
        16,
        torch.float32,
        "cpu",
        unused_fill=1e4,
    )
    batch["block_tables"][1:5, :4] = batch["block_tables"][0, :4]
    batch["key_cache"] = reference.quantize(batch["key_cache"], cache_dtype, k_scale)
    batch["value_cache"] = reference.quantize(batch["value_cache"], cache_dtype, v_scale)
    backend = TorchAttentionBackend()
    actual = _run_backend(batch, 16, None, backend, k_scale, v_scale)
    assert backend.prepare(_metadata_of(batch, 16)).decodes.shared_prefix is not None
    expected = reference.paged_attention(**batch, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"]
)
@pytest.mark.parametrize("chunk_bytes", [1, 2**30], ids=["one-per-chunk", "one-chunk"])
def test_decodes_sharing_a_prefix_attend_to_it_once(
    chunk_bytes: int, dtype: torch.dtype, tolerance: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five decodes whose tables start with the same 4 blocks (a prefix-cache hit), one
    that does not, and a prefill: the shared prefix is gathered once and merged (in
    float32, written back in the query's dtype: a bfloat16 cascade once failed there)."""
    monkeypatch.setattr(torch_backend, "_CHUNK_GATHER_BYTES", chunk_bytes)
    torch.manual_seed(3)
    block_size, shared_blocks = 16, 4
    batch = make_batch(
        (1, 1, 1, 1, 1, 1, 20),
        (100, 90, 130, 64, 70, 150, 30),
        2,
        3,
        64,
        block_size,
        dtype,
        "cpu",
        unused_fill=1e4,
    )
    tables = batch["block_tables"]
    tables[1:5, :shared_blocks] = tables[0, :shared_blocks]
    backend = TorchAttentionBackend()
    actual = _run_backend(batch, block_size, None, backend)
    expected = reference.paged_attention(**batch)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
    shared_prefix = backend.prepare(_metadata_of(batch, block_size)).decodes.shared_prefix
    assert shared_prefix is not None
    assert shared_prefix.block_ids.tolist() == tables[0, :shared_blocks].tolist()
    assert len(shared_prefix.token_idx) == 5
