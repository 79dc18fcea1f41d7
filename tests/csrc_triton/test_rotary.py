from collections.abc import Callable

import pytest
import torch

from csrc_triton import apply_rotary, reference


def make_cos_sin_cache(max_position: int, head_dim: int, device: str) -> torch.Tensor:
    """``[max_position, head_dim]`` fp32: cos in the first half of each row, sin in the second."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)


def run_both(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    assert_close: Callable,
) -> None:
    """Rotate the q and k views of one fused qkv tensor with the kernel and the reference."""
    max_position = 4 * num_tokens
    cos_sin_cache = make_cos_sin_cache(max_position, head_dim, device)
    positions = torch.randint(0, max_position, (num_tokens,), device=device)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    qkv = qkv.to(device)
    expected_qkv = qkv.clone()
    for fused in (qkv, expected_qkv):
        query, key = fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads]
        rotate = apply_rotary if fused is qkv else reference.apply_rotary
        rotate(query, key, positions, cos_sin_cache)
    # The value slice must come through untouched, so the whole fused tensor is compared.
    assert_close(qkv, expected_qkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_matches_reference(
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: str,
    assert_close: Callable,
) -> None:
    torch.manual_seed(0)
    run_both(7, num_heads, num_kv_heads, head_dim, dtype, device, assert_close)


@pytest.mark.gpu
def test_large_bf16(device: str, assert_close: Callable) -> None:
    torch.manual_seed(1)
    run_both(8192, 32, 8, 128, torch.bfloat16, device, assert_close)
