import pytest
import torch

from csrc_triton import reference, store_kv


def run_both(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    block_size: int,
    num_skipped: int,
    slot_dtype: torch.dtype,
    dtype: torch.dtype,
    device: str,
) -> None:
    """Store the same fused-qkv views with the kernel and the reference; caches must agree."""
    # Distinct random slots, with `num_skipped` tokens marked -1 (padding).
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_mapping[torch.randperm(num_tokens)[:num_skipped]] = -1
    slot_mapping = slot_mapping.to(device, slot_dtype)
    # Key and value are strided views of a fused qkv projection output.
    num_heads = 2 * num_kv_heads
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    _, key, value = qkv.to(device).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    # Random initial contents show that skipped and unmapped slots are left alone.
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    value_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()

    store_kv(key, value, key_cache, value_cache, slot_mapping)
    reference.store_kv(key, value, expected_key_cache, expected_value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_key_cache)
    assert torch.equal(value_cache, expected_value_cache)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (1, 128), (3, 80)])
def test_matches_reference(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, slot_dtype: torch.dtype, device: str
) -> None:
    torch.manual_seed(0)
    run_both(11, num_kv_heads, head_dim, 6, 4, 3, slot_dtype, dtype, device)


@pytest.mark.gpu
def test_large_bf16(device: str) -> None:
    torch.manual_seed(1)
    run_both(8192, 8, 128, 4096, 16, 100, torch.int64, torch.bfloat16, device)
