"""`Linear`'s fixed row tiles: a row's result depends on that row alone."""

from __future__ import annotations

import pytest
import torch

from paged_llm.layers.linear import (
    BATCH_INVARIANT_ROW_TILE,
    Linear,
    onednn_linear_available,
    use_fixed_row_tiles,
)


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
