"""Rotary through csrc_cpu's C++ kernel against torch's operators (transformers'
rounding), on the query and key views of one fused qkv output."""

from __future__ import annotations

import pytest
import torch

from paged_llm.layers.kernels import ElementwiseKernels
from paged_llm.layers.rotary import RotaryEmbedding

PARAMS = {"rope_type": "default", "rope_theta": 10000.0}


pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_kernel_rotates_in_place_with_torchs_roundings(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """Bit-identical in every dtype (each product and sum rounded where torch rounds it,
    no fused multiply-add), the value slice untouched."""
    torch.manual_seed(head_dim + num_heads)
    num_tokens = 37  # more than one task's worth of tokens at head_dim 128
    positions = torch.randint(0, 4096, (num_tokens,))
    torch_rotary = RotaryEmbedding(head_dim, 4096, PARAMS, "cpu", ElementwiseKernels.TORCH)
    kernel_rotary = RotaryEmbedding(head_dim, 4096, PARAMS, "cpu", ElementwiseKernels.CPU)
    qkv = (torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim) * 4).to(dtype)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    expected_query, expected_key = torch_rotary(
        torch_rotary.step_rotation(positions, dtype), query.clone(), key.clone()
    )
    value = qkv[:, num_heads + num_kv_heads :].clone()
    rotated_query, rotated_key = kernel_rotary(
        kernel_rotary.step_rotation(positions, dtype), query, key
    )
    assert rotated_query.data_ptr() == query.data_ptr()
    assert torch.equal(rotated_query, expected_query)
    assert torch.equal(rotated_key, expected_key)
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], value)
