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
    cache_dtype: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store the same fused-qkv views with the kernel and the reference; caches must agree
    bit for bit."""
    # Distinct random slots, with `num_skipped` tokens marked -1 (padding).
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_mapping[torch.randperm(num_tokens)[:num_skipped]] = -1
    slot_mapping = slot_mapping.to(device, slot_dtype)
    # Key and value are strided views of a fused qkv projection output.
    num_heads = 2 * num_kv_heads
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        qkv = qkv * 100
    _, key, value = qkv.to(device).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    # Random initial contents show that skipped and unmapped slots are left alone.
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache_dtype = cache_dtype or dtype
    key_cache = torch.randn(cache_shape, device=device).to(cache_dtype)
    value_cache = torch.randn(cache_shape, device=device).to(cache_dtype)
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()

    store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    reference.store_kv(
        key, value, expected_key_cache, expected_value_cache, slot_mapping, k_scale, v_scale
    )
    # NOTE: compared as bits: torch.equal is not implemented for float8 on CPU.
    assert torch.equal(key_cache.view(torch.uint8), expected_key_cache.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_value_cache.view(torch.uint8))


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (1, 128), (3, 80)])
def test_matches_reference(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, slot_dtype: torch.dtype, device: str
) -> None:
    torch.manual_seed(0)
    run_both(11, num_kv_heads, head_dim, 6, 4, 3, slot_dtype, dtype, device)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_torch_rounding(
    dtype: torch.dtype, cache_dtype: torch.dtype, device: str
) -> None:
    """Quantized stores round as torch's cast does, ties and carries into the next power of
    two included, and saturate: the inputs (randn x 100 / scale 0.3) span e4m3's largest
    value and its subnormals."""
    torch.manual_seed(0)
    run_both(40, 2, 64, 12, 4, 3, torch.int64, dtype, device, cache_dtype, 0.3, 1.7)


def test_fp8_store_rounds_every_grid_midpoint_to_even(device: str) -> None:
    """Every e4m3 value and every midpoint between neighbours, stored: the midpoints are
    the ties, and those just below a power of two carry into its exponent."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    num_tokens = values.numel() // 16
    key = values[: num_tokens * 16].view(num_tokens, 1, 16).to(device)
    caches = [torch.zeros(num_tokens, 1, 1, 16, dtype=torch.float8_e4m3fn, device=device)]
    caches += [caches[0].clone() for _ in range(3)]
    slots = torch.arange(num_tokens, device=device)
    store_kv(key, key, caches[0], caches[1], slots)
    reference.store_kv(key, key, caches[2], caches[3], slots)
    stored, expected = caches[0].view(torch.uint8).flatten(), caches[2].view(torch.uint8).flatten()
    wrong = (stored != expected).nonzero().flatten().cpu()
    inputs = key.flatten().cpu()
    assert not len(wrong), [
        (float(inputs[i]), int(stored[i]), int(expected[i])) for i in wrong[:20]
    ]


@pytest.mark.gpu
def test_large_bf16(device: str) -> None:
    torch.manual_seed(1)
    run_both(8192, 8, 128, 4096, 16, 100, torch.int64, torch.bfloat16, device)
