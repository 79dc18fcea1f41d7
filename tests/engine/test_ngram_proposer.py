"""The n-gram proposer against a scan of the whole context: the same draft after every
extension, whatever the chunking."""

from __future__ import annotations

import random

import pytest

from paged_llm.engine.ngram_proposer import NgramIndex


def scanned_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """What followed the most recent earlier occurrence of the longest recurring suffix."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


@pytest.mark.parametrize(("min_n", "max_n", "vocab"), [(1, 1, 3), (2, 4, 4), (3, 5, 2), (2, 2, 50)])
def test_drafts_equal_a_scan_of_the_context(min_n: int, max_n: int, vocab: int) -> None:
    rng = random.Random(min_n * 100 + max_n * 10 + vocab)
    for _ in range(20):
        index = NgramIndex(min_n, max_n)
        tokens: list[int] = []
        while len(tokens) < 120:
            chunk = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 3, 17]))]
            index.extend(chunk)
            tokens += chunk
            for k in (1, 4):
                assert index.propose(k) == scanned_draft(tokens, min_n, max_n, k)


def test_a_copied_span_is_proposed_and_a_fresh_context_proposes_nothing() -> None:
    index = NgramIndex(2, 4)
    index.extend([5, 6, 7, 8, 9, 10, 11])
    assert index.propose(3) == []
    index.extend([1, 6, 7])  # "6 7" recurs: what followed it before is the draft
    assert index.propose(3) == [8, 9, 10]
    index.extend([8, 9])  # the longest recurring suffix, "6 7 8 9", decides
    assert index.propose(5) == [10, 11, 1, 6, 7]
