"""Qwen3: the Llama layout with an RMSNorm on every query and key head."""

from __future__ import annotations

from typing import ClassVar

from paged_llm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm: ClassVar[bool] = True
