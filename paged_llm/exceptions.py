"""Errors that scripts written for vLLM catch by name."""

from __future__ import annotations

from typing import Any


class VLLMValidationError(ValueError):
    """A request or setting that fails validation, as ``vllm.exceptions.VLLMValidationError``.

    A ValueError, so ``except ValueError`` keeps working; ``parameter`` names the field that
    failed and ``value`` holds what it was given, so a caller can report or fix it without
    parsing the message.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value
