"""Checkpoint tensors read in the parts a tensor-parallel rank keeps, and the memory the
loaded weights take."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


class CheckpointTensor:
    """One tensor of a checkpoint, not read until a rank asks for its rows or columns.

    ``source`` is a safetensors slice (read lazily from the file) or a tensor; ``file`` is
    where it was read from, for error messages (None: given in memory, a weight update).
    """

    file: Path | None = None

    def __init__(self, name: str, source: Any, file: Path | None = None) -> None:
        self.name = name
        self._source = source
        self.file = file
        shape = source.shape if isinstance(source, torch.Tensor) else source.get_shape()
        self.shape = tuple(shape)

    def read(
        self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """The whole tensor, or ``rows=(start, size)`` / ``cols=(start, size)`` of it.

        Rows past the tensor's last are zero: the vocabulary's last tensor-parallel shard
        asks for more rows than there are tokens (a layer's `checkpoint_part` checks the
        shape first, so no other read goes past the end).
        """
        held, missing = rows_held((0, self.shape[0]) if rows is None else rows, self.shape[0])
        if cols is None:
            return zero_padded(self._source[held], missing)
        return zero_padded(self._source[held, cols[0] : cols[0] + cols[1]], missing)

    def check_shape(self, expected: tuple[int, ...]) -> None:
        """A ValueError, naming the tensor, its file and both shapes, unless the tensor has
        exactly the shape ``expected`` of the model built from the config (a tensor given
        in memory, a weight update: of the model's parameter)."""
        if self.shape == expected:
            return
        if self.file is None:
            raise ValueError(
                f"Weight {self.name!r} has shape {self.shape}; the model expects {expected} "
                "(the shape of the model's parameter, as transformers names and shapes it)."
            )
        raise ValueError(
            f"Checkpoint weight {self.name!r}{self._in_file} has shape {self.shape}; the "
            f"model built from its config expects {expected}. The config (config.json: "
            "hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, "
            "head_dim, vocab_size) must describe the checkpoint's weights."
        )

    def check_float(self) -> None:
        """A ValueError unless the tensor holds floating-point values: an integer or bool
        tensor where the model has a float parameter is a wrong checkpoint, not one to cast."""
        if isinstance(self._source, torch.Tensor):
            is_float, dtype = self._source.is_floating_point(), str(self._source.dtype)
        else:
            # safetensors names its float types F64, F32, F16, BF16, F8_E4M3, F8_E5M2.
            dtype = self._source.get_dtype()
            is_float = dtype.startswith(("F", "BF"))
        if not is_float:
            raise ValueError(
                f"Checkpoint weight {self.name!r}{self._in_file} has dtype {dtype}; the model's "
                "parameter is floating point, and integer or bool weights are not cast. A "
                "quantized checkpoint needs its quantization_config in config.json."
            )

    @property
    def _in_file(self) -> str:
        return "" if self.file is None else f" in {self.file}"


@dataclass(frozen=True, slots=True)
class CheckpointPart:
    """The part of one checkpoint weight a rank keeps: its ``rows`` and ``cols`` (each a
    ``(start, size)``, None for all of them), and the rows of the layer's weight they fill."""

    rows: tuple[int, int] | None
    cols: tuple[int, int] | None
    out_rows: slice


def rows_held(rows: tuple[int, int], num_rows: int) -> tuple[slice, int]:
    """Of rows ``(start, size)``, those a tensor of ``num_rows`` holds, and how many past
    its end follow them."""
    start, size = rows
    stop = min(start + size, num_rows)
    start = min(start, stop)
    return slice(start, stop), size - (stop - start)


def zero_padded(rows: torch.Tensor, missing: int) -> torch.Tensor:
    """``rows`` followed by ``missing`` rows of zeros."""
    return rows if missing == 0 else torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])])


def weight_memory(model: nn.Module) -> dict[torch.dtype, int]:
    """Bytes of the model's parameters and buffers by dtype, each tensor once however many
    modules share it: what the weights take, in whatever form they are kept (packed,
    quantized with their scales, tied)."""
    seen: set[object] = set()
    memory: dict[torch.dtype, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        # NOTE: the same elements seen again (a oneDNN layer on a tied weight's dense
        # tensor) count once; slices of one storage (quantized pieces) each count. An
        # opaque oneDNN tensor has no data pointer to compare; nothing shares it.
        key = id(tensor) if tensor.is_mkldnn else (tensor.data_ptr(), tensor.numel())
        if key in seen:
            continue
        seen.add(key)
        memory[tensor.dtype] = memory.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
    return memory
