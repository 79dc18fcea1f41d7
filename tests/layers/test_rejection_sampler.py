"""The rejection sampler against its target: on a small vocabulary, the first emitted token
and the two-token sequences follow the target distributions (chi-square), whatever the
draft; greedy verification emits greedy decoding's tokens."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from paged_llm.layers.rejection_sampler import verify_greedy, verify_sampled

VOCAB = 5
SAMPLES = 20_000


def distributions(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, VOCAB, generator=generator) * 1.5
    probs = logits.softmax(dim=-1)
    probs[1, 3] = 0.0  # a token the target never takes, drafted below
    return probs / probs.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("draft", [[0, 1], [3, 3], [4, 2]])
def test_emitted_tokens_follow_the_target(draft: list[int]) -> None:
    """The draft is fixed, so for the test the target at the second position does not
    depend on the first token; the emitted pair must still be distributed as p0 x p1."""
    probs = distributions(seed=sum(draft))
    generator = torch.Generator().manual_seed(7)
    firsts = torch.zeros(VOCAB)
    pairs = torch.zeros(VOCAB, VOCAB)
    for _ in range(SAMPLES):
        emitted = verify_sampled(probs, draft, generator)
        firsts[emitted[0]] += 1
        if len(emitted) >= 2:
            pairs[emitted[0], emitted[1]] += 1
    assert chisquare(firsts.numpy(), (probs[0] * SAMPLES).numpy()).pvalue > 1e-3
    # Given the first token was the accepted draft token, the second follows p1.
    second = pairs[draft[0]]
    if second.sum() > 100:
        expected = probs[1] * second.sum()
        kept = expected > 0
        assert second[~kept].sum() == 0
        assert chisquare(second[kept].numpy(), expected[kept].numpy()).pvalue > 1e-3


def test_seeded_draws_repeat() -> None:
    probs = distributions(seed=3)
    runs = [
        [verify_sampled(probs, [1, 2], torch.Generator().manual_seed(11)) for _ in range(1)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("draft", list(itertools.product(range(3), repeat=2)))
def test_greedy_verification_emits_the_argmax_run(draft: tuple[int, int]) -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    emitted = verify_greedy(logits, list(draft))
    greedy = [1, 0, 2]
    accepted = 0
    while accepted < 2 and draft[accepted] == greedy[accepted]:
        accepted += 1
    assert emitted == greedy[: accepted + 1]
