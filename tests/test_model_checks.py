"""A model whose files disagree with each other, or are damaged, is refused at load with a
ValueError naming the file, the field or tensor, what was expected and what was found."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_llm import LLM


def edited_copy(source: Path, destination: Path, **config_changes: Any) -> Path:
    """A copy of model folder ``source`` with ``config_changes`` written into its config.json."""
    shutil.copytree(source, destination)
    config_file = destination / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config_changes}))
    return destination


K_PROJ = "model.layers.0.self_attn.k_proj.weight"
DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize(
    ("config_changes", "tensor", "found", "expected"),
    [
        # Loaded silently before: the first 16 of the 32 rows, as one KV head.
        ({"num_key_value_heads": 1}, K_PROJ, "(32, 64)", "(16, 64)"),
        ({"num_key_value_heads": 4}, K_PROJ, "(32, 64)", "(64, 64)"),
        # Loaded silently before: the first 16 rows, as 2 heads of 8.
        ({"head_dim": 8}, K_PROJ, "(32, 64)", "(16, 64)"),
        ({"intermediate_size": 256}, DOWN_PROJ, "(64, 128)", "(64, 256)"),
        ({"hidden_size": 32}, "lm_head.weight", "(49152, 64)", "(49152, 32)"),
    ],
)
def test_a_config_that_disagrees_with_the_weights_names_the_tensor_the_file_and_both_shapes(
    llama_dir: Path,
    tmp_path: Path,
    config_changes: dict[str, int],
    tensor: str,
    found: str,
    expected: str,
) -> None:
    model_dir = edited_copy(llama_dir, tmp_path / "model", **config_changes)

    with pytest.raises(ValueError) as raised:
        LLM(str(model_dir))

    message = str(raised.value)
    assert f"{tensor!r} in {model_dir / 'model.safetensors'} has shape {found}" in message
    assert f"expects {expected}" in message


@pytest.mark.parametrize(
    ("name", "config_changes", "field"),
    [
        ("llama", {"num_attention_heads": 0}, "num_attention_heads=0"),
        ("llama", {"num_key_value_heads": 0}, "num_key_value_heads=0"),
        ("llama", {"num_key_value_heads": 3}, "num_attention_heads=4 and num_key_value_heads=3"),
        ("llama", {"hidden_size": -64}, "hidden_size=-64"),
        ("mistral", {"sliding_window": 0}, "sliding_window=0"),
        ("mistral", {"sliding_window": -1}, "sliding_window=-1"),
    ],
)
def test_config_fields_no_model_has_are_refused_naming_the_field(
    tiny_model_dir: Callable[[str], Path],
    tmp_path: Path,
    name: str,
    config_changes: dict[str, int],
    field: str,
) -> None:
    model_dir = edited_copy(tiny_model_dir(name), tmp_path / "model", **config_changes)

    with pytest.raises(ValueError, match=re.escape(f"{model_dir / 'config.json'} has {field}")):
        LLM(str(model_dir))


def test_hf_overrides_are_checked_too(tiny_model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match=r"config.json with hf_overrides has sliding_window=0;"):
        LLM(str(tiny_model_dir("mistral")), hf_overrides={"sliding_window": 0})


def test_a_sliding_window_the_config_switches_off_is_not_checked(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = edited_copy(
        tiny_model_dir("qwen2"), tmp_path / "model", sliding_window=0, use_sliding_window=False
    )

    assert LLM(str(model_dir), max_model_len=64).generate("Hi")[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: data[:5], id="truncated-in-the-header-length"),
        pytest.param(lambda data: (16).to_bytes(8, "little") + b"{not json}" * 4, id="garbage"),
    ],
)
def test_a_damaged_safetensors_file_is_named(
    llama_dir: Path, tmp_path: Path, damage: Callable[[bytes], bytes]
) -> None:
    model_dir = edited_copy(llama_dir, tmp_path / "model")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))

    with pytest.raises(
        ValueError, match=rf"{re.escape(str(weights))} is not a readable safetensors"
    ):
        LLM(str(model_dir))


@pytest.mark.parametrize(
    ("dtype", "tensor", "shown"),
    [
        (torch.int32, "model.norm.weight", "I32"),
        (torch.bool, "model.layers.1.self_attn.q_proj.weight", "BOOL"),
    ],
)
def test_integer_or_bool_weights_are_refused_naming_the_tensor_and_its_dtype(
    llama_dir: Path, tmp_path: Path, dtype: torch.dtype, tensor: str, shown: str
) -> None:
    model_dir = edited_copy(llama_dir, tmp_path / "model")
    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)
    tensors[tensor] = tensors[tensor].to(dtype)
    save_file(tensors, weights, metadata={"format": "pt"})

    with pytest.raises(ValueError, match=rf"{re.escape(repr(tensor))} in .* has dtype {shown};"):
        LLM(str(model_dir))


def test_a_missing_tokenizer_names_the_folder_and_the_files_looked_for(
    llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama_dir / name, model_dir / name)

    with pytest.raises(ValueError) as raised:
        LLM(str(model_dir))

    message = str(raised.value)
    assert f"No tokenizer could be loaded from {model_dir}: looked for tokenizer.json" in message
    assert "tokenizer_config.json, tokenizer.model" in message
    assert "found none of them" in message


def test_an_unreadable_tokenizer_names_the_files_found(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = edited_copy(llama_dir, tmp_path / "model")
    (model_dir / "tokenizer.json").write_text("{not json")

    with pytest.raises(ValueError, match=r"No tokenizer could be loaded .* found tokenizer.json"):
        LLM(str(model_dir))
