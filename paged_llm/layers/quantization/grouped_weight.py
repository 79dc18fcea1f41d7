"""The group-quantized weight layout: packed integer codes with float32 scales and offsets
per group of input features, which GGUF's quantized types and pre-quantized checkpoints
are repacked into once, at load time."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from paged_llm.layers.weights import rows_held, zero_padded


@dataclass(frozen=True)
class GroupQuantizedWeight:
    """``W[n, k] = scale[n, k // g] * code[n, k] + offset[n, k // g]`` for groups of ``g``
    consecutive input features, or with ``group_index[k]`` for ``k // g`` where each input
    feature's group is given (GPTQ's act-order ``g_idx``: groups of a permutation).

    Codes of 4 bits or fewer are packed two to a byte (``codes[n, j]`` holds ``k = 2j`` in
    its low nibble and ``k = 2j + 1`` in its high one); wider codes are one int8 each. The
    scales and offsets are float32, so each dequantized value is computed with the same
    float32 operations as the format's own dequantizer.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    # None: a symmetric format (zero offset).
    offset: torch.Tensor | None
    bits: int
    group_size: int
    group_index: torch.Tensor | None = None

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bits: int,
        group_index: torch.Tensor | None = None,
    ) -> GroupQuantizedWeight:
        """``W = scale * (codes - zero)`` for unsigned ``codes [N, K]`` of ``bits`` (at most
        8) and float ``scale`` / ``zero`` ``[N, groups]``, in this layout: the offset is
        ``-scale * zero`` (None where every zero is 0), 8-bit codes are stored as
        ``codes - 128``."""
        scale, zero = scale.to(torch.float32), zero.to(torch.float32)
        if bits <= 4:
            low, high = codes[:, 0::2], codes[:, 1::2]
            packed = (low | (high << 4)).to(torch.uint8)
        else:
            # NOTE: the shift keeps each code in int8, and moves into the offset exactly
            # (zero and 128 are small integers).
            packed, zero = (codes - 128).to(torch.int8), zero - 128
        offset = None if not zero.any() else (-scale * zero).contiguous()
        group_size = codes.shape[1] // scale.shape[1]
        index = None if group_index is None else group_index.to(torch.int64)
        return cls(packed.contiguous(), scale.contiguous(), offset, bits, group_size, index)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * (2 if self.nibbles else 1)

    @property
    def nibbles(self) -> bool:
        return self.bits <= 4

    @property
    def nbytes(self) -> int:
        held = (self.codes, self.scale, self.offset, self.group_index)
        return sum(tensor.nbytes for tensor in held if tensor is not None)

    def rows(self, start: int, size: int) -> GroupQuantizedWeight:
        """Rows ``[start, start + size)``; rows past the last are zero (codes, scales and
        offsets), as `CheckpointTensor.read` pads a vocabulary's last shard."""
        held, missing = rows_held((start, size), self.shape[0])

        def part(tensor: torch.Tensor) -> torch.Tensor:
            return zero_padded(tensor[held], missing)

        offset = None if self.offset is None else part(self.offset)
        return replace(self, codes=part(self.codes), scale=part(self.scale), offset=offset)

    def take(self, row_ids: torch.Tensor) -> GroupQuantizedWeight:
        """Rows ``row_ids``, in their order: an embedding's lookup."""
        offset = None if self.offset is None else self.offset[row_ids]
        return replace(self, codes=self.codes[row_ids], scale=self.scale[row_ids], offset=offset)

    def cols(self, start: int, size: int) -> GroupQuantizedWeight:
        """Input features ``[start, start + size)``, on group boundaries (a per-channel
        weight's one group per row is cut to the columns kept, its scale unchanged)."""
        per_byte = 2 if self.nibbles else 1
        codes = self.codes[:, start // per_byte : (start + size) // per_byte]
        if self.group_index is not None:
            # Every group may have features in any shard: keep all scales and offsets.
            index = self.group_index[start : start + size]
            return replace(self, codes=codes, group_index=index)
        if self.scale.shape[1] == 1 and start % per_byte == 0 and size % per_byte == 0:
            return replace(self, codes=codes, group_size=size)
        if start % self.group_size or size % self.group_size:
            raise ValueError(
                f"A tensor-parallel shard of input features [{start}, {start + size}) does not "
                f"fall on this weight's quantization groups of {self.group_size}; use another "
                "tensor_parallel_size."
            )
        groups = slice(start // self.group_size, (start + size) // self.group_size)
        offset = None if self.offset is None else self.offset[:, groups]
        return replace(self, codes=codes, scale=self.scale[:, groups], offset=offset)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight ``[N, K]`` in ``dtype``."""
        if self.nibbles:
            low, high = self.codes & 0x0F, self.codes >> 4
            codes = torch.stack([low, high], dim=-1).flatten(1)
        else:
            codes = self.codes
        if self.group_index is not None:
            weight = codes.to(torch.float32) * self.scale[:, self.group_index]
            if self.offset is not None:
                weight += self.offset[:, self.group_index]
            return weight.to(dtype)
        num_rows, num_groups = self.scale.shape
        grouped = codes.to(torch.float32).view(num_rows, num_groups, self.group_size)
        weight = grouped * self.scale[..., None]
        if self.offset is not None:
            weight += self.offset[..., None]
        return weight.view(num_rows, -1).to(dtype)

    def to(self, device: torch.device) -> GroupQuantizedWeight:
        """A copy on ``device``: a rank's rows or columns then hold only their own bytes,
        not the whole checkpoint tensor they were sliced from."""
        offset = None if self.offset is None else self.offset.to(device, copy=True)
        index = None if self.group_index is None else self.group_index.to(device, copy=True)
        codes, scale = self.codes.to(device, copy=True), self.scale.to(device, copy=True)
        return replace(self, codes=codes, scale=scale, offset=offset, group_index=index)

    @property
    def tensors(self) -> list[torch.Tensor]:
        optional = [t for t in (self.offset, self.group_index) if t is not None]
        return [self.codes, self.scale, *optional]
