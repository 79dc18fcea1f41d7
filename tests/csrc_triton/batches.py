"""Random paged-attention batches shared by the kernel and backend tests."""

from __future__ import annotations

import torch


def make_batch(
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    num_kv_heads: int,
    num_queries_per_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    num_padding_tokens: int = 0,
    unused_fill: float = float("nan"),
) -> dict:
    """Random ``paged_attention`` arguments over a cache whose unused slots all hold
    ``unused_fill``.

    Sequences get blocks 1.. in a random order; block 0 (where a masked block-table load
    lands) is never allocated, and block-table entries past a sequence's last block are -1.
    So with NaN (the default) a key or value read outside a sequence's context turns the
    output into NaN.
    """
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    block_ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), -1)
    for seq, num_seq_blocks in enumerate(blocks_per_seq):
        block_tables[seq, :num_seq_blocks] = torch.tensor(block_ids[:num_seq_blocks])
        del block_ids[:num_seq_blocks]

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, unused_fill, dtype=dtype)
    value_cache = torch.full(cache_shape, unused_fill, dtype=dtype)
    for seq, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        blocks = block_tables[seq, positions // block_size]
        offsets = positions % block_size
        key_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)
        value_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)

    num_heads = num_kv_heads * num_queries_per_kv
    num_tokens = sum(query_lens) + num_padding_tokens
    # A strided view, as the attention layer gets it from a fused qkv projection.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    query_start_loc = torch.tensor([0, *query_lens]).cumsum(0)
    return {
        "query": qkv[:, :num_heads].to(device),
        "key_cache": key_cache.to(device),
        "value_cache": value_cache.to(device),
        "block_tables": block_tables.to(device, torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "query_start_loc": query_start_loc.to(device, torch.int32),
        "max_query_len": max(query_lens),
        "max_seq_len": max(seq_lens),
        "scale": head_dim**-0.5,
    }
