from collections.abc import Callable

import pytest
import torch

from csrc_triton import paged_attention, reference
from tests.csrc_triton.batches import make_batch

# One batch mixing every kind of step: decode at a mid-block context, decode across several
# key tiles, a prefill spanning two query tiles, a chunked prefill after cached context, and a
# prefix-cache hit whose cached context ends exactly on a block boundary.
MIXED_QUERY_LENS = (1, 1, 70, 9, 3)
MIXED_CONTEXT_LENS = (37, 80, 0, 50, 16)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_queries_per_kv", [1, 2, 4])
def test_mixed_batch_matches_reference(
    num_queries_per_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    assert_close: Callable,
) -> None:
    torch.manual_seed(0)
    batch = make_batch(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 2, num_queries_per_kv, head_dim, 16, dtype, device
    )
    assert_close(paged_attention(**batch), reference.paged_attention(**batch))


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_block_sizes(block_size: int, device: str, assert_close: Callable) -> None:
    torch.manual_seed(1)
    batch = make_batch(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 2, 2, 64, block_size, torch.float32, device
    )
    assert_close(paged_attention(**batch), reference.paged_attention(**batch))


@pytest.mark.parametrize(("dtype", "num_splits"), [(torch.float32, 1), (torch.bfloat16, 3)])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_matches_reference(
    cache_dtype: torch.dtype,
    dtype: torch.dtype,
    num_splits: int,
    device: str,
    assert_close: Callable,
) -> None:
    """Keys and values read from an fp8 cache with scales; the reference dequantizes them
    first. The NaN in unused slots survives the quantization, so stray reads still show."""
    torch.manual_seed(7)
    k_scale, v_scale = 0.25, 3.0
    # Decodes, a chunked prefill and a prefix hit: MIXED_* without its long prefill.
    batch = make_batch((1, 1, 9, 3), (37, 80, 50, 16), 2, 2, 64, 16, dtype, device)
    batch["key_cache"] = reference.quantize(batch["key_cache"], cache_dtype, k_scale)
    batch["value_cache"] = reference.quantize(batch["value_cache"], cache_dtype, v_scale)
    assert_close(
        paged_attention(**batch, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale),
        reference.paged_attention(**batch, k_scale=k_scale, v_scale=v_scale),
    )


@pytest.mark.parametrize("num_queries_per_kv", [1, 4])
@pytest.mark.parametrize("sliding_window", [1, 5, 64])
def test_sliding_window(
    sliding_window: int, num_queries_per_kv: int, device: str, assert_close: Callable
) -> None:
    torch.manual_seed(2)
    batch = make_batch(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 2, num_queries_per_kv, 64, 16, torch.float32, device
    )
    assert_close(
        paged_attention(**batch, sliding_window=sliding_window),
        reference.paged_attention(**batch, sliding_window=sliding_window),
    )


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [((1, 1, 1), (37, 200, 5)), (MIXED_QUERY_LENS, MIXED_CONTEXT_LENS)],
    ids=["decode", "mixed"],
)
@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("num_splits", [2, 3, 16])
def test_split_kv(
    num_splits: int,
    sliding_window: int | None,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    device: str,
    assert_close: Callable,
) -> None:
    torch.manual_seed(3)
    batch = make_batch(query_lens, context_lens, 2, 4, 64, 16, torch.float32, device)
    assert_close(
        paged_attention(**batch, sliding_window=sliding_window, num_splits=num_splits),
        reference.paged_attention(**batch, sliding_window=sliding_window),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 80, 96])
def test_other_head_dims(
    head_dim: int, dtype: torch.dtype, device: str, assert_close: Callable
) -> None:
    torch.manual_seed(4)
    batch = make_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 2, 2, head_dim, 16, dtype, device)
    assert_close(paged_attention(**batch), reference.paged_attention(**batch))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_writes_into_out_and_skips_padding(
    num_splits: int, device: str, assert_close: Callable
) -> None:
    """CUDA-graph style padding: an empty sequence, and token rows past the last sequence."""
    torch.manual_seed(5)
    num_padding_tokens = 3
    batch = make_batch(
        (1, 0, 4), (10, 0, 3), 2, 2, 64, 16, torch.float32, device, num_padding_tokens
    )
    out = torch.full_like(batch["query"], 7.0)
    result = paged_attention(**batch, out=out, num_splits=num_splits)
    assert result is out
    num_real_tokens = out.shape[0] - num_padding_tokens
    expected = reference.paged_attention(**batch)
    assert_close(out[:num_real_tokens], expected[:num_real_tokens])
    assert torch.all(out[num_real_tokens:] == 7.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_dim": 512}, "head_dim"),
        ({"query_heads": 3}, "multiple"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
    ids=["head_dim", "gqa_ratio", "sliding_window"],
)
def test_rejects_invalid_arguments(change: dict, message: str, device: str) -> None:
    batch = make_batch((2,), (3,), 2, 2, change.get("head_dim", 64), 16, torch.float32, device)
    if "query_heads" in change:
        batch["query"] = batch["query"][:, : change["query_heads"]]
    with pytest.raises(ValueError, match=message):
        paged_attention(**batch, sliding_window=change.get("sliding_window"))


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window", [None, 512])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ((1,) * 24 + (512, 300, 1000, 7), (*range(40, 3880, 160), 0, 2000, 1500, 3000)),
        ((1, 1), (8000, 30000)),
    ],
    ids=["mixed", "long_decode"],
)
def test_large_bf16(
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    sliding_window: int | None,
    device: str,
    assert_close: Callable,
) -> None:
    """Llama-8B-like heads; the long decode batch takes the automatic split-KV path."""
    torch.manual_seed(6)
    batch = make_batch(query_lens, context_lens, 8, 4, 128, 16, torch.bfloat16, device)
    assert_close(
        paged_attention(**batch, sliding_window=sliding_window),
        reference.paged_attention(**batch, sliding_window=sliding_window),
    )
