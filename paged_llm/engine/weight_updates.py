"""New weights for a live model, in transformers' parameter names: checked whole on rank 0
before anything changes, then copied into every rank's layers in their own formats.

A weight update is what `load_weights` does with a checkpoint, with tensors in memory: each
layer keeps its rank's part (`Linear.param_part`), a packed projection its slice, a
load-time-quantized layer re-quantizes the new float rows. A layer whose matmul runs from a
oneDNN-packed copy is unpacked (exactly) unless the update replaces all of it, updated,
and packed again. Tensors are copied in place where the layer keeps a dense weight, so
captured CUDA graphs go on reading the new values.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paged_llm.engine.model_runner import ModelRunner
from paged_llm.layers.linear import Linear, return_freed_heap_memory
from paged_llm.layers.weights import CheckpointTensor
from paged_llm.loader import IGNORED_SUFFIXES, checkpoint_target

# What `LLM.update_weights` takes: (transformers' parameter name, tensor) pairs.
NamedTensors = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one named tensor goes: our parameter, its owner, and the packed slice."""

    tensor: CheckpointTensor
    param_name: str
    shard: int | None


def check_weight_update(runner: ModelRunner, weights: NamedTensors) -> None:
    """A ValueError naming the first tensor that has no place in the model, is not a
    floating-point tensor, or has the wrong shape; the model is left unchanged."""
    _targets(runner, weights)


def apply_weight_update(runner: ModelRunner, weights: NamedTensors) -> None:
    """Copy ``weights`` into this rank's model (checked by `check_weight_update`)."""
    model = runner.model
    params = dict(model.named_parameters())
    by_owner: dict[str, list[_Target]] = defaultdict(list)
    for target in _targets(runner, weights):
        by_owner[_owner_name(target.param_name)].append(target)
    repacked = False
    with torch.no_grad():
        for owner_name, targets in by_owner.items():
            owner = model.get_submodule(owner_name)
            if not isinstance(owner, Linear):
                for target in targets:
                    params[target.param_name].copy_(target.tensor.read())
                continue
            weight_name = f"{owner_name}.weight"
            unpacked = owner.prepacked and any(t.param_name == weight_name for t in targets)
            if unpacked:
                _unpack(owner, {t.shard for t in targets if t.param_name == weight_name})
            for target in targets:
                param = owner.weight if target.param_name == weight_name else owner.bias
                assert isinstance(param, nn.Parameter)
                owner.load_weight(param, target.tensor, target.shard)
            if unpacked:
                owner.prepack(keep_dense_weight=False)
                repacked = True
    if repacked:
        return_freed_heap_memory()


def _unpack(layer: Linear, shards: set[int | None]) -> None:
    """Give a prepacked layer a dense weight to update: its current values, unless every
    shard of it is about to be replaced."""
    replaced = (
        shards == {None}
        if layer.num_checkpoint_shards is None
        else shards == set(range(layer.num_checkpoint_shards))
    )
    if not replaced:
        layer.unpack()
        return
    assert layer.onednn_weight is not None
    layer.weight = nn.Parameter(
        torch.empty(layer.out_features, layer.in_features, dtype=layer.onednn_weight.dtype),
        requires_grad=False,
    )
    layer.onednn_weight = None


def _targets(runner: ModelRunner, weights: NamedTensors) -> list[_Target]:
    model = runner.model
    packed_modules: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    params = dict(model.named_parameters())
    unused: tuple[str, ...] = getattr(model, "unused_checkpoint_weights", ())
    tied = getattr(model.config, "tie_word_embeddings", False)
    quantization = runner.config.quantization
    method = next(
        (m.quant_method for m in model.modules() if isinstance(m, Linear) and m.quant_method),
        None,
    )
    if method is not None and not method.quantizes_at_load:
        raise ValueError(
            f"update_weights cannot re-quantize a pre-quantized checkpoint "
            f"(quantization={quantization!r}): its weights were quantized offline. Load the "
            "float model (with quantization=None, 'int8' or 'fp8') to update its weights."
        )
    targets = []
    for index, item in enumerate(weights):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(
                f"update_weights takes (name, tensor) pairs, as model.named_parameters() or "
                f"state_dict().items() give them; item {index} is {type(item).__name__}."
            )
        name, tensor = item
        if name.endswith(IGNORED_SUFFIXES) or name in unused:
            continue
        if tied and name == "lm_head.weight":
            # One tensor in transformers as here: the tied embedding takes it.
            name = "model.embed_tokens.weight"
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(
                f"update_weights: {name!r} must be a floating-point torch.Tensor, got "
                f"{getattr(tensor, 'dtype', type(tensor).__name__)}."
            )
        param_name, shard = checkpoint_target(name, packed_modules)
        param = params.get(param_name)
        if param is None:
            raise ValueError(
                f"update_weights: {name!r} is no parameter of this model; the names are "
                "transformers' (model.named_parameters()), e.g. "
                "'model.layers.0.self_attn.q_proj.weight'."
            )
        loaded = CheckpointTensor(name, tensor.detach())
        owner = model.get_submodule(_owner_name(param_name))
        if isinstance(owner, Linear):
            owner.param_part(param, loaded, shard)
        else:
            loaded.check_shape(tuple(param.shape))
        targets.append(_Target(loaded, param_name, shard))
    return targets


def _owner_name(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0]
