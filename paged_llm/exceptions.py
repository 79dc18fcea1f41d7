"""Errors as values: what failed, where, and why, formatted only where it is shown.

`VLLMValidationError` is the class scripts written for vLLM catch by name. `RequestError`
and `ConversationError` carry the position of what failed (a request's index in its call, a
message's in its conversation) apart from the reason, so each entry point words the
location its own way: `LLM` as "Request 3: ...", the JSONL job as "line 7: ...", an OpenAI
batch file as a status-400 line naming ``param``.
"""

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


class RequestError(VLLMValidationError):
    """Why one request of a call cannot run: ``reason`` (a sentence, with the fix where
    there is one), the ``parameter`` at fault (None where no single one is) and its
    ``value``, and ``index``, the request's position in its call (None until the intake
    knows it). ``str()`` is ``"Request {index}: {reason}"``."""

    def __init__(
        self,
        reason: str,
        *,
        parameter: str | None = None,
        value: Any = None,
        index: int | None = None,
    ) -> None:
        super().__init__(
            reason if index is None else f"Request {index}: {reason}",
            parameter=parameter,
            value=value,
        )
        self.reason = reason
        self.index = index

    @classmethod
    def of(cls, error: ValueError, index: int | None = None) -> RequestError:
        """``error`` (a params or prompt check's) as a `RequestError`, of request
        ``index`` where that is known."""
        reason = error.reason if isinstance(error, RequestError) else str(error)
        parameter = getattr(error, "parameter", None)
        return cls(reason, parameter=parameter, value=getattr(error, "value", None), index=index)


class ConversationError(ValueError):
    """Why a chat conversation cannot be rendered: ``reason``, and ``message``, the
    position of the message at fault (None where it is the conversation as a whole)."""

    def __init__(self, reason: str, *, message: int | None = None) -> None:
        super().__init__(reason if message is None else f"message {message}: {reason}")
        self.reason = reason
        self.message = message
