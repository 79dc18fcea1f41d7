"""A truncated or corrupt GGUF file is a ValueError naming the file and the field, found
from the header alone: nothing it claims is allocated or read before it is checked."""

from __future__ import annotations

import re
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from paged_llm.model_files import convert_gguf, resolve_model  # noqa: E402
from paged_llm.model_files.gguf import gguf_reader  # noqa: E402
from paged_llm.model_files.gguf_quantized import quantized_tensors  # noqa: E402

_TOKENS = ["a", "b", "<eos>"]


def write_small_gguf(path: Path) -> Path:
    """A GGUF file with a string, a string array, a number array and two tensors (the last
    one, output_norm.weight, ends the file)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_token_list(_TOKENS)
    writer.add_token_types([1, 1, 3])
    writer.add_tensor("token_embd.weight", np.ones((3, 32), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _value_offset(data: bytes, key: str) -> int:
    """Where the value of metadata ``key`` starts: after its name and its uint32 type."""
    name = key.encode()
    return data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4


def _array_count_of(key: str, count: int) -> Callable[[bytes], bytes]:
    def corrupt(data: bytes) -> bytes:
        at = _value_offset(data, key) + 4  # past the item type
        return data[:at] + struct.pack("<Q", count) + data[at + 8 :]

    return corrupt


def _string_length_of(key: str, length: int) -> Callable[[bytes], bytes]:
    def corrupt(data: bytes) -> bytes:
        at = _value_offset(data, key)
        return data[:at] + struct.pack("<Q", length) + data[at + 8 :]

    return corrupt


def _cut_inside(key: str) -> Callable[[bytes], bytes]:
    return lambda data: data[: _value_offset(data, key) + 20]


# corruption -> what the message must name
CORRUPTIONS = {
    "array-count-2**40": (
        _array_count_of("tokenizer.ggml.token_type", 2**40),
        "metadata 'tokenizer.ggml.token_type' (1099511627776 INT32 values of 4 bytes)",
    ),
    "string-array-count-2**40": (
        _array_count_of("tokenizer.ggml.tokens", 2**40),
        "metadata 'tokenizer.ggml.tokens' (1099511627776 strings of at least 8 bytes)",
    ),
    "string-length-past-the-end": (
        _string_length_of("general.name", 2**62),
        "metadata 'general.name' needs 4611686018427387904 bytes",
    ),
    "truncated-in-the-header": (
        _cut_inside("tokenizer.ggml.tokens"),
        "metadata 'tokenizer.ggml.tokens' (3 strings of at least 8 bytes) needs 24 bytes",
    ),
    "truncated-in-the-tensor-data": (
        lambda data: data[:-10],
        "the data of tensor 'output_norm.weight' (128 bytes) ends at byte",
    ),
    "truncated-in-the-magic": (lambda data: data[:2], "the magic number needs 4 bytes"),
    "empty": (lambda data: b"", "the magic number needs 4 bytes"),
    "tensor-count-2**40": (
        lambda data: data[:8] + struct.pack("<Q", 2**40) + data[16:],
        "the header, as its counts claim (4 metadata keys, 1099511627776 tensors)",
    ),
    "unknown-tensor-type": (
        lambda data: data.replace(
            b"output_norm.weight" + struct.pack("<IQI", 1, 32, 0),
            b"output_norm.weight" + struct.pack("<IQI", 1, 32, 999),
        ),
        "the type of tensor 'output_norm.weight' is 999, not a GGML type",
    ),
}


@pytest.fixture(params=list(CORRUPTIONS))
def corrupt_gguf(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    corrupt, named = CORRUPTIONS[request.param]
    path = write_small_gguf(tmp_path / "small.gguf")
    path.write_bytes(corrupt(path.read_bytes()))
    return path, named


def test_the_file_the_corruptions_start_from_is_read_whole(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "small.gguf")
    reader = gguf_reader(path)
    assert [tensor.name for tensor in reader.tensors] == ["token_embd.weight", "output_norm.weight"]


def test_a_corrupt_gguf_is_a_value_error_naming_the_file_and_the_field_at_once(
    corrupt_gguf: tuple[Path, str], tmp_path: Path
) -> None:
    path, named = corrupt_gguf
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ValueError) as raised:
            convert_gguf(path, tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 2
    assert peak < 2**20
    message = str(raised.value)
    assert message.startswith(f"{path} is truncated or corrupt: "), message
    assert named in message, message


def test_the_user_gets_the_same_error_from_the_model_argument(
    corrupt_gguf: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGED_LLM_CACHE", str(tmp_path / "cache"))
    path, named = corrupt_gguf
    with pytest.raises(ValueError, match=re.escape(named)):
        resolve_model(path)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_a_file_that_is_not_gguf_says_so(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not a GGUF file"):
        convert_gguf(path, tmp_path / "out")


def test_the_quantized_path_checks_the_file_too(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "small.gguf")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match=re.escape("the data of tensor 'output_norm.weight'")):
        next(quantized_tensors(path, hf_config=None, names={"lm_head.weight"}))
