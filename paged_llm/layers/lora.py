"""LoRA adapters on the linear layers: many adapters in one flat batch.

Each adapted projection keeps, per adapter slot, its ``A`` matrices (one per packed slice)
and one ``B`` matrix with the slices' rows at their places in the output, the adapter's
scaling folded in. A step tells the model which slot each of its tokens uses
(`LoRABatch`), and every adapted layer adds ``x A^T B^T`` to its output for those tokens:

- the torch path (CPU) groups the tokens by slot and runs two small matmuls per group and
  slice; a group whose tokens are contiguous in the batch (the usual case: a sequence's
  tokens are) adds in place without gathering;
- the Triton path (GPU) gathers each token's adapter in one shrink and one expand launch,
  whatever the mix, with no host synchronisation.

A step without adapters pays one attribute check per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_llm.layers.kernels import triton_kernels


@dataclass(slots=True)
class LoRABatch:
    """The adapter slot of each token of one step."""

    # [T] int64 on the device, -1 for the base model: the Triton path's per-token gather.
    token_slots: torch.Tensor
    # (slot, rows of the batch) for each slot in use: the torch path's groups.
    groups: list[tuple[int, slice | torch.Tensor]]

    @classmethod
    def from_token_slots(cls, token_slots: np.ndarray, device: torch.device) -> LoRABatch | None:
        """The batch for these per-token slots; None when no token uses an adapter."""
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in np.unique(token_slots):
            if slot < 0:
                continue
            rows = np.flatnonzero(token_slots == slot)
            start, stop = int(rows[0]), int(rows[-1]) + 1
            contiguous = stop - start == len(rows)
            groups.append(
                (
                    int(slot),
                    slice(start, stop)
                    if contiguous
                    else torch.from_numpy(rows).to(device, non_blocking=True),
                )
            )
        if not groups:
            return None
        return cls(torch.from_numpy(token_slots).to(device, non_blocking=True), groups)


class LoRAState:
    """What every adapted layer of one model reads: the step's `LoRABatch` (None: the step
    runs the base model only), and which path computes the adapters."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton
        self.batch: LoRABatch | None = None


@dataclass(frozen=True, slots=True)
class LoRAShard:
    """What this rank keeps of a checkpoint adapter for one projection: the ``B`` rows of each
    slice (column parallel: the rows of its shard of the projection's output) and the ``A``
    columns (row parallel: its share of the input features)."""

    # Per slice: (first row, number of rows) of the checkpoint projection's output.
    slice_rows: tuple[tuple[int, int], ...]
    # (first column, number of columns) of the checkpoint projection's input.
    input_columns: tuple[int, int]


class LoRASlots:
    """The adapter weights of one projection, in ``max_loras`` slots."""

    def __init__(
        self,
        state: LoRAState,
        shard: LoRAShard,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.state = state
        self.shard = shard
        sizes = [size for _, size in shard.slice_rows]
        self.slice_offsets = tuple(int(offset) for offset in np.cumsum([0, *sizes]))
        in_features = shard.input_columns[1]
        self.lora_a = torch.zeros(
            max_loras, len(sizes), max_rank, in_features, dtype=dtype, device=device
        )
        self.lora_b = torch.zeros(
            max_loras, self.slice_offsets[-1], max_rank, dtype=dtype, device=device
        )
        # Per slot: the rank its matrices use (0: the adapter leaves this projection alone),
        # and the slices it adapts.
        self.ranks = [0] * max_loras
        self.adapted_slices: list[list[int]] = [[] for _ in range(max_loras)]
        # Per slot: the adapted slices' A matrices stacked ``[slices * rank, in]``, built once
        # at load so that a step's shrink reads them without gathering them again.
        self.shrink_weights: list[torch.Tensor | None] = [None] * max_loras

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.ranks[slot] = 0
        self.adapted_slices[slot] = []
        self.shrink_weights[slot] = None

    def load(self, slot: int, slice_index: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Put one slice of a checkpoint adapter in ``slot``: ``lora_a`` ``[rank, in]`` and
        ``lora_b`` ``[out, rank]`` (scaling folded in) of the whole projection, cut to this
        rank's shard here."""
        rank = lora_a.shape[0]
        column_start, num_columns = self.shard.input_columns
        row_start, num_rows = self.shard.slice_rows[slice_index]
        offset = self.slice_offsets[slice_index]
        self.lora_a[slot, slice_index, :rank].copy_(
            lora_a[:, column_start : column_start + num_columns]
        )
        self.lora_b[slot, offset : offset + num_rows, :rank].copy_(
            lora_b[row_start : row_start + num_rows]
        )
        self.ranks[slot] = max(self.ranks[slot], rank)
        self.adapted_slices[slot] = sorted({*self.adapted_slices[slot], slice_index})
        self.shrink_weights[slot] = (
            self.lora_a[slot, self.adapted_slices[slot], : self.ranks[slot]].flatten(0, 1).T
        )

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Add each token's adapter to the projection's output ``out`` for input ``x``."""
        batch = self.state.batch
        if batch is None:
            return
        if self.state.use_triton:
            kernels = triton_kernels()
            shrunk = torch.empty(
                self.lora_a.shape[1],
                x.shape[0],
                self.lora_a.shape[2],
                dtype=torch.float32,
                device=x.device,
            )
            kernels.lora_shrink(x, self.lora_a, batch.token_slots, shrunk)
            kernels.lora_expand(shrunk, self.lora_b, batch.token_slots, self.slice_offsets, out)
            return
        # NOTE: per group, not a per-token gather of each token's A and B (BGMV): the gather
        # copies more bytes than the products read. One SmolLM2 layer, 2 threads: a decode of
        # 32 tokens under 4 adapters takes 1.6 ms grouped against 3.4 ms gathered, a 512-token
        # prefill chunk 6.8 ms against 126 ms (benchmarks/lora_kernels.py).
        for slot, rows in batch.groups:
            shrink_weight = self.shrink_weights[slot]
            if shrink_weight is None:  # the adapter leaves this projection alone
                continue
            rank = self.ranks[slot]
            slices = self.adapted_slices[slot]
            # One matmul for the adapted slices' A matrices together.
            shrunk = x[rows] @ shrink_weight
            for i, slice_index in enumerate(slices):
                start, stop = self.slice_offsets[slice_index], self.slice_offsets[slice_index + 1]
                delta = (
                    shrunk[:, i * rank : (i + 1) * rank] @ self.lora_b[slot, start:stop, :rank].T
                )
                if isinstance(rows, slice):
                    out[rows, start:stop] += delta
                else:
                    out[:, start:stop].index_add_(0, rows, delta)
