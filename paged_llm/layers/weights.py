"""Checkpoint tensors read in the parts a tensor-parallel rank keeps."""

from __future__ import annotations

from typing import Any

import torch


class CheckpointTensor:
    """One tensor of a checkpoint, not read until a rank asks for its rows or columns.

    ``source`` is a safetensors slice (read lazily from the file) or a tensor.
    """

    def __init__(self, name: str, source: Any) -> None:
        self.name = name
        self._source = source
        shape = source.shape if isinstance(source, torch.Tensor) else source.get_shape()
        self.shape = tuple(shape)

    def read(
        self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """The whole tensor, or ``rows=(start, size)`` / ``cols=(start, size)`` of it."""
        row_part = slice(None) if rows is None else slice(rows[0], rows[0] + rows[1])
        if cols is None:
            return self._source[row_part]
        return self._source[row_part, cols[0] : cols[0] + cols[1]]

    def check_shape(self, expected: tuple[int, ...]) -> None:
        if self.shape != expected:
            raise ValueError(
                f"Checkpoint weight {self.name!r} has shape {self.shape}, the model expects "
                f"{expected}."
            )
