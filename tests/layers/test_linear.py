"""`Linear`'s CPU matmuls: fixed row tiles (a row's result depends on that row alone),
oneDNN packing, and bfloat16 weights multiplied in float32."""

from __future__ import annotations

import pytest
import torch

from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.layers.linear import (
    BATCH_INVARIANT_ROW_TILE,
    Linear,
    PackedLinear,
    RowShard,
    onednn_linear_available,
    prepack_for_cpu,
    use_fixed_row_tiles,
)
from paged_llm.layers.weights import CheckpointTensor


# None: torch's matmul; False: oneDNN from a packed weight; True: oneDNN from the dense
# weight (one that a tied embedding shares).
@pytest.mark.parametrize("keep_dense_weight", [None, False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_tiles_make_each_row_independent_of_its_batch(
    keep_dense_weight: bool | None, dtype: torch.dtype
) -> None:
    if keep_dense_weight is not None and not onednn_linear_available(dtype):
        pytest.skip(f"this processor has no oneDNN linear in {dtype}")
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True).to(dtype)
    if keep_dense_weight is not None:
        layer.prepack(keep_dense_weight)
    use_fixed_row_tiles(layer)
    rows = torch.randn(3 * BATCH_INVARIANT_ROW_TILE + 5, 96, dtype=dtype)
    with torch.no_grad():
        alone = torch.cat([layer(row[None]) for row in rows])
        for size in (2, 5, BATCH_INVARIANT_ROW_TILE, BATCH_INVARIANT_ROW_TILE + 1, len(rows)):
            for start in (0, 7):
                batch = rows[start : start + size]
                assert torch.equal(layer(batch), alone[start : start + len(batch)]), (size, start)
        # Tiles change how the rows are grouped, not what is computed.
        layer.row_tile = None
        torch.testing.assert_close(layer(rows), alone)


def test_a_shared_weight_is_multiplied_in_place_and_a_packed_one_drops_its_dense_copy() -> None:
    if not onednn_linear_available(torch.float32):
        pytest.skip("this processor has no oneDNN linear in float32")
    torch.manual_seed(0)
    shared, owned = Linear(96, 200, bias=False), Linear(96, 200, bias=False)
    owned.weight.data.copy_(shared.weight)
    rows = torch.randn(9, 96)
    with torch.no_grad():
        expected = shared(rows)
        shared.prepack(keep_dense_weight=True)
        owned.prepack(keep_dense_weight=False)
        assert shared.onednn_weight is not None
        assert shared.onednn_weight.data_ptr() == shared.weight.data_ptr()
        assert owned.weight.numel() == 0
        torch.testing.assert_close(shared(rows), expected)
        torch.testing.assert_close(owned(rows), expected)


@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_weights_multiply_in_float32_from_a_few_rows(bias: bool) -> None:
    """On a processor without bfloat16 GEMMs a bfloat16 layer converts its weight to float32
    in chunks (the 600 output rows cross chunk boundaries); a lone row keeps the bfloat16
    kernel. Either way the result is the exact product rounded to bfloat16, give or take
    the order of the float32 additions."""
    torch.manual_seed(0)
    layer = Linear(96, 600, bias=bias).to(torch.bfloat16)
    if onednn_linear_available(torch.bfloat16):
        # There prepack_for_cpu packs the weight for oneDNN's bfloat16 GEMM instead; the
        # float32 path is switched on by hand, so that every CPU tests it.
        layer.float32_gemm = True
    else:
        prepack_for_cpu(layer, torch.bfloat16)
        assert layer.float32_gemm
    rows = torch.randn(17, 96, dtype=torch.bfloat16)
    exact = rows.double() @ layer.weight.double().T
    if bias:
        exact += layer.bias.double()
    with torch.no_grad():
        for batch in (rows[:1], rows[:4], rows):
            out = layer(batch)
            assert out.dtype == torch.bfloat16 and out.shape == (len(batch), 600)
            # One bfloat16 rounding of the exact result, at most.
            torch.testing.assert_close(out.double(), exact[: len(batch)], rtol=2**-8, atol=1e-5)
        assert torch.equal(
            layer(rows[:1]), torch.nn.functional.linear(rows[:1], layer.weight, layer.bias)
        )


def test_a_packed_projection_takes_only_a_checkpoint_tensor_of_its_whole_shape() -> None:
    """A rank's rows of a projection are checked against the whole tensor: 64 rows hold the
    32 asked for, and were taken before, as heads of the wrong size."""
    layer = PackedLinear(64, [RowShard(0, 32, 32)], bias=True)
    with pytest.raises(ValueError, match=r"'q' has shape \(64, 64\).* expects \(32, 64\)"):
        layer.load_weight(layer.weight, CheckpointTensor("q", torch.zeros(64, 64)), 0)
    with pytest.raises(ValueError, match=r"'q' has shape \(32, 48\).* expects \(32, 64\)"):
        layer.load_weight(layer.weight, CheckpointTensor("q", torch.zeros(32, 48)), 0)
    with pytest.raises(ValueError, match=r"'q.bias' has shape \(33,\).* expects \(32,\)"):
        layer.load_weight(layer.bias, CheckpointTensor("q.bias", torch.zeros(33)), 0)
    weight, bias = torch.randn(32, 64), torch.randn(32)
    layer.load_weight(layer.weight, CheckpointTensor("q", weight), 0)
    layer.load_weight(layer.bias, CheckpointTensor("q.bias", bias), 0)
    assert torch.equal(layer.weight, weight)
    assert torch.equal(layer.bias, bias)


@pytest.mark.parametrize(
    ("num_heads", "rank", "expected"),
    # 4 heads of 8 over 2 ranks: 2 each; 1 head over 2 ranks: replicated on both.
    [(4, 1, RowShard(16, 16, 32)), (1, 1, RowShard(0, 8, 8))],
)
def test_a_rank_keeps_whole_heads_of_the_whole_projection(
    num_heads: int, rank: int, expected: RowShard
) -> None:
    tp = TensorParallelGroup(rank=rank, size=2)
    assert RowShard.of_heads(tp, num_heads, head_dim=8)[0] == expected
