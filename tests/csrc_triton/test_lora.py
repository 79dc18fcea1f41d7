from collections.abc import Callable

import pytest
import torch

from csrc_triton import lora_expand, lora_shrink, reference

MAX_LORAS = 3

# (kind, dtype) of token_slots: no token with an adapter, every token with the same one, and a
# random mix of all slots and -1.
SLOT_MIXES = [("none", torch.int32), ("one", torch.int64), ("mixed", torch.int32)]


def _token_slots(kind: str, num_tokens: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    if kind == "none":
        slots = torch.full((num_tokens,), -1)
    elif kind == "one":
        slots = torch.full((num_tokens,), 1)
    else:
        slots = torch.randint(-1, MAX_LORAS, (num_tokens,))
        slots[: MAX_LORAS + 1] = torch.arange(-1, MAX_LORAS)[: len(slots)]
    return slots.to(device, dtype)


def _zero_past_rank(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (rank on dim 2) with slot 1's adapter of half the rank: zero past it, as a
    stacked adapter of a lower rank is."""
    weight[1, :, weight.shape[2] // 2 :] = 0
    return weight


def _lora_a(
    num_slices: int, max_rank: int, in_features: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    lora_a = torch.randn(MAX_LORAS, num_slices, max_rank, in_features) * 0.1
    return _zero_past_rank(lora_a).to(device, dtype)


def _lora_b(out_features: int, max_rank: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    lora_b = torch.randn(MAX_LORAS, out_features, max_rank) * 0.1
    return _zero_past_rank(lora_b).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("slots", "slot_dtype"), SLOT_MIXES, ids=[m[0] for m in SLOT_MIXES])
# Ranks 8 and 16, a rank the kernel pads to a power of two (12), and rank 64, whose tile
# loops over in_features more than once; in_features not a multiple of the tile.
@pytest.mark.parametrize(
    ("num_tokens", "in_features", "num_slices", "max_rank"),
    [(1, 64, 1, 8), (12, 70, 3, 16), (7, 40, 2, 12), (5, 96, 1, 64)],
)
def test_shrink_matches_reference(
    num_tokens: int,
    in_features: int,
    num_slices: int,
    max_rank: int,
    slots: str,
    slot_dtype: torch.dtype,
    dtype: torch.dtype,
    device: str,
    assert_close: Callable,
) -> None:
    torch.manual_seed(0)
    # A strided row slice: the kernel must not assume contiguous rows.
    x = torch.randn(2 * num_tokens, in_features, device=device).to(dtype)[::2]
    lora_a = _lora_a(num_slices, max_rank, in_features, dtype, device)
    token_slots = _token_slots(slots, num_tokens, slot_dtype, device)
    # NaN-filled: every element must be written, zeros included.
    out = torch.full((num_slices, num_tokens, max_rank), float("nan"), device=device)
    expected = torch.empty_like(out)

    lora_shrink(x, lora_a, token_slots, out)
    reference.lora_shrink(x, lora_a, token_slots, expected)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("slots", "slot_dtype"), SLOT_MIXES, ids=[m[0] for m in SLOT_MIXES])
# One slice over all rows; three uneven ones (a packed qkv projection); rank 64 over slices
# wider than its tile.
@pytest.mark.parametrize(
    ("num_tokens", "slice_offsets", "out_features", "max_rank"),
    [
        (1, (0, 64), 64, 8),
        (12, (0, 48, 64, 80), 80, 16),
        (7, (0, 30, 50), 50, 12),
        (5, (0, 96, 160), 160, 64),
    ],
)
def test_expand_matches_reference(
    num_tokens: int,
    slice_offsets: tuple[int, ...],
    out_features: int,
    max_rank: int,
    slots: str,
    slot_dtype: torch.dtype,
    dtype: torch.dtype,
    device: str,
    assert_close: Callable,
) -> None:
    torch.manual_seed(0)
    h = torch.randn(len(slice_offsets) - 1, num_tokens, max_rank, device=device)
    lora_b = _lora_b(out_features, max_rank, dtype, device)
    token_slots = _token_slots(slots, num_tokens, slot_dtype, device)
    # A column slice of a wider tensor: the kernel must not assume contiguous rows.
    out = torch.randn(num_tokens, out_features + 8, device=device).to(dtype)[:, :out_features]
    expected = out.clone()

    lora_expand(h, lora_b, token_slots, slice_offsets, out)
    reference.lora_expand(h, lora_b, token_slots, slice_offsets, expected)
    assert_close(out, expected)


def test_expand_leaves_tokens_without_adapter_and_rows_outside_slices_unchanged(
    device: str,
) -> None:
    torch.manual_seed(0)
    num_tokens, out_features, max_rank = 6, 80, 16
    # Rows 0:8 and 56:80 belong to no slice; the middle slice is empty.
    slice_offsets = (8, 40, 40, 56)
    h = torch.randn(3, num_tokens, max_rank, device=device)
    lora_b = _lora_b(out_features, max_rank, torch.float32, device)
    token_slots = torch.tensor([0, -1, 2, -1, 1, 0], device=device)
    out = torch.randn(num_tokens, out_features, device=device)
    before = out.clone()

    lora_expand(h, lora_b, token_slots, slice_offsets, out)
    adapted = token_slots >= 0
    assert torch.equal(out[~adapted], before[~adapted])
    assert torch.equal(out[:, :8], before[:, :8])
    assert torch.equal(out[:, 56:], before[:, 56:])
    assert not torch.equal(out[adapted, 8:56], before[adapted, 8:56])


def test_shrink_then_expand_adds_each_tokens_low_rank_update(
    device: str, assert_close: Callable
) -> None:
    torch.manual_seed(0)
    num_tokens, in_features, max_rank = 5, 24, 8
    slice_offsets = (0, 16, 24, 32)
    x = torch.randn(num_tokens, in_features, device=device)
    lora_a = _lora_a(3, max_rank, in_features, torch.float32, device)
    lora_b = _lora_b(32, max_rank, torch.float32, device)
    token_slots = torch.tensor([2, -1, 0, 1, 2], device=device)
    base = torch.randn(num_tokens, 32, device=device)
    h = torch.empty(3, num_tokens, max_rank, device=device)
    out = base.clone()

    lora_shrink(x, lora_a, token_slots, h)
    lora_expand(h, lora_b, token_slots, slice_offsets, out)
    expected = base.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for s in range(3):
            start, end = slice_offsets[s], slice_offsets[s + 1]
            expected[t, start:end] += x[t] @ lora_a[slot, s].T @ lora_b[slot, start:end].T
    assert_close(out, expected)


def test_expand_refuses_slices_past_out_features(device: str) -> None:
    h = torch.zeros(2, 3, 8, device=device)
    lora_b = torch.zeros(MAX_LORAS, 32, 8, device=device)
    token_slots = torch.zeros(3, dtype=torch.int32, device=device)
    out = torch.zeros(3, 32, device=device)
    with pytest.raises(ValueError, match="past out_features=32"):
        lora_expand(h, lora_b, token_slots, (0, 16, 40), out)
    with pytest.raises(ValueError, match="non-decreasing"):
        lora_expand(h, lora_b, token_slots, (0, 16, 8), out)


@pytest.mark.gpu
def test_large_bf16(device: str, assert_close: Callable) -> None:
    torch.manual_seed(1)
    num_tokens, in_features, slice_size, max_rank, max_loras = 4096, 4096, 1024, 16, 8
    slice_offsets = (0, slice_size, 2 * slice_size, 3 * slice_size)
    x = torch.randn(num_tokens, in_features, dtype=torch.bfloat16, device=device)
    lora_a = torch.randn(max_loras, 3, max_rank, in_features, device=device) * 0.02
    lora_b = torch.randn(max_loras, 3 * slice_size, max_rank, device=device) * 0.02
    lora_a, lora_b = lora_a.to(torch.bfloat16), lora_b.to(torch.bfloat16)
    token_slots = torch.randint(-1, max_loras, (num_tokens,), device=device)
    h = torch.empty(3, num_tokens, max_rank, device=device)
    expected_h = torch.empty_like(h)
    out = torch.randn(num_tokens, 3 * slice_size, dtype=torch.bfloat16, device=device)
    expected = out.clone()

    lora_shrink(x, lora_a, token_slots, h)
    reference.lora_shrink(x, lora_a, token_slots, expected_h)
    assert_close(h, expected_h, torch.bfloat16)
    lora_expand(expected_h, lora_b, token_slots, slice_offsets, out)
    reference.lora_expand(expected_h, lora_b, token_slots, slice_offsets, expected)
    assert_close(out, expected)


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_for_new_slots(device: str, assert_close: Callable) -> None:
    torch.manual_seed(2)
    num_tokens, in_features, max_rank = 64, 256, 16
    slice_offsets = (0, 128, 160, 192)
    x = torch.randn(num_tokens, in_features, dtype=torch.bfloat16, device=device)
    lora_a = _lora_a(3, max_rank, in_features, torch.bfloat16, device)
    lora_b = _lora_b(192, max_rank, torch.bfloat16, device)
    token_slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
    base = torch.randn(num_tokens, 192, dtype=torch.bfloat16, device=device)
    h = torch.empty(3, num_tokens, max_rank, device=device)
    out = base.clone()

    def step() -> None:
        lora_shrink(x, lora_a, token_slots, h)
        lora_expand(h, lora_b, token_slots, slice_offsets, out)

    # Compiled before the capture, which cannot compile.
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for slots in ("none", "mixed"):
        token_slots.copy_(_token_slots(slots, num_tokens, torch.int32, device))
        out.copy_(base)
        graph.replay()
        expected_h = torch.empty_like(h)
        expected = base.clone()
        reference.lora_shrink(x, lora_a, token_slots, expected_h)
        reference.lora_expand(expected_h, lora_b, token_slots, slice_offsets, expected)
        assert_close(h, expected_h, torch.bfloat16)
        assert_close(out, expected)
