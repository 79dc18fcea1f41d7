"""Sequence classifiers (transformers' ``*ForSequenceClassification``): the decoder with a
``score`` head of ``num_labels`` outputs and no bias instead of the LM head.

The head is small (hidden_size x num_labels) and replicated on every rank: the hidden
states after the final norm are whole on each, and rank 0 applies it to the pooled rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from paged_llm.models.context import ModelContext
from paged_llm.models.llama import LlamaForCausalLM


class LlamaForSequenceClassification(LlamaForCausalLM):
    """Llama (and Mistral) with transformers' classifier head."""

    def __init__(self, config: Any, context: ModelContext) -> None:
        super().__init__(config, dataclasses.replace(context, lm_head=False))
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits of ``hidden``'s rows."""
        logits: torch.Tensor = self.score(hidden.to(self.score.weight.dtype))
        return logits


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    qkv_bias: ClassVar[bool | None] = True


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    qk_norm: ClassVar[bool] = True
