"""Load safetensors checkpoints (single file or sharded) into our model modules."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

# Buffers some checkpoints carry that we recompute instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, from its index when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors weights in {model_dir}. paged_llm loads safetensors checkpoints "
            "(convert .bin checkpoints with transformers: model.save_pretrained(dir))."
        )
    return files


def iterate_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _target(name: str, packed_modules: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """Our parameter name for a checkpoint name, and the shard it fills if packed."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed_modules:
            packed, shard = packed_modules[part]
            return ".".join([*parts[:i], packed, *parts[i + 1 :]]), shard
    return name, None


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into ``model``; fail on missing or unexpected weights."""
    packed_modules: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    expected = {(name, shard) for name in params for shard in _shards(model, name)}
    loaded: set[tuple[str, int | None]] = set()
    for ckpt_name, tensor in iterate_checkpoint(model_dir):
        if ckpt_name.endswith(_IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
            continue
        name, shard = _target(ckpt_name, packed_modules)
        param = params.get(name)
        if param is None:
            raise ValueError(f"Checkpoint weight {ckpt_name!r} has no place in the model.")
        if shard is None:
            if param.shape != tensor.shape:
                raise ValueError(
                    f"Checkpoint weight {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}."
                )
            param.data.copy_(tensor)
        else:
            owner = _packed_owner(model, name)
            assert owner is not None
            owner.load_shard(param, tensor, shard)
        loaded.add((name, shard))
    missing = sorted(
        f"{name}" + (f"[shard {s}]" if s is not None else "") for name, s in expected - loaded
    )
    if missing:
        raise ValueError(f"Checkpoint in {model_dir} lacks weights: {', '.join(missing[:10])}.")


def _shards(model: nn.Module, param_name: str) -> list[int | None]:
    owner = _packed_owner(model, param_name)
    return list(range(len(owner.output_sizes))) if owner is not None else [None]


def _packed_owner(model: nn.Module, param_name: str) -> nn.Module | None:
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    return module if hasattr(module, "load_shard") else None
