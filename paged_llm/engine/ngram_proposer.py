"""Prompt-lookup drafts for n-gram speculative decoding: for a sequence's tokens so far, the
tokens that followed the most recent earlier occurrence of its longest suffix of
``min_n``..``max_n`` tokens.

Each sequence keeps an index per n-gram length from the n-gram to where its most recent
occurrence ended, updated as tokens arrive (``max_n - min_n + 1`` dictionary writes a
token), so a proposal costs a few lookups, never a scan of the context. The suffix itself
joins the index one token late: looked up, it would point at itself, with nothing after it.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The n-gram index of one token sequence (its prompt and output so far)."""

    __slots__ = ("_ends", "_num_indexed", "max_n", "min_n", "tokens")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n -> {n-gram: the position just after its most recent indexed occurrence}.
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        # Tokens whose n-grams ending there are indexed: all but the last one.
        self._num_indexed = 0

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (the prompt, then each step's accepted ones)."""
        self.tokens.extend(tokens)
        # Index the n-grams ending at every token but the new last one.
        for end in range(self._num_indexed + 1, len(self.tokens)):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(self.tokens[end - n : end])] = end
        self._num_indexed = max(self._num_indexed, len(self.tokens) - 1)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` draft tokens: what followed the most recent earlier
        occurrence of the longest matching suffix; empty where no suffix recurs."""
        length = len(self.tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if length < n:
                continue
            end = self._ends[n].get(tuple(self.tokens[length - n :]))
            if end is not None:
                return self.tokens[end : end + num_tokens]
        return []
