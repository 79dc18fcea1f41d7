"""The parts of n-gram speculation on their own: the proposer against a scan of the whole
context, the acceptance rule, the per-sequence acceptance and the adaptive draft cap."""

from __future__ import annotations

import random

import pytest

from paged_llm.engine.speculation import (
    AdaptiveDrafting,
    NgramIndex,
    SequenceDrafts,
    num_accepted,
)
from paged_llm.speculative import SpeculativeConfig


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
            tokens += [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 3, 17]))]
            for k in (1, 4):
                assert index.propose(tokens, k) == scanned_draft(tokens, min_n, max_n, k)


def test_a_copied_span_is_proposed_and_a_fresh_context_proposes_nothing() -> None:
    index = NgramIndex(2, 4)
    tokens = [5, 6, 7, 8, 9, 10, 11]
    assert index.propose(tokens, 3) == []
    tokens += [1, 6, 7]  # "6 7" recurs: what followed it before is the draft
    assert index.propose(tokens, 3) == [8, 9, 10]
    tokens += [8, 9]  # the longest recurring suffix, "6 7 8 9", decides
    assert index.propose(tokens, 5) == [10, 11, 1, 6, 7]


@pytest.mark.parametrize(
    ("drawn", "draft", "accepted"),
    [([4, 5, 6], [4, 5], 2), ([4, 9, 6], [4, 5], 1), ([3, 5, 6], [4, 5], 0), ([7], [], 0)],
)
def test_a_draft_token_is_accepted_while_it_is_the_token_drawn_at_its_position(
    drawn: list[int], draft: list[int], accepted: int
) -> None:
    assert num_accepted(drawn, draft) == accepted


def test_a_sequence_that_keeps_rejecting_drafts_one_token_and_one_that_accepts_the_most() -> None:
    config = SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1, prompt_lookup_max=1)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1]
    rejecting, accepting = SequenceDrafts(config), SequenceDrafts(config)
    assert len(rejecting.propose(tokens, 8)) == 2  # the prior: half accepted
    for _ in range(5):
        rejecting.record(num_drafted=2, accepted=0)
        accepting.record(num_drafted=8, accepted=8)
    assert rejecting.acceptance < 0.2 and accepting.acceptance > 0.9
    assert rejecting.propose(tokens, 8) == [2]
    assert accepting.propose(tokens, 8) == [2, 3, 4, 5, 6, 7, 8, 9]


def test_the_adaptive_cap_measures_every_cap_then_keeps_the_fastest_and_remeasures_the_others() -> (
    None
):
    drafting = AdaptiveDrafting(num_speculative_tokens=4)
    assert drafting.caps == [4, 2, 1, 0]
    # Tokens per second by cap: drafting two pays most at batch 1, none at batch 64.
    rates = {1: {4: 30.0, 2: 40.0, 1: 35.0, 0: 20.0}, 64: {4: 50.0, 2: 70.0, 1: 80.0, 0: 100.0}}
    chosen: dict[int, list[int]] = {1: [], 64: []}
    for _ in range(200):
        for batch_size, by_cap in rates.items():
            cap = drafting.choose(batch_size)
            chosen[batch_size].append(cap)
            drafting.record(batch_size, cap, num_emitted=int(by_cap[cap]), seconds=1.0)
    for batch_size, best in ((1, 2), (64, 0)):
        steps = chosen[batch_size]
        assert steps[:8] == [4, 4, 2, 2, 1, 1, 0, 0]  # each cap measured twice, largest first
        later = steps[8:]
        assert later.count(best) >= 0.9 * len(later)
        assert set(later) == {4, 2, 1, 0}  # the others are measured again now and then
