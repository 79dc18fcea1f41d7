"""Incremental detokenization, for finding stop strings while a sequence grows."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded in front of the output, so that the first output token gets the
# leading-space treatment it would get inside the full text.
_CONTEXT_TOKENS = 5


def decode(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], **kwargs: bool) -> str:
    """The text of one sequence of token ids."""
    text = tokenizer.decode(token_ids, **kwargs)
    # decode() is typed for a batch too (-> list[str]); a flat list of ids gives one str.
    assert isinstance(text, str)
    return text


class IncrementalDetokenizer:
    """The text of a sequence's output, extended one token at a time.

    Each step decodes a short window twice (the tokens already shown, and the same plus
    the new token) and emits the difference. A window ending in an incomplete UTF-8
    character (decoded as U+FFFD) waits for the next token.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self._token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return decode(self._tokenizer, self._token_ids[start:end], **self._decode_kwargs)

    def update(self, token_id: int) -> str:
        """Add a token; return the text it completes (possibly empty)."""
        self._token_ids.append(token_id)
        shown = self._decode(self._prefix_offset, self._read_offset)
        extended = self._decode(self._prefix_offset)
        if len(extended) <= len(shown) or extended.endswith("\ufffd"):
            return ""
        delta = extended[len(shown) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self.text += delta
        return delta


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """The earliest stop string that the last ``num_new_chars`` characters complete, and
    where the text ends because of it."""
    best: tuple[int, str] | None = None
    for stop_str in stop:
        start = max(0, len(text) - num_new_chars - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    return stop_str, index + len(stop_str) if include_stop_str_in_output else index
