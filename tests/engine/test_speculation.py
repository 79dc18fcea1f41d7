"""The parts of n-gram speculation on their own: the proposer against a scan of the whole
context, the acceptance rule, the per-sequence acceptance, the step-cost fit and the plan
of how much to draft."""

from __future__ import annotations

import random

import pytest

from paged_llm.engine.speculation import (
    DraftPlanner,
    NgramIndex,
    SequenceDrafter,
    StepCostModel,
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


def test_a_sequence_s_acceptance_follows_its_recent_drafts_and_returns_to_the_prior_when_idle() -> (
    None
):
    config = SpeculativeConfig(num_speculative_tokens=8)
    rejecting, accepting = SequenceDrafter(config), SequenceDrafter(config)
    assert rejecting.acceptance == 0.5  # the prior
    for _ in range(5):
        rejecting.record(accepted=0)
        accepting.record(accepted=3)
    assert rejecting.acceptance < 0.3 and accepting.acceptance > 0.7
    for _ in range(30):
        rejecting.idle()
    assert rejecting.acceptance == pytest.approx(0.5, abs=0.05)
    for _ in range(5):
        rejecting.record(accepted=1)
    assert rejecting.acceptance > 0.7


def test_the_step_cost_fit_recovers_a_line_and_keeps_its_slope_through_steps_of_one_size() -> None:
    model = StepCostModel()
    assert model.fixed is None and model.per_token is None
    for tokens in [4, 8, 12, 20, 5, 16] * 3:
        model.record(tokens, 0.030 + 0.002 * tokens)
    assert model.per_token == pytest.approx(0.002) and model.fixed == pytest.approx(0.030)
    for _ in range(200):
        model.record(4, 0.040)  # slower now, and every step of one size
    # The slope of the last steps of several sizes (which met the slower ones) stays, and
    # the line goes through the recent steps.
    assert model.per_token == pytest.approx(0.002, rel=0.2)
    assert model.fixed == pytest.approx(0.040 - model.per_token * 4)


def fitted_planner(fixed: float, per_token: float) -> DraftPlanner:
    planner = DraftPlanner()
    for tokens in (1, 3, 5, 9):
        planner.cost.record(tokens, fixed + per_token * tokens)
    return planner


def test_drafts_are_long_where_steps_are_bound_by_the_weights_and_none_where_by_arithmetic() -> (
    None
):
    # Batch 1 of a CPU decode: 33 ms a step, 1 ms a token.
    weight_bound = fitted_planner(fixed=0.033, per_token=0.001)
    assert weight_bound.continuation == 0.5  # the prior
    assert weight_bound.plan([0.9], [4], num_sampling=1, num_tokens=1, budget=100) == [4]
    assert weight_bound.plan([0.5], [4], num_sampling=1, num_tokens=1, budget=100) == [3]
    assert weight_bound.plan([0.05], [4], num_sampling=1, num_tokens=1, budget=100) == [1]
    # The most promising tokens first, within the budget.
    assert weight_bound.plan([0.9, 0.6], [4, 4], 2, 2, budget=3) == [2, 1]
    # Batch 64: the step is mostly per-token arithmetic (80 ms + 128 ms); only a first token
    # that is almost surely accepted pays.
    arithmetic_bound = fitted_planner(fixed=0.080, per_token=0.002)
    assert arithmetic_bound.plan([0.7] * 64, [4] * 64, 64, 64, budget=1000) == [0] * 64
    assert arithmetic_bound.plan([0.99, 0.5], [4, 4], 64, 64, budget=1000) == [1, 0]
    # Once drafts are seen to be accepted whole, their later tokens pay too.
    for _ in range(50):
        arithmetic_bound.record(num_drafted=4, accepted=4)
    assert arithmetic_bound.continuation > 0.95
    planned = arithmetic_bound.plan([0.99, 0.5], [4, 4], 64, 64, budget=1000)
    assert planned[0] >= 3 and planned[1] == 0


def test_until_the_fit_exists_steps_verify_drafts_whole_and_one_token_in_turn() -> None:
    planner = DraftPlanner()
    assert planner.plan([0.1, 0.1, 0.1], [4, 0, 2], 3, 3, budget=5) == [4, 0, 1]
    assert planner.plan([0.1, 0.1, 0.1], [4, 0, 2], 3, 3, budget=5) == [1, 0, 1]
    assert planner.plan([0.1, 0.1, 0.1], [4, 0, 2], 3, 3, budget=5) == [4, 0, 1]
