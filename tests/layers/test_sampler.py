"""The batched sampler on fixed logits: exact distributions, penalties, constraints."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from paged_llm.layers.sampler import Sampler, SamplingMetadata, apply_penalties, counter_uniform

LOGITS = [2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.4]
NUM_DRAWS = 40_000
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def expected_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """The filtered distribution, from the definitions: temperature, then min-p, then
    top-k, then top-p (the smallest most-likely set whose mass reaches p)."""
    probs = np.exp(np.array(logits, dtype=np.float64) / temperature)
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    if top_k > 0:
        keep &= probs >= np.sort(probs)[::-1][top_k - 1]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order])
        cut = int(np.searchsorted(cumulative, top_p - 1e-12)) + 1
        kept = np.zeros_like(probs, dtype=bool)
        kept[order[:cut]] = True
        probs = np.where(kept, probs, 0.0)
        probs /= probs.sum()
    return probs


def draw(logits: list[float], **fields: object) -> np.ndarray:
    """Token counts over NUM_DRAWS rows that differ only in their draw counter."""
    rows = torch.tensor([logits] * NUM_DRAWS, dtype=torch.float32)

    def column(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((NUM_DRAWS,), value, dtype=dtype)

    metadata = SamplingMetadata(
        temperature=column(fields.get("temperature", 1.0), torch.float32),
        seeds=column(1234, torch.int64),
        counters=torch.arange(NUM_DRAWS),
        all_greedy=False,
    )
    if fields.get("top_k"):
        metadata.top_k = column(fields["top_k"], torch.int64)
    if fields.get("top_p", 1.0) < 1.0:
        metadata.top_p = column(fields["top_p"], torch.float32)
    if fields.get("min_p"):
        metadata.min_p = column(fields["min_p"], torch.float32)
    tokens = Sampler()(rows, metadata).token_ids
    return np.bincount(tokens.numpy(), minlength=len(logits))


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 2.0},
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 1.0, "top_p": 0.6},
        {"temperature": 0.7, "top_p": 0.85},
        {"temperature": 1.0, "min_p": 0.3},
        {"temperature": 1.3, "top_k": 5, "top_p": 0.8},
        {"temperature": 0.8, "top_k": 6, "top_p": 0.9, "min_p": 0.05},
    ],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()),
)
def test_token_frequencies_match_the_filtered_distribution(fields: dict) -> None:
    expected = expected_distribution(
        LOGITS,
        fields["temperature"],
        fields.get("top_k", 0),
        fields.get("top_p", 1.0),
        fields.get("min_p", 0.0),
    )
    counts = draw(LOGITS, **fields)
    assert np.all(counts[expected == 0] == 0), "a filtered-out token was drawn"
    support = expected > 0
    assert np.all(counts[support] > 0)
    expected_counts = expected[support] * NUM_DRAWS
    chi2 = float(((counts[support] - expected_counts) ** 2 / expected_counts).sum())
    assert chi2 < CHI2_CRITICAL[int(support.sum()) - 1]


def test_top_p_keeps_the_token_that_crosses_p() -> None:
    # Probabilities 0.4, 0.3, 0.2, 0.1: the first two reach p = 0.6 only together.
    logits = np.log([0.4, 0.3, 0.2, 0.1]).tolist()
    counts = draw(logits, top_p=0.6)
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / NUM_DRAWS - 4 / 7) < 0.01 and abs(counts[1] / NUM_DRAWS - 3 / 7) < 0.01


def test_counter_uniform_is_uniform_and_keyed_by_seed_and_counter() -> None:
    counters = torch.arange(200_000)
    u = counter_uniform(torch.full_like(counters, 99), counters).numpy()
    assert u.min() >= 0.0 and u.max() < 1.0
    histogram = np.histogram(u, bins=20, range=(0, 1))[0]
    expected = len(u) / 20
    assert ((histogram - expected) ** 2 / expected).sum() < 45.3  # chi2, 19 dof, p=0.001
    other_seed = counter_uniform(torch.full_like(counters, 100), counters).numpy()
    assert abs(np.corrcoef(u, other_seed)[0, 1]) < 0.01
    # Same (seed, counter), same number, wherever the row sits.
    shuffled = torch.randperm(len(counters))
    again = counter_uniform(torch.full_like(counters, 99), counters[shuffled]).numpy()
    assert np.array_equal(again, u[shuffled.numpy()])


def test_repetition_penalty_equals_transformers() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    prompts = [[1, 2, 3, 3], [10, 11], [49]]
    outputs = [[4, 4, 5], [], [1, 2]]
    penalty = 1.7
    expected = torch.cat(
        [
            RepetitionPenaltyLogitsProcessor(penalty)(
                torch.tensor([p + o]), logits[i : i + 1].clone()
            )
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
        ]
    )
    metadata = _penalty_metadata(prompts, outputs, repetition=penalty)
    assert torch.allclose(apply_penalties(logits.clone(), metadata), expected)


def test_presence_and_frequency_follow_vllm() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    prompts = [[7, 7, 8], [1]]
    outputs = [[3, 3, 3, 5], [7]]
    metadata = _penalty_metadata(prompts, outputs, presence=0.5, frequency=0.25)
    expected = logits.clone()
    for row, output in enumerate(outputs):
        for token in set(output):
            # Only generated tokens count; prompt tokens are not penalized.
            expected[row, token] -= 0.25 * output.count(token) + 0.5
    assert torch.allclose(apply_penalties(logits.clone(), metadata), expected)


def _penalty_metadata(
    prompts: list[list[int]],
    outputs: list[list[int]],
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> SamplingMetadata:
    num_rows, vocab = len(prompts), 50
    counts = torch.zeros(num_rows, vocab)
    prompt_mask = torch.zeros(num_rows, vocab, dtype=torch.bool)
    for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for token in output:
            counts[row, token] += 1
        prompt_mask[row, prompt] = True
    column = lambda value: torch.full((num_rows,), value)  # noqa: E731
    return SamplingMetadata(
        temperature=column(0.0),
        seeds=column(0).long(),
        counters=column(0).long(),
        all_greedy=True,
        presence_penalty=column(presence) if presence else None,
        frequency_penalty=column(frequency) if frequency else None,
        repetition_penalty=column(repetition) if repetition != 1.0 else None,
        output_token_counts=counts,
        prompt_token_mask=prompt_mask,
    )


def test_greedy_rows_bans_bias_and_logprobs_in_one_batch() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    banned = torch.tensor([[False] * 4, [False, True, False, False], [False] * 4])
    bias = torch.tensor([[0.0] * 4, [0.0] * 4, [5.0, 0.0, 0.0, 0.0]])
    metadata = SamplingMetadata(
        temperature=torch.zeros(3),
        seeds=torch.zeros(3, dtype=torch.long),
        counters=torch.zeros(3, dtype=torch.long),
        all_greedy=True,
        banned_tokens=banned,
        logit_bias=bias,
        max_num_logprobs=2,
    )
    output = Sampler()(logits.clone(), metadata)
    assert output.token_ids.tolist() == [1, 3, 0]
    raw = torch.log_softmax(logits, dim=-1)
    assert output.logprobs is not None
    # Logprobs describe the raw distribution: bias and bans do not change them.
    assert output.logprobs.ranks.tolist() == [1, 2, 4]
    assert output.logprobs.token_ids[:, 1:].tolist() == [[1, 3]] * 3
    assert torch.allclose(output.logprobs.logprobs[:, 0], raw[torch.arange(3), output.token_ids])


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_rows_whose_masks_leave_no_token_are_reported_and_never_drawn_from_nan(
    greedy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 1's bans cover every token, row 2's grammar left nothing (-inf everywhere),
    row 0 is free: row 0 keeps its token, rows 1 and 2 are reported, nothing sees NaN."""
    import paged_llm.layers.sampler as sampler_module

    inverse_cdf = sampler_module._inverse_cdf_sample

    def checked(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        assert not probs.isnan().any(), "the sampler drew from NaN probabilities"
        return inverse_cdf(probs, uniforms)

    monkeypatch.setattr(sampler_module, "_inverse_cdf_sample", checked)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    logits[2] = float("-inf")
    banned = torch.tensor([[False] * 4, [True] * 4, [False] * 4])
    metadata = SamplingMetadata(
        temperature=torch.full((3,), 0.0 if greedy else 1.0),
        seeds=torch.zeros(3, dtype=torch.long),
        counters=torch.zeros(3, dtype=torch.long),
        all_greedy=greedy,
        banned_tokens=banned,
        grammar_masked=True,
    )
    output = Sampler()(logits.clone(), metadata)
    assert output.no_token is not None
    assert output.no_token.tolist() == [False, True, True]
    assert output.token_ids.min() >= 0 and output.token_ids.max() < 4
    if greedy:
        assert output.token_ids[0] == 1


def test_a_step_without_masks_skips_the_empty_row_check() -> None:
    metadata = SamplingMetadata(
        temperature=torch.zeros(1),
        seeds=torch.zeros(1, dtype=torch.long),
        counters=torch.zeros(1, dtype=torch.long),
        all_greedy=True,
    )
    output = Sampler()(torch.tensor([[0.0, 3.0, 1.0]]), metadata)
    assert output.no_token is None and output.token_ids.tolist() == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_of_tied_maxima(dtype: torch.dtype) -> None:
    """As transformers' argmax does, on rows of many ties (wider than a vector)."""
    torch.manual_seed(0)
    logits = torch.randint(0, 3, (64, 300)).to(dtype)
    metadata = SamplingMetadata(
        temperature=torch.zeros(64),
        seeds=torch.zeros(64, dtype=torch.int64),
        counters=torch.zeros(64, dtype=torch.int64),
        all_greedy=True,
    )
    tokens = Sampler()(logits, metadata).token_ids
    first_maxima = [row.tolist().index(row.max().item()) for row in logits]
    assert tokens.tolist() == first_maxima
