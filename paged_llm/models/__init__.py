"""Model registry, keyed by the architecture names of Hugging Face configs."""

from __future__ import annotations

from typing import Any

from paged_llm.models.classifier import (
    LlamaForSequenceClassification,
    Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification,
)
from paged_llm.models.llama import LlamaForCausalLM
from paged_llm.models.qwen2 import Qwen2ForCausalLM
from paged_llm.models.qwen3 import Qwen3ForCausalLM

# NOTE: every architecture so far is a LlamaForCausalLM with switches; the runner relies on
# its interface (forward over a flat batch, compute_logits, tie_weights; a classifier's
# `classify`).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral's decoder is Llama's; its sliding window comes from the config.
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
}


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class implementing the config's architecture, or a ValueError listing ours."""
    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"Model architecture {architectures or '(none in config.json)'} is not supported. "
        f"Supported architectures: {', '.join(sorted(MODEL_REGISTRY))}."
    )
