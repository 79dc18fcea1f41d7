"""LoRA-wrapped projections: each token's output is ``base(x) + x A^T B^T`` of its own
adapter (the scaling folded into B), for packed and plain, column- and row-parallel layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.layers.linear import Linear, PackedLinear, RowParallelLinear, RowShard
from paged_llm.layers.lora import LoRABatch, LoRASlots, LoRAState

IN_FEATURES = 48
MAX_LORAS = 3
MAX_RANK = 8
# Per slot: {slice index: rank}; slot 1 adapts one slice only, slot 2 has mixed ranks.
ADAPTERS = [{0: 8, 1: 8, 2: 8}, {2: 4}, {0: 2, 1: 6}]
# Per token: its slot (-1: the base model), not grouped, so the torch path gathers.
TOKEN_SLOTS = np.array([0, -1, 2, 0, 1, 1, -1, 2, 0, 1], dtype=np.int64)


def _adapter_weights(
    slice_rows: list[int], in_features: int, seed: int
) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Per slot: {slice: (A [rank, in], B [rows, rank])} of whole checkpoint projections."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            index: (
                torch.randn(rank, in_features, generator=generator),
                torch.randn(slice_rows[index], rank, generator=generator),
            )
            for index, rank in adapter.items()
        }
        for adapter in ADAPTERS
    ]


def _attach(
    layer: Linear, weights: list[dict[int, tuple[torch.Tensor, torch.Tensor]]], use_triton: bool
) -> LoRAState:
    state = LoRAState(use_triton)
    layer.lora = LoRASlots(
        state, layer.lora_shard(), MAX_LORAS, MAX_RANK, torch.float32, torch.device("cpu")
    )
    for slot, adapter in enumerate(weights):
        for index, (lora_a, lora_b) in adapter.items():
            layer.lora.load(slot, index, lora_a, lora_b)
    return state


def _expected_delta(
    x: torch.Tensor,
    weights: list[dict[int, tuple[torch.Tensor, torch.Tensor]]],
    slice_rows: list[int],
    token_slots: np.ndarray = TOKEN_SLOTS,
) -> torch.Tensor:
    """Each token's ``x A^T B^T`` of its adapter, over the whole (unsharded) projection."""
    offsets = np.cumsum([0, *slice_rows])
    delta = torch.zeros(x.shape[0], offsets[-1])
    for token, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for index, (lora_a, lora_b) in weights[slot].items():
            delta[token, offsets[index] : offsets[index + 1]] = x[token] @ lora_a.T @ lora_b.T
    return delta


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("contiguous", [False, True])
def test_a_packed_projection_adds_each_tokens_own_adapter(
    use_triton: bool, contiguous: bool
) -> None:
    slice_rows = [32, 16, 16]
    layer = PackedLinear(IN_FEATURES, [RowShard(0, rows, rows) for rows in slice_rows], bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    weights = _adapter_weights(slice_rows, IN_FEATURES, seed=0)
    state = _attach(layer, weights, use_triton)
    slots = np.sort(TOKEN_SLOTS) if contiguous else TOKEN_SLOTS
    x = torch.randn(len(slots), IN_FEATURES)
    base = layer(x)
    state.batch = LoRABatch.from_token_slots(slots, torch.device("cpu"))
    assert state.batch is not None
    assert all(isinstance(rows, slice) for _, rows in state.batch.groups) == contiguous
    expected = base + _expected_delta(x, weights, slice_rows, slots)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


def test_a_step_without_adapters_is_the_base_layer() -> None:
    layer = Linear(IN_FEATURES, 24, bias=False)
    torch.nn.init.normal_(layer.weight)
    weights = _adapter_weights([24] * 3, IN_FEATURES, seed=1)
    state = _attach(layer, [{0: adapter[0]} if 0 in adapter else {} for adapter in weights], False)
    x = torch.randn(5, IN_FEATURES)
    assert LoRABatch.from_token_slots(np.full(5, -1), torch.device("cpu")) is None
    state.batch = None
    torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_a_reloaded_slot_forgets_the_slices_of_its_previous_adapter() -> None:
    slice_rows = [32, 16, 16]
    layer = PackedLinear(IN_FEATURES, [RowShard(0, rows, rows) for rows in slice_rows], bias=False)
    torch.nn.init.normal_(layer.weight)
    weights = _adapter_weights(slice_rows, IN_FEATURES, seed=2)
    state = _attach(layer, weights, use_triton=False)
    assert layer.lora is not None
    layer.lora.clear(0)
    lora_a, lora_b = weights[1][2]
    layer.lora.load(0, 2, lora_a, lora_b)
    x = torch.randn(3, IN_FEATURES)
    state.batch = LoRABatch.from_token_slots(np.zeros(3, dtype=np.int64), torch.device("cpu"))
    expected = x @ layer.weight.T
    expected[:, 48:] += x @ lora_a.T @ lora_b.T
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


def test_two_tensor_parallel_shards_sum_to_the_whole_projection() -> None:
    """Column parallel (packed q/k/v, B cut by output rows) and row parallel (A cut by input
    columns, the partial outputs summed as the all-reduce sums them) at TP=2."""
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    slice_rows = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    packed_weights = _adapter_weights(slice_rows, IN_FEATURES, seed=3)
    # The slot's slice 0, where it has one, as its adapter of the row-parallel projection.
    row_weights = [
        {0: adapter[0]} if 0 in adapter else {}
        for adapter in _adapter_weights([IN_FEATURES] * 3, num_heads * head_dim, seed=4)
    ]
    x = torch.randn(len(TOKEN_SLOTS), IN_FEATURES)
    attended = torch.randn(len(TOKEN_SLOTS), num_heads * head_dim)
    packed_out, row_out = [], torch.zeros(len(TOKEN_SLOTS), IN_FEATURES)
    for rank in range(2):
        tp = TensorParallelGroup(rank, 2)
        q_shard, _ = RowShard.of_heads(tp, num_heads, head_dim)
        kv_shard, _ = RowShard.of_heads(tp, num_kv_heads, head_dim)
        packed = PackedLinear(IN_FEATURES, [q_shard, kv_shard, kv_shard], bias=False)
        torch.nn.init.zeros_(packed.weight)
        row = RowParallelLinear(
            num_heads * head_dim, IN_FEATURES, bias=False, tp=tp, finest_split=tp.size
        )
        torch.nn.init.zeros_(row.weight)
        for layer, weights in ((packed, packed_weights), (row, row_weights)):
            state = _attach(layer, weights, use_triton=False)
            state.batch = LoRABatch.from_token_slots(TOKEN_SLOTS, torch.device("cpu"))
        packed_out.append(packed(x).split([q_shard.size, kv_shard.size, kv_shard.size], -1))
        # NOTE: the layer's own forward would all-reduce; each rank's partial sum instead.
        row_out += row._matmul(attended[:, q_shard.start : q_shard.start + q_shard.size], None)
    whole = _expected_delta(x, packed_weights, slice_rows).split(slice_rows, -1)
    for part in range(3):
        torch.testing.assert_close(
            torch.cat([packed_out[rank][part] for rank in range(2)], -1),
            whole[part],
            atol=1e-4,
            rtol=1e-4,
        )
    torch.testing.assert_close(
        row_out, _expected_delta(attended, row_weights, [IN_FEATURES]), atol=1e-4, rtol=1e-4
    )
