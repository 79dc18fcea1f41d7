"""References for the CPU's quantized matmuls, which multiply activations rounded to int8
per block (`cpu_matmul.rounded_activations`): transformers with the same rounding applied to
the input of each quantized layer."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from paged_llm.distributed.model_splits import finest_split
from paged_llm.layers.quantization.cpu_matmul import activation_block, rounded_activations

# A decoder layer's quantized matmuls, by transformers' module names.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Those paged_llm runs as row-parallel layers, their input split over ranks.
SPLIT_INPUT_PROJECTIONS = ("o_proj", "down_proj")


def round_inputs(
    x: torch.Tensor, group_size: int | None, input_split_width: int | None = None
) -> torch.Tensor:
    """``x`` ``[..., K]`` rounded as the CPU kernels round each row before a weight of
    groups of ``group_size`` features (None: one group a row), in a layer whose input is
    whole (``input_split_width`` None) or split over ranks at multiples of
    ``input_split_width``."""
    num_features = x.shape[-1]
    block = activation_block(group_size or num_features, num_features, input_split_width)
    return rounded_activations(x.reshape(-1, num_features), block).view(x.shape).to(x.dtype)


def round_inputs_of(
    model: torch.nn.Module, names: Iterable[str], group_size: int | None
) -> torch.nn.Module:
    """``model`` (transformers', with its ``config``) with the input of every module whose
    last name is in ``names`` rounded (a forward pre-hook), as paged_llm's CPU path
    multiplies it by weights of groups of ``group_size`` (None: one group a row)."""
    wanted = set(names)
    parts = finest_split(model.config)

    def hook(input_split_width: int | None) -> Callable[..., tuple[torch.Tensor, ...]]:
        def round_first(
            _module: torch.nn.Module, args: tuple[torch.Tensor, ...]
        ) -> tuple[torch.Tensor, ...]:
            return (round_inputs(args[0], group_size, input_split_width), *args[1:])

        return round_first

    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in wanted:
            split = module.in_features // parts if last in SPLIT_INPUT_PROJECTIONS else None
            module.register_forward_pre_hook(hook(split))
    return model


# How close (in logits) the reference's two candidates must be where paged_llm's greedy
# token differs from it. Rounding an activation to int8 is a step function: a float32
# difference of one ulp in the value rounded (paged_llm's fused kernels against
# transformers' operators) can move its code by one, a change of 1/127 of its block's
# largest value, and over a few layers that moves logits by hundredths to tenths. Measured
# on the tiny int8 models: first differences at gaps of 0.03-0.26 logits (logits' spread
# 4.0), after 2-27 equal tokens; a wrong kernel differs by whole logits from the first
# token.
NEAR_TIE_LOGITS = 0.5


def accept_near_ties(
    reference: torch.nn.Module,
    prompts: list[list[int]],
    actual: list[list[int]],
    expected: list[list[int]],
) -> list[list[int]]:
    """``expected``, with each sequence that first differs from ``actual`` at a near tie of
    the reference (its logits for both tokens within `NEAR_TIE_LOGITS`) replaced by
    ``actual``'s: what follows a flipped tie is another continuation, not comparable. A
    difference that is no near tie is left, for the caller's equality to fail on."""
    accepted = []
    for prompt, got, want in zip(prompts, actual, expected, strict=True):
        position = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None
        )
        if position is not None:
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + want[:position]])).logits[0, -1]
            if abs(logits[want[position]] - logits[got[position]]) < NEAR_TIE_LOGITS:
                want = got
        accepted.append(want)
    return accepted
