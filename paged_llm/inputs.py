"""The prompt forms `LLM.generate` takes, with the names of ``vllm.inputs``."""

from __future__ import annotations

from typing import TypedDict

from paged_llm.lora.request import LoRARequest

__all__ = ["LoRARequest", "PromptType", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the LLM's tokenizer (with its special tokens)."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


# NOTE: total=False on the subclass makes ``prompt`` optional (typing.NotRequired needs 3.11).
class TokensPrompt(_TokenIds, total=False):
    """A prompt as token ids, run as given; ``prompt`` is the text reported back in the
    output, if the caller has it."""

    prompt: str


# What generate() takes for one prompt: text, or one of the dicts above.
PromptType = str | TextPrompt | TokensPrompt
