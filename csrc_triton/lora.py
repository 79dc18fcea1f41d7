"""Multi-LoRA kernels (punica's BGMV): the low-rank update ``x @ A.T @ B.T`` of many
adapters over one flat batch of tokens.

A LoRA layer adds ``(x @ A[slot].T) @ B[slot].T`` to its base output, with ``slot`` the
adapter of each token. :func:`lora_shrink` projects the input down to the rank axis,
one ``[T, max_rank]`` float32 block per slice of a packed projection (q/k/v, gate/up);
:func:`lora_expand` projects it back up and adds it to the slices' columns of the output.

Each program gathers its token's adapter from the stacked weights (a matrix-vector product
per token), so one launch serves any mix of adapters and tokens without an adapter, with
no sort by adapter, no host synchronisation and no shape that depends on the data: both
kernels can be captured in a CUDA graph and replayed for any assignment of slots.
"""

from itertools import pairwise

import torch
import triton
import triton.language as tl

# Elements of a weight tile per program: [RANK_PAD, BLOCK] with a power-of-two rank axis.
# 4096 float32 products are 32 registers a thread at 4 warps.
_TILE_ELEMENTS = 4096
_TOKEN_SLOT_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    lora_a_ptr,
    token_slots_ptr,
    out_ptr,
    in_features,
    max_rank,
    stride_x_t,
    stride_x_k,
    stride_a_l,
    stride_a_s,
    stride_a_r,
    stride_a_k,
    stride_slots_t,
    stride_o_s,
    stride_o_t,
    stride_o_r,
    RANK_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # int64: token * stride can exceed 2**31 in a large batch.
    token = tl.program_id(0).to(tl.int64)
    slice_id = tl.program_id(1)
    ranks = tl.arange(0, RANK_PAD)
    rank_mask = ranks < max_rank
    out_ptrs = out_ptr + slice_id * stride_o_s + token * stride_o_t + ranks * stride_o_r
    slot = tl.load(token_slots_ptr + token * stride_slots_t).to(tl.int64)
    # NOTE: the output is written for every token, so expand may read any row of it.
    if slot < 0:
        tl.store(out_ptrs, tl.zeros((RANK_PAD,), dtype=tl.float32), mask=rank_mask)
        return
    a_ptr = lora_a_ptr + slot * stride_a_l + slice_id * stride_a_s + ranks[:, None] * stride_a_r
    ks = tl.arange(0, BLOCK_K)
    # Partial sums stay per column and are reduced once, after the loop over in_features.
    acc = tl.zeros((RANK_PAD, BLOCK_K), dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        k = k_start + ks
        k_mask = k < in_features
        x = tl.load(x_ptr + token * stride_x_t + k * stride_x_k, mask=k_mask, other=0.0)
        a = tl.load(
            a_ptr + k[None, :] * stride_a_k,
            mask=rank_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptrs, tl.sum(acc, axis=1), mask=rank_mask)


@triton.jit
def _lora_expand_kernel(
    h_ptr,
    lora_b_ptr,
    token_slots_ptr,
    out_ptr,
    slice_offsets,
    max_rank,
    stride_h_s,
    stride_h_t,
    stride_h_r,
    stride_b_l,
    stride_b_n,
    stride_b_r,
    stride_slots_t,
    stride_o_t,
    stride_o_n,
    NUM_SLICES: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token * stride_slots_t).to(tl.int64)
    if slot < 0:
        return
    tile = tl.program_id(1)
    slice_id = tl.program_id(2)
    # The slice's bounds come in as scalars (a tuple of ints), not a device tensor: building
    # one per call would copy from the host, which a CUDA graph cannot capture.
    slice_start = 0
    slice_end = 0
    for i in tl.static_range(NUM_SLICES):
        slice_start = tl.where(slice_id == i, slice_offsets[i], slice_start)
        slice_end = tl.where(slice_id == i, slice_offsets[i + 1], slice_end)
    cols = slice_start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < slice_end
    ranks = tl.arange(0, RANK_PAD)
    rank_mask = ranks < max_rank
    h = tl.load(
        h_ptr + slice_id * stride_h_s + token * stride_h_t + ranks * stride_h_r,
        mask=rank_mask,
        other=0.0,
    )
    b = tl.load(
        lora_b_ptr + slot * stride_b_l + cols[:, None] * stride_b_n + ranks[None, :] * stride_b_r,
        mask=col_mask[:, None] & rank_mask[None, :],
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    out_ptrs = out_ptr + token * stride_o_t + cols * stride_o_n
    base = tl.load(out_ptrs, mask=col_mask)
    # The update is rounded to the output dtype before the add, like
    # ``out += delta.to(out.dtype)`` in torch.
    updated = base.to(tl.float32) + delta.to(base.dtype).to(tl.float32)
    tl.store(out_ptrs, updated.to(base.dtype), mask=col_mask)


def _check_token_slots(token_slots: torch.Tensor, num_tokens: int) -> None:
    if token_slots.shape != (num_tokens,) or token_slots.dtype not in _TOKEN_SLOT_DTYPES:
        raise ValueError(
            f"token_slots must be [{num_tokens}] int32 or int64, got shape "
            f"{tuple(token_slots.shape)} and dtype {token_slots.dtype}"
        )


def _block(rank_pad: int, features: int) -> int:
    """The tile's feature axis: ``_TILE_ELEMENTS // rank_pad``, no wider than ``features``
    (padded to a power of two)."""
    features_pad: int = triton.next_power_of_2(features)
    return min(max(16, _TILE_ELEMENTS // rank_pad), features_pad)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out[s, t] = x[t] @ lora_a[token_slots[t], s].T``: each token's input projected by its
    adapter's A matrices, accumulated in float32.

    Args:
        x: ``[T, in_features]`` float32, bfloat16 or float16; any strides.
        lora_a: ``[max_loras, num_slices, max_rank, in_features]`` in the dtype of ``x``;
            an adapter of a lower rank is zero past its rank.
        token_slots: ``[T]`` int32 or int64, the adapter slot of each token; ``-1`` for a
            token without an adapter. Other slots must lie in ``[0, max_loras)`` (not
            checked: that would synchronise with the device).
        out: ``[num_slices, T, max_rank]`` float32, written; zero for tokens of slot ``-1``.
    """
    if x.dim() != 2 or lora_a.dim() != 4 or lora_a.shape[3] != x.shape[1]:
        raise ValueError(
            "x must be [T, in_features] and lora_a [max_loras, num_slices, max_rank, "
            f"in_features], got {tuple(x.shape)} and {tuple(lora_a.shape)}"
        )
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a dtype {lora_a.dtype} != x dtype {x.dtype}")
    num_tokens, in_features = x.shape
    _, num_slices, max_rank, _ = lora_a.shape
    _check_token_slots(token_slots, num_tokens)
    if out.shape != (num_slices, num_tokens, max_rank) or out.dtype != torch.float32:
        raise ValueError(
            f"out must be [{num_slices}, {num_tokens}, {max_rank}] float32, got shape "
            f"{tuple(out.shape)} and dtype {out.dtype}"
        )
    if out.numel() == 0:
        return
    rank_pad = triton.next_power_of_2(max_rank)
    _lora_shrink_kernel[(num_tokens, num_slices)](
        x,
        lora_a,
        token_slots,
        out,
        in_features,
        max_rank,
        *x.stride(),
        *lora_a.stride(),
        token_slots.stride(0),
        *out.stride(),
        RANK_PAD=rank_pad,
        BLOCK_K=_block(rank_pad, in_features),
        num_warps=4,
    )


def lora_expand(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_offsets: tuple[int, ...],
    out: torch.Tensor,
) -> None:
    """``out[t, o0:o1] += (h[s, t] @ lora_b[token_slots[t], o0:o1].T).to(out.dtype)`` for each
    slice ``s`` with bounds ``o0, o1 = slice_offsets[s], slice_offsets[s + 1]``; accumulated
    in float32, rounded to ``out.dtype`` before the add.

    Args:
        h: ``[num_slices, T, max_rank]`` float32, as :func:`lora_shrink` writes it.
        lora_b: ``[max_loras, out_features, max_rank]`` in the dtype of ``out``; an adapter of
            a lower rank is zero past its rank.
        token_slots: ``[T]`` int32 or int64, the adapter slot of each token; ``-1`` leaves the
            token's row of ``out`` untouched. Other slots must lie in ``[0, max_loras)``.
        slice_offsets: ``num_slices + 1`` non-negative, non-decreasing row bounds of the
            slices in ``out_features`` (e.g. ``(0, q, q + kv, q + 2 * kv)`` for a packed qkv
            projection); columns outside ``slice_offsets[0]:slice_offsets[-1]`` are untouched.
        out: ``[T, out_features]``, updated in place; any strides.
    """
    num_slices = len(slice_offsets) - 1
    if h.dim() != 3 or lora_b.dim() != 3 or out.dim() != 2:
        raise ValueError(
            "h must be [num_slices, T, max_rank], lora_b [max_loras, out_features, max_rank] "
            f"and out [T, out_features], got {tuple(h.shape)}, {tuple(lora_b.shape)} and "
            f"{tuple(out.shape)}"
        )
    num_tokens, out_features = out.shape
    max_rank = lora_b.shape[2]
    if h.shape != (num_slices, num_tokens, max_rank) or h.dtype != torch.float32:
        raise ValueError(
            f"h must be [{num_slices}, {num_tokens}, {max_rank}] float32, got shape "
            f"{tuple(h.shape)} and dtype {h.dtype}"
        )
    if lora_b.shape[1] != out_features or lora_b.dtype != out.dtype:
        raise ValueError(
            f"lora_b must be [max_loras, {out_features}, max_rank] in {out.dtype}, got shape "
            f"{tuple(lora_b.shape)} and dtype {lora_b.dtype}"
        )
    _check_token_slots(token_slots, num_tokens)
    widths = [end - start for start, end in pairwise(slice_offsets)]
    if num_slices < 1 or slice_offsets[0] < 0 or min(widths) < 0:
        raise ValueError(f"slice_offsets must be non-decreasing from >= 0, got {slice_offsets}")
    if slice_offsets[-1] > out_features:
        raise ValueError(
            f"slice_offsets end at {slice_offsets[-1]}, past out_features={out_features}"
        )
    if num_tokens == 0 or max_rank == 0 or max(widths) == 0:
        return
    rank_pad = triton.next_power_of_2(max_rank)
    block_n = _block(rank_pad, max(widths))
    _lora_expand_kernel[(num_tokens, triton.cdiv(max(widths), block_n), num_slices)](
        h,
        lora_b,
        token_slots,
        out,
        tuple(slice_offsets),
        max_rank,
        *h.stride(),
        *lora_b.stride(),
        token_slots.stride(0),
        *out.stride(),
        NUM_SLICES=num_slices,
        RANK_PAD=rank_pad,
        BLOCK_N=block_n,
        num_warps=4,
    )
