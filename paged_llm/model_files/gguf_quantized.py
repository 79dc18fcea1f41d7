"""GGUF weights kept quantized (``quantization="gguf"``): the decoder projections of a
.gguf file repacked once into `GroupQuantizedWeight`s, with no loss.

llama.cpp's block layouts (ggml-common.h; gguf-py's ``gguf.quants`` is the reference the
tests compare against) become one scale, and an offset for the asymmetric types, per group
of 32 input features (16 for Q6_K), and one code per feature:

| type | bits | group | weight = scale * code + offset |
| --- | --- | --- | --- |
| Q4_0 | 4 | 32 | ``d * q - 8d`` |
| Q4_1 | 4 | 32 | ``d * q + m`` |
| Q8_0 | 8 | 32 | ``d * q`` |
| Q4_K | 4 | 32 | ``(d * sc) * q - dmin * m`` (6-bit ``sc``, ``m`` per 32 of a 256 block) |
| Q5_K | 5 | 32 | as Q4_K, with a fifth bit per code |
| Q6_K | 6 | 16 | ``(d * sc) * (q - 32)`` (int8 ``sc`` per 16) |
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_llm.layers.quantization.grouped import GroupQuantizedTensor
from paged_llm.layers.quantization.grouped_weight import GroupQuantizedWeight
from paged_llm.model_files.gguf import (
    _ROPE_PERMUTED_ARCHITECTURES,
    MARKER_FILE,
    _hf_tensor_name,
    _unpermute_rope_rows,
    gguf_layout,
    import_gguf,
)

# The decoder projections, by their GGUF names: what quantization="gguf" keeps quantized.
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# The token embedding and the LM head (absent when tied), kept quantized where their type is.
_VOCAB_TENSORS = ("token_embd.weight", "output.weight")
_K_SCALE_BYTES = 12  # Q4_K / Q5_K: eight 6-bit scales and eight 6-bit mins


@dataclass(frozen=True, slots=True)
class GgufSource:
    """The .gguf file a converted model directory was made from (``path``), and the tensors
    its conversion left in that file (``read_from_gguf``: transformers name -> GGML type),
    which a load reads from it still quantized."""

    path: Path
    read_from_gguf: dict[str, str]


def gguf_source(model_dir: Path) -> GgufSource | None:
    """Where a converted model directory came from; None for other models."""
    marker_file = model_dir / MARKER_FILE
    if not marker_file.is_file():
        return None
    marker = json.loads(marker_file.read_text())
    return GgufSource(Path(marker["source"]), marker.get("read_from_gguf", {}))


def kept_tensor_types(gguf_path: Path, embeddings: bool) -> dict[str, str]:
    """The tensors ``quantization="gguf"`` keeps quantized, by their transformers names,
    with their GGML types: every decoder projection and, with ``embeddings``, the token
    embedding and LM head where the file stores them in a type kept quantized (llama.cpp
    quantizes them in its usual presets: SmolLM2's Q4_1 file has a Q8_0 embedding); a
    float one stays float, as the file has it.

    Raises:
        UnkeptTypeError: a projection's GGML type is not one of `KEPT_QUANTIZED_TYPES`.
    """
    kept = {}
    for tensor in gguf_layout(gguf_path).tensors:
        type_name = tensor.type_name
        if _is_projection(tensor.name):
            if type_name not in KEPT_QUANTIZED_TYPES:
                raise UnkeptTypeError(gguf_path, tensor.name, type_name)
            kept[_hf_tensor_name(tensor.name)] = type_name
        elif embeddings and tensor.name in _VOCAB_TENSORS and type_name in KEPT_QUANTIZED_TYPES:
            kept[_hf_tensor_name(tensor.name)] = type_name
    return kept


class UnkeptTypeError(ValueError):
    """A .gguf file's projection is of a GGML type ``quantization="gguf"`` cannot keep."""

    def __init__(self, gguf_path: Path, tensor_name: str, type_name: str) -> None:
        self.gguf_path, self.tensor_name, self.type_name = gguf_path, tensor_name, type_name
        super().__init__(
            f"{gguf_path.name}: tensor {tensor_name} is {type_name}, which cannot be kept "
            f"quantized (quantization='gguf' keeps {', '.join(KEPT_QUANTIZED_TYPES)}); pass "
            "quantization='dequantize' (or None) to load the file as float."
        )


def _is_projection(gguf_name: str) -> bool:
    part = gguf_name.split(".")
    return len(part) == 4 and part[2] in _PROJECTIONS and part[3] == "weight"


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at bytes ``[start, start + 2)`` of every block, as float32."""
    halves: np.ndarray = blocks[..., start : start + 2].copy().view(np.float16)[..., 0]
    return halves.astype(np.float32)


def _nibbles(packed: np.ndarray, chunk: int) -> np.ndarray:
    """llama.cpp's 4-bit order: each run of ``chunk`` bytes holds ``chunk`` values in its
    low nibbles, then the next ``chunk`` in its high ones."""
    runs = packed.reshape(*packed.shape[:-1], -1, 1, chunk) >> np.array([0, 4], np.uint8)[:, None]
    return (runs & 0x0F).reshape(*packed.shape[:-1], -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's eight 6-bit scales and mins of a block (`gguf.quants.Q4_K.get_scale_min`)."""
    d, m, m_d = np.split(scales.reshape(*scales.shape[:-1], 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(*scales.shape[:-1], 8), mins.reshape(*scales.shape[:-1], 8)


Repacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # codes, scale, offset


def _q4_0(b: np.ndarray) -> Repacked:
    d = _f16(b, 0)
    return _nibbles(b[..., 2:], 16), d, -8 * d


def _q4_1(b: np.ndarray) -> Repacked:
    return _nibbles(b[..., 4:], 16), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Repacked:
    return b[..., 2:].view(np.int8), _f16(b, 0), None


def _q4_k(b: np.ndarray) -> Repacked:
    sc, mins = _k_scales(b[..., 4 : 4 + _K_SCALE_BYTES])
    codes = _nibbles(b[..., 4 + _K_SCALE_BYTES :], 32)
    return codes, _f16(b, 0)[..., None] * sc, -(_f16(b, 2)[..., None] * mins)


def _q5_k(b: np.ndarray) -> Repacked:
    sc, mins = _k_scales(b[..., 4 : 4 + _K_SCALE_BYTES])
    high_bits = b[..., 4 + _K_SCALE_BYTES : 4 + _K_SCALE_BYTES + 32]
    low = _nibbles(b[..., 4 + _K_SCALE_BYTES + 32 :], 32)
    high = (high_bits[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    codes = (low | (high.reshape(low.shape) << 4)).astype(np.int8)
    return codes, _f16(b, 0)[..., None] * sc, -(_f16(b, 2)[..., None] * mins)


def _q6_k(b: np.ndarray) -> Repacked:
    low = _nibbles(b[..., :128], 64)
    high_bits = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    high = (high_bits >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    codes = (low | (high.reshape(low.shape) << 4)).astype(np.int8) - np.int8(32)
    scales = b[..., 192:208].view(np.int8).astype(np.float32)
    return codes, _f16(b, 208)[..., None] * scales, None


# GGML type -> (bits, group size, block bytes -> codes, scales, offsets per block).
_REPACKERS: dict[str, tuple[int, int, Callable[[np.ndarray], Repacked]]] = {
    "Q4_0": (4, 32, _q4_0),
    "Q4_1": (4, 32, _q4_1),
    "Q8_0": (8, 32, _q8_0),
    "Q4_K": (4, 32, _q4_k),
    "Q5_K": (5, 32, _q5_k),
    "Q6_K": (6, 16, _q6_k),
}
KEPT_QUANTIZED_TYPES = tuple(_REPACKERS)


def repack(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GroupQuantizedWeight:
    """A GGML tensor's rows of blocks (``raw``: uint8 ``[rows, bytes per row]``) as a
    `GroupQuantizedWeight` of ``shape`` (rows, input features)."""
    if type_name not in _REPACKERS:
        raise ValueError(
            f"GGML type {type_name} cannot be kept quantized; quantization='gguf' keeps "
            f"{', '.join(KEPT_QUANTIZED_TYPES)} (quantization='dequantize' dequantizes any type)."
        )
    bits, group_size, unpack = _REPACKERS[type_name]
    num_rows, in_features = shape
    gguf = import_gguf()
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = raw.reshape(num_rows, in_features // block_elements, block_bytes)
    codes, scale, offset = unpack(blocks)
    unpacked = torch.from_numpy(np.ascontiguousarray(codes)).reshape(num_rows, in_features)
    packed = unpacked[:, 0::2] | (unpacked[:, 1::2] << 4) if bits <= 4 else unpacked.to(torch.int8)

    def groups(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, np.float32)).reshape(num_rows, -1)

    return GroupQuantizedWeight(
        codes=packed.contiguous(),
        scale=groups(scale),
        offset=None if offset is None else groups(offset),
        bits=bits,
        group_size=group_size,
    )


def quantized_tensors(
    gguf_path: Path, hf_config: Any, names: Collection[str]
) -> Iterator[GroupQuantizedTensor]:
    """The tensors of ``gguf_path`` whose transformers names are in ``names``, repacked,
    under those names and with llama.cpp's q/k row permutation undone."""
    layout = gguf_layout(gguf_path)
    permuted = layout.metadata.get("general.architecture") in _ROPE_PERMUTED_ARCHITECTURES
    heads = {"attn_q": hf_config.num_attention_heads, "attn_k": hf_config.num_key_value_heads}
    for tensor in layout.tensors:
        if not (_is_projection(tensor.name) or tensor.name in _VOCAB_TENSORS):
            continue
        name = _hf_tensor_name(tensor.name)
        if name not in names:
            continue
        rows, features = tensor.shape
        raw = np.fromfile(gguf_path, np.uint8, tensor.num_bytes, offset=tensor.start)
        weight = repack(raw.reshape(rows, -1), tensor.type_name, (rows, features))
        part = tensor.name.split(".")
        if permuted and _is_projection(tensor.name) and part[2] in heads:
            weight = _unpermute_rows(weight, heads[part[2]])
        yield GroupQuantizedTensor(name, weight)


def _unpermute_rows(weight: GroupQuantizedWeight, num_heads: int) -> GroupQuantizedWeight:
    """llama.cpp permutes whole rows, and each row's codes and groups go with it."""
    offset = None if weight.offset is None else _unpermute_rope_rows(weight.offset, num_heads)
    return GroupQuantizedWeight(
        codes=_unpermute_rope_rows(weight.codes, num_heads),
        scale=_unpermute_rope_rows(weight.scale, num_heads),
        offset=offset,
        bits=weight.bits,
        group_size=weight.group_size,
    )
