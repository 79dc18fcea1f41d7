"""A GGUF file's layout, checked before gguf-py's reader walks it.

gguf-py's `GGUFReader` believes every count and length in the file: an array that claims
2**40 elements becomes a loop over 2**40 numpy views (all the memory, then a MemoryError),
and a truncated file a numpy error far from its cause. `check_gguf_layout` walks the same
header with each count times its element size checked against the bytes left, and each
tensor's data against the end of the file, so a truncated or corrupt file is a ValueError
that names the file and the field. It reads the header only: SmolLM2's (2 MB, most of it
the vocabulary) in 0.04 s, where the reader then takes seconds. What it finds (the scalar
metadata, and each tensor's name, shape, type and bytes) is a `GgufLayout`, enough for a
load that reads the tensors kept quantized straight from the file.

The layout (llama.cpp's docs/gguf.md): magic, version, tensor count, metadata count; each
metadata key (name, value type, value); each tensor's info (name, dimensions, GGML type,
data offset); padding to the alignment; the tensors' data.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np

_MAGIC = b"GGUF"
# The versions gguf-py's reader reads (version 1 counted in 32 bits).
_SUPPORTED_VERSIONS = (2, 3)
# The fewest bytes a metadata key takes (name length, value type, a one-byte value), and a
# tensor's info (name length, dimension count, type, offset): what a count must leave room for.
_MIN_KEY_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
# llama.cpp's GGML_MAX_DIMS.
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class GgufTensorInfo:
    """One tensor of a GGUF file: its llama.cpp name, its shape in torch's order (rows
    first), its GGML type, and where its bytes lie in the file."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    start: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class GgufLayout:
    """A checked GGUF file's scalar and string metadata (arrays left out: the vocabulary
    is most of a header) and its tensors, in file order."""

    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[GgufTensorInfo] = field(default_factory=list)


class _Header:
    """A cursor over a GGUF file's bytes; every read is checked against the file's end."""

    def __init__(self, path: Path, data: bytes | mmap.mmap) -> None:
        self.path = path
        self.data = data
        self.offset = 0
        # "<" little-endian, ">" a file written on a big-endian machine.
        self.order: Literal["<", ">"] = "<"

    def error(self, field: str, problem: str) -> ValueError:
        return ValueError(
            f"{self.path} is truncated or corrupt: {field} {problem}. Download or convert "
            "the file again."
        )

    def fits(self, size: int, field: str) -> None:
        left = len(self.data) - self.offset
        if size > left:
            raise self.error(
                field, f"needs {size} bytes at offset {self.offset}, and the file has {left} left"
            )

    def take(self, size: int, field: str) -> int:
        """Step over ``size`` bytes of ``field``; where they start."""
        self.fits(size, field)
        start = self.offset
        self.offset += size
        return start

    def number(self, code: str, field: str) -> int:
        """An unsigned integer of struct format ``code`` ("I": 32 bits, "Q": 64)."""
        start = self.take(struct.calcsize(code), field)
        value: int = struct.unpack_from(self.order + code, self.data, start)[0]
        return value

    def raw(self, size: int, field: str) -> bytes:
        start = self.take(size, field)
        return bytes(self.data[start : start + size])

    def string(self, field: str) -> bytes:
        return self.raw(self.number("Q", f"the length of {field}"), field)

    def text(self, field: str) -> str:
        raw = self.string(field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.error(field, f"is not UTF-8 text ({error})") from error

    def skip_strings(self, count: int, field: str) -> None:
        """Step over an array of ``count`` strings; a loop without method calls, since a
        vocabulary holds tens of thousands."""
        self.fits(8 * count, f"{field} ({count} strings of at least 8 bytes)")
        read_length = struct.Struct(self.order + "Q").unpack_from
        data, offset, end = self.data, self.offset, len(self.data)
        for index in range(count):
            if offset + 8 > end:
                self.offset = offset
                raise self.error(f"string {index} of {field}", "runs past the end of the file")
            offset += 8 + read_length(data, offset)[0]
        if offset > end:
            raise self.error(f"string {count - 1} of {field}", "runs past the end of the file")
        self.offset = offset


def check_gguf_layout(gguf: ModuleType, path: Path) -> GgufLayout:
    """The layout of the GGUF file at ``path``; a ValueError naming ``path`` and the field,
    unless every count, length and tensor extent in it fits in the file. ``gguf`` is the
    gguf-py package."""
    with path.open("rb") as file:
        if path.stat().st_size == 0:
            return _check(gguf, _Header(path, b""))
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _check(gguf, _Header(path, data))


def _check(gguf: ModuleType, header: _Header) -> GgufLayout:
    magic = header.raw(len(_MAGIC), "the magic number")
    if magic != _MAGIC:
        raise ValueError(
            f"{header.path} is not a GGUF file: it starts with {magic!r}, not {_MAGIC!r}."
        )
    version = header.number("I", "the version")
    if version & 0xFFFF == 0:
        # As gguf-py reads it: a version that reads as a multiple of 65536 is a file
        # written on a big-endian machine.
        header.order = ">"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in _SUPPORTED_VERSIONS:
        raise header.error("the version", f"is {version}; GGUF versions 2 and 3 are read")
    tensor_count = header.number("Q", "the tensor count")
    key_count = header.number("Q", "the metadata key count")
    header.fits(
        key_count * _MIN_KEY_BYTES + tensor_count * _MIN_TENSOR_INFO_BYTES,
        f"the header, as its counts claim ({key_count} metadata keys, {tensor_count} tensors),",
    )
    layout = GgufLayout()
    alignment = _check_metadata(gguf, header, key_count, layout.metadata)
    tensors = _check_tensor_infos(gguf, header, tensor_count)
    data_start = -(-header.offset // alignment) * alignment
    for tensor in tensors:
        if tensor.start % alignment != 0:
            raise header.error(
                f"the data offset of tensor {tensor.name!r}",
                f"is {tensor.start}, not a multiple of the alignment {alignment}",
            )
        end = data_start + tensor.start + tensor.num_bytes
        if end > len(header.data):
            raise header.error(
                f"the data of tensor {tensor.name!r}",
                f"({tensor.num_bytes} bytes) ends at byte {end}, past the end of the file at "
                f"{len(header.data)}",
            )
        layout.tensors.append(replace(tensor, start=data_start + tensor.start))
    return layout


def _check_metadata(
    gguf: ModuleType, header: _Header, key_count: int, values: dict[str, Any]
) -> int:
    """Step over the metadata keys, keeping the scalar and string ones in ``values``; the
    alignment of the tensors' data."""
    alignment = _DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for index in range(key_count):
        key = _new_name(header, keys, "metadata key", index)
        field = f"metadata {key!r}"
        value_type = _value_type(gguf, header, f"the type of {field}")
        if key == "general.alignment":
            if value_type != "UINT32":
                raise header.error(field, f"is a {value_type}, not a UINT32")
            alignment = header.number("I", field)
            if alignment == 0 or alignment & (alignment - 1) != 0:
                raise header.error(field, f"is {alignment}, not a power of two")
            values[key] = alignment
        elif value_type == "ARRAY":
            _skip_array(gguf, header, field)
        elif value_type == "STRING":
            # NOTE: decoded leniently, as gguf-py leaves them bytes: a value is never refused.
            values[key] = header.string(field).decode("utf-8", "replace")
        else:
            scalar = _scalar_dtype(gguf, value_type).newbyteorder(header.order)
            start = header.take(scalar.itemsize, field)
            values[key] = np.frombuffer(header.data, scalar, 1, start)[0].item()
    return alignment


def _new_name(header: _Header, seen: set[str], kind: str, index: int) -> str:
    """The name of the ``index``-th metadata key or tensor, refused if an earlier one has it."""
    name = header.text(f"the name of {kind} {index}")
    if name in seen:
        raise header.error(f"{kind} {name!r}", "appears twice")
    seen.add(name)
    return name


def _value_type(gguf: ModuleType, header: _Header, field: str) -> str:
    raw = header.number("I", field)
    try:
        name: str = gguf.GGUFValueType(raw).name
    except ValueError as error:
        raise header.error(field, f"is {raw}, not a GGUF value type") from error
    return name


def _scalar_dtype(gguf: ModuleType, type_name: str) -> np.dtype[Any]:
    """A scalar GGUF type, as gguf-py's reader reads it."""
    scalar: np.dtype[Any] = np.dtype(
        gguf.GGUFReader.gguf_scalar_to_np[gguf.GGUFValueType[type_name]]
    )
    return scalar


def _skip_array(gguf: ModuleType, header: _Header, field: str) -> None:
    item_type = _value_type(gguf, header, f"the item type of {field}")
    count = header.number("Q", f"the length of {field}")
    if item_type == "STRING":
        header.skip_strings(count, field)
    elif item_type != "ARRAY":
        size = _scalar_dtype(gguf, item_type).itemsize
        header.take(count * size, f"{field} ({count} {item_type} values of {size} bytes)")
    else:
        # NOTE: llama.cpp refuses arrays of arrays too.
        raise header.error(field, "is an array of arrays, which GGUF readers do not take")


def _check_tensor_infos(
    gguf: ModuleType, header: _Header, tensor_count: int
) -> list[GgufTensorInfo]:
    """Step over the tensors' infos; each tensor, its ``start`` counted from the start of
    the data section."""
    tensors = []
    names: set[str] = set()
    for index in range(tensor_count):
        name = _new_name(header, names, "tensor", index)
        num_dims = header.number("I", f"the dimension count of tensor {name!r}")
        if num_dims > _MAX_DIMS:
            raise header.error(
                f"the dimension count of tensor {name!r}", f"is {num_dims}, over {_MAX_DIMS}"
            )
        dims = [header.number("Q", f"dimension {d} of tensor {name!r}") for d in range(num_dims)]
        raw_type = header.number("I", f"the type of tensor {name!r}")
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
            block_elements, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError) as error:
            raise header.error(
                f"the type of tensor {name!r}", f"is {raw_type}, not a GGML type"
            ) from error
        offset = header.number("Q", f"the data offset of tensor {name!r}")
        if dims and dims[0] % block_elements != 0:
            raise header.error(
                f"tensor {name!r}",
                f"has rows of {dims[0]} values, not whole {ggml_type.name} blocks of "
                f"{block_elements}",
            )
        num_bytes = math.prod(dims) // block_elements * block_bytes
        # GGML lists dimensions fastest-varying first; torch lists them last.
        shape = tuple(reversed(dims))
        tensors.append(GgufTensorInfo(name, shape, ggml_type.name, offset, num_bytes))
    return tensors
