"""New weights for a live model, in transformers' parameter names: checked whole before
anything changes, then copied into each rank's layers in their own formats.

A weight update is what `load_weights` does with a checkpoint, with tensors in memory: each
layer keeps its rank's part (`Linear.param_part`), a packed projection its slice, a
load-time-quantized layer re-quantizes the new float rows. A layer whose matmul runs from a
oneDNN-packed copy is unpacked (exactly) unless the update replaces all of it, updated,
and packed again. Tensors are copied in place where the layer keeps a dense weight, so
captured CUDA graphs go on reading the new values.

NOTE: the heap is not trimmed after an update (as it is after loading): the old packed
weights' memory, freed, takes the next update's, which would otherwise fault in every page
anew (Qwen3-0.6B-shaped weights: 1.9 s an update with the trim, 0.65-0.8 s without, with a
stable resident size).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paged_llm.engine.model_runner import ModelRunner
from paged_llm.layers.linear import Linear
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


def apply_weight_update(runner: ModelRunner, weights: NamedTensors) -> None:
    """Copy ``weights`` into this rank's model. Every tensor is placed and checked before
    the first is copied: one that has no place in the model, is not floating point or has
    the wrong shape raises a ValueError naming it, the model unchanged. Every rank holds
    the same layers, so a bad update fails on all of them and changes none."""
    model = runner.model
    params = dict(model.named_parameters())
    by_owner: dict[str, list[_Target]] = defaultdict(list)
    for target in _targets(runner, weights):
        by_owner[_owner_name(target.param_name)].append(target)
    with torch.no_grad():
        for owner_name, targets in by_owner.items():
            owner = model.get_submodule(owner_name)
            if not isinstance(owner, Linear):
                for target in targets:
                    params[target.param_name].copy_(target.tensor.read())
                continue
            weight_name = f"{owner_name}.weight"
            new_weight = [t for t in targets if t.param_name == weight_name]
            if owner.prepacked and new_weight:
                _update_packed(owner, new_weight)
            for target in targets:
                if target.param_name != weight_name:
                    assert isinstance(owner.bias, nn.Parameter)
                    owner.load_weight(owner.bias, target.tensor, target.shard)
                elif not owner.prepacked:
                    owner.load_weight(_parameter(owner.weight), target.tensor, target.shard)
            if owner.quant_method is not None and new_weight:
                # Re-pack what loading unpacked (int8's codes on CPU).
                owner.quant_method.process_weights_after_loading(owner)


def _update_packed(layer: Linear, targets: list[_Target]) -> None:
    """Pack a prepacked layer's new weight. Replaced whole, it is packed straight from
    this rank's parts of the new tensors (one pass less than through a dense copy);
    otherwise the dense weight comes back (`Linear.unpack`), takes the new parts, and is
    packed again."""
    shards = {t.shard for t in targets}
    whole = (
        shards == {None}
        if layer.num_checkpoint_shards is None
        else shards == set(range(layer.num_checkpoint_shards))
    )
    assert layer.onednn_weight is not None
    dtype = layer.onednn_weight.dtype
    if whole:
        pieces = []
        for target in sorted(targets, key=lambda t: t.shard or 0):
            part = layer.checkpoint_part(target.tensor, target.shard)
            pieces.append(target.tensor.read(rows=part.rows, cols=part.cols).to(dtype))
        layer.pack(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        return
    layer.unpack()
    for target in targets:
        layer.load_weight(_parameter(layer.weight), target.tensor, target.shard)
    layer.prepack(keep_dense_weight=False)


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    assert isinstance(tensor, nn.Parameter)
    return tensor


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
            "float model to update its weights: quantization='dequantize' for a .gguf file "
            "(kept quantized by default), None, 'int8' or 'fp8' for a float checkpoint."
        )
    # By (parameter, packed slice): a name given twice (a tied model's state_dict names
    # the embedding twice) is copied once, its last tensor winning, as in load_state_dict.
    targets: dict[tuple[str, int | None], _Target] = {}
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
        targets[param_name, shard] = _Target(loaded, param_name, shard)
    return list(targets.values())


def _owner_name(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0]
