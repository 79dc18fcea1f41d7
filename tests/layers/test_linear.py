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


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_tiles_make_each_row_independent_of_its_batch(packed: bool, dtype: torch.dtype) -> None:
    if packed and not onednn_linear_available(dtype):
        pytest.skip(f"this processor has no oneDNN linear in {dtype}")
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True).to(dtype)
    if packed:
        layer.prepack(keep_dense_weight=False)
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
