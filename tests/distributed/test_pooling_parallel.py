"""Pooling under tensor parallelism (two gloo ranks: the hidden states after the final norm
are whole on each, rank 0 pools and applies the replicated classifier head) and data
parallelism (the pooled outputs travel back from the replica processes): the same results
as one process, in input order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paged_llm import LLM
from paged_llm.engine.executor import MultiprocExecutor
from tests.test_pooling import PROMPT_IDS, SETTINGS, token_prompts


def _embed_and_reward(llm: LLM) -> tuple[list[list[float]], list[torch.Tensor]]:
    embeddings = llm.embed(token_prompts(PROMPT_IDS), use_tqdm=False)
    rewards = llm.reward(token_prompts(PROMPT_IDS), use_tqdm=False)
    return [o.outputs.embedding for o in embeddings], [o.outputs.data for o in rewards]


def _assert_same(
    got: tuple[list[list[float]], list[torch.Tensor]],
    expected: tuple[list[list[float]], list[torch.Tensor]],
) -> None:
    for a, b in zip(got[0], expected[0], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    for a, b in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


# NOTE: slow (30 s and 25 s): four engines each, two of them with a second process.
@pytest.mark.slow
def test_pooling_on_two_tensor_parallel_ranks_matches_one(
    tiny_model_dir: Callable[[str], Path], tiny_classifier_dir: Callable[[str, int], Path]
) -> None:
    model_dir = tiny_model_dir("llama")
    settings = {**SETTINGS, "pooler_config": {"pooling_type": "MEAN"}}
    with LLM(model_dir, runner="pooling", **settings) as llm:
        expected = _embed_and_reward(llm)
    with LLM(model_dir, runner="pooling", tensor_parallel_size=2, **settings) as llm:
        assert isinstance(llm.engine.executor, MultiprocExecutor)  # type: ignore[union-attr]
        _assert_same(_embed_and_reward(llm), expected)
    classifier_dir = tiny_classifier_dir("llama", 3)
    with LLM(classifier_dir, **SETTINGS) as llm:
        probs = [o.outputs.probs for o in llm.classify(token_prompts(PROMPT_IDS), use_tqdm=False)]
    with LLM(classifier_dir, tensor_parallel_size=2, **SETTINGS) as llm:
        outputs = llm.classify(token_prompts(PROMPT_IDS), use_tqdm=False)
    for output, expected_probs in zip(outputs, probs, strict=True):
        torch.testing.assert_close(
            torch.tensor(output.outputs.probs), torch.tensor(expected_probs), atol=1e-5, rtol=0
        )


@pytest.mark.slow
def test_pooling_with_two_replicas_matches_one_process(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    model_dir = tiny_model_dir("llama")
    with LLM(model_dir, runner="pooling", **SETTINGS) as llm:
        expected = _embed_and_reward(llm)
    with LLM(model_dir, runner="pooling", data_parallel_size=2, **SETTINGS) as llm:
        _assert_same(_embed_and_reward(llm), expected)
        skipped = llm.embed(["fine", {"prompt_token_ids": []}], on_error="skip", use_tqdm=False)
        assert skipped[0].error is None and skipped[1].error is not None
