"""Plain torch versions of the kernels: slow, obviously correct, used as test oracles."""

from itertools import pairwise

import torch
import torch.nn.functional as F

from csrc_triton.fp8 import FP8_FORMATS


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x / scale`` in ``dtype`` as the cache stores it: multiplied by the float32
    reciprocal of the scale, saturated to an fp8 format's range, rounded by torch's cast."""
    scaled = x.float() * torch.tensor(1.0 / scale, dtype=torch.float32)
    if dtype in FP8_FORMATS:
        scaled = scaled.clamp(-FP8_FORMATS[dtype].max, FP8_FORMATS[dtype].max)
    return scaled.to(dtype)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Reference for :func:`csrc_triton.store_kv`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # NOTE: through uint8 views: CPU index assignment is not implemented for float8.
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        stored = quantize(x[keep], cache.dtype, scale)
        cache.flatten(0, 1).view(torch.uint8)[slots] = stored.view(torch.uint8)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Reference for :func:`csrc_triton.paged_attention`: one dense masked softmax per sequence
    over the dequantized keys and values (``cache * scale``)."""
    block_size = key_cache.shape[1]
    num_queries_per_kv = query.shape[1] // key_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    for seq in range(block_tables.shape[0]):
        q_start, q_end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        seq_len = int(seq_lens[seq])
        k_pos = torch.arange(seq_len, device=query.device)
        blocks = block_tables[seq, k_pos // block_size].long()
        key = key_cache[blocks, k_pos % block_size].float() * k_scale
        value = value_cache[blocks, k_pos % block_size].float() * v_scale
        key = key.repeat_interleave(num_queries_per_kv, dim=1)
        value = value.repeat_interleave(num_queries_per_kv, dim=1)

        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
        scores = torch.einsum("qhd,khd->hqk", query[q_start:q_end].float(), key) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, value).to(out.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference for :func:`csrc_triton.rms_norm`: HF LlamaRMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`csrc_triton.fused_add_rms_norm` (returns a new residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def apply_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Reference for :func:`csrc_triton.apply_rotary`: HF rotate_half in fp32, in place."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (query, key):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`csrc_triton.silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`csrc_triton.weight_only_matmul`: dequantize, then multiply in
    float32."""
    dequantized = weight.to(torch.float32) * scale.to(torch.float32)[:, None]
    return (x.to(torch.float32) @ dequantized.T).to(x.dtype)


def group_quantized_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """Reference for :func:`csrc_triton.group_quantized_matmul`: unpack the codes,
    dequantize in float32, round the weight to the activations' dtype, multiply in
    float32."""
    if codes.dtype == torch.uint8:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(1)
    groups = torch.arange(codes.shape[1], device=codes.device) // group_size
    weight = codes.to(torch.float32) * scale.float()[:, groups]
    if offset is not None:
        weight = weight + offset.float()[:, groups]
    weight = weight.to(x.dtype).to(torch.float32)
    return (x.to(torch.float32) @ weight.T).to(x.dtype)


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """Reference for :func:`csrc_triton.lora_shrink`: one float32 matmul per adapter slot over
    its tokens; zeros for tokens without an adapter."""
    out.zero_()
    for slot in range(lora_a.shape[0]):
        rows = token_slots == slot
        out[:, rows] = torch.einsum("tk,srk->str", x[rows].float(), lora_a[slot].float())


def lora_expand(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_offsets: tuple[int, ...],
    out: torch.Tensor,
) -> None:
    """Reference for :func:`csrc_triton.lora_expand`: per adapter slot and slice, a float32
    matmul over its tokens, rounded to ``out.dtype`` and added to the slice's columns."""
    for slot in range(lora_b.shape[0]):
        rows = token_slots == slot
        for s, (start, end) in enumerate(pairwise(slice_offsets)):
            delta = h[s, rows] @ lora_b[slot, start:end].float().T
            out[rows, start:end] += delta.to(out.dtype)
