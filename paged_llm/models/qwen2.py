"""Qwen2: the Llama layout with biases on the query, key and value projections."""

from __future__ import annotations

from typing import ClassVar

from paged_llm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias: ClassVar[bool | None] = True
