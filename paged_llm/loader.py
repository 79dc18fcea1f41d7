"""Load safetensors checkpoints (single file or sharded) into our model modules.

A module that keeps only part of a checkpoint tensor (a tensor-parallel shard, one slice of
a packed projection) says so with a ``load_weight(param, tensor, shard)`` method; the
tensor is read from the file only in the rows or columns that method asks for, so each
rank reads about its share of the weights.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from paged_llm.layers.linear import Linear
from paged_llm.layers.quantization.grouped import GroupQuantizedLinearMethod, GroupQuantizedTensor
from paged_llm.layers.quantization.prequantized import PreQuantizedCheckpoint
from paged_llm.layers.weights import CheckpointTensor

# Buffers some checkpoints carry that we recompute instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def iterate_checkpoint(model_dir: Path) -> Iterator[CheckpointTensor]:
    for path in checkpoint_files(model_dir):
        # NOTE: safetensors checks the whole header against the file's size when it opens
        # it, so a truncated or corrupt file fails here, before any tensor is read.
        try:
            checkpoint = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as error:
            raise ValueError(
                f"{path} is not a readable safetensors file ({error}); it may be truncated or "
                "corrupt: download or save the checkpoint again."
            ) from error
        with checkpoint as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield CheckpointTensor(name, f.get_slice(name), path)


def checkpoint_target(
    name: str, packed_modules: dict[str, tuple[str, int]]
) -> tuple[str, int | None]:
    """Our parameter name for a checkpoint name, and the shard it fills if packed."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed_modules:
            packed, shard = packed_modules[part]
            return ".".join([*parts[:i], packed, *parts[i + 1 :]]), shard
    return name, None


def load_weights(
    model: nn.Module,
    model_dir: Path,
    pre_quantized: PreQuantizedCheckpoint | None = None,
    quantized_elsewhere: Collection[GroupQuantizedTensor] = (),
) -> None:
    """Copy every checkpoint tensor into ``model``; fail on missing or unexpected weights.

    With a ``pre_quantized`` checkpoint, the tensors that hold a projection quantized are
    gathered per projection, unpacked, and handed to its layer still quantized; so are
    ``quantized_elsewhere``, the tensors a checkpoint keeps outside ``model_dir`` (a .gguf
    file's, read from the file).
    """
    packed_modules: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    unused: tuple[str, ...] = getattr(model, "unused_checkpoint_weights", ())
    expected = {(name, shard) for name in params for shard in _shards(model, name)}
    loaded: set[tuple[str, int | None]] = set()
    # projection -> its quantized tensors, by the last part of their names.
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in iterate_checkpoint(model_dir):
        ckpt_name = tensor.name
        if (
            ckpt_name.endswith(IGNORED_SUFFIXES)
            or (tied and ckpt_name == "lm_head.weight")
            or ckpt_name in unused
        ):
            continue
        module = None if pre_quantized is None else pre_quantized.quantized_module(ckpt_name)
        if module is not None:
            quantized.setdefault(module, {})[ckpt_name.rpartition(".")[2]] = tensor.read()
            continue
        name, shard = checkpoint_target(ckpt_name, packed_modules)
        param = params.get(name)
        if param is None:
            raise ValueError(
                f"Checkpoint weight {ckpt_name!r} in {tensor.file} has no place in the model."
            )
        tensor.check_float()
        load_weight = getattr(_owner(model, name), "load_weight", None)
        if load_weight is not None:
            load_weight(param, tensor, shard)
        else:
            tensor.check_shape(tuple(param.shape))
            param.data.copy_(tensor.read())
        loaded.add((name, shard))
    if pre_quantized is not None:
        load_quantized_weights(
            model,
            (
                GroupQuantizedTensor(f"{module}.weight", pre_quantized.unpack(module, tensors))
                for module, tensors in quantized.items()
            ),
        )
        loaded.update(checkpoint_target(f"{module}.weight", packed_modules) for module in quantized)
    # NOTE: as for a float checkpoint above, a tied model's LM head is its embedding.
    elsewhere = [t for t in quantized_elsewhere if not (tied and t.name == "lm_head.weight")]
    load_quantized_weights(model, elsewhere)
    loaded.update(checkpoint_target(tensor.name, packed_modules) for tensor in elsewhere)
    missing = sorted(
        f"{name}" + (f"[shard {s}]" if s is not None else "") for name, s in expected - loaded
    )
    if missing:
        raise ValueError(f"Checkpoint in {model_dir} lacks weights: {', '.join(missing[:10])}.")


def load_quantized_weights(model: nn.Module, tensors: Iterable[GroupQuantizedTensor]) -> None:
    """Hand each group-quantized checkpoint tensor to the layer it belongs to, which keeps
    its rank's part still quantized."""
    packed_modules: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    for tensor in tensors:
        name, shard = checkpoint_target(tensor.name, packed_modules)
        layer = _owner(model, name)
        if not (
            isinstance(layer, Linear) and isinstance(layer.quant_method, GroupQuantizedLinearMethod)
        ):
            raise ValueError(
                f"Quantized checkpoint weight {tensor.name!r} has no quantized layer to go to."
            )
        layer.quant_method.load_quantized(layer, tensor, shard)


def _shards(model: nn.Module, param_name: str) -> list[int | None]:
    """The checkpoint tensors (shards) that fill one parameter: one, or one per projection."""
    num_shards = getattr(_owner(model, param_name), "num_checkpoint_shards", None)
    return [None] if num_shards is None else list(range(num_shards))


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])
