"""Pooling models through the paged engine, against transformers on the same float32
weights: embeddings (LAST, MEAN, CLS; normalized or not; Matryoshka dimensions) of every
architecture, alone and in mixed batches, chunked and with prefix caching; classifier
probabilities; scores (cosine, cross-encoder); per-token rewards; `encode`'s tasks; the
misuse errors and ``on_error="skip"``."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from paged_llm import LLM, SamplingParams
from paged_llm.config import PoolerConfig
from paged_llm.exceptions import RequestError, VLLMValidationError
from paged_llm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from paged_llm.pooling_params import PoolingParams
from tests.conftest import TINY_MODELS

TOLERANCE = 1e-4
# A budget smaller than the longer prompts, so they are prefilled in chunks, and small
# blocks, so a repeated prompt finds several of them cached.
SETTINGS = {"max_num_batched_tokens": 16, "block_size": 4, "kv_cache_memory_bytes": 2**24}
# Mixed lengths (one over the budget three times); no id is the pad/EOS token 2, which
# transformers' classifier would skip when it picks the last token.
PROMPT_IDS = [
    [100 + 7 * i for i in range(5)],
    [300 + 11 * i for i in range(41)],
    [50],
    [900 + 13 * i for i in range(19)],
]
TEXTS = ["The capital of France is", "A quick brown fox jumps over the lazy dog, twice."]


def token_prompts(ids: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": prompt} for prompt in ids]


@functools.cache
def hf_model(model_dir: Path, classifier: bool = False) -> torch.nn.Module:
    auto = (
        transformers.AutoModelForSequenceClassification
        if classifier
        else transformers.AutoModelForCausalLM
    )
    return auto.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_hidden(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' hidden states after the final norm: ``[num_tokens, hidden_size]``."""
    with torch.no_grad():
        states = hf_model(model_dir).model(torch.tensor([ids])).last_hidden_state[0]
    return states


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """A transformers classifier's logits of one unpadded sequence."""
    with torch.no_grad():
        return hf_model(model_dir, classifier=True)(torch.tensor([ids])).logits[0]


def pooled(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": states[-1], "CLS": states[0], "MEAN": states.mean(dim=0)}[pooling_type]


def assert_close(actual: list[float] | torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), expected, atol=TOLERANCE, rtol=0
    )


@pytest.mark.parametrize(
    ("arch", "pooling_type"),
    # Every pooling of Llama and the LAST pooling of every architecture in the default run;
    # the other architectures' MEAN and CLS (4 s each) in the slow one.
    [
        pytest.param(
            arch,
            pooling_type,
            marks=() if arch == "llama" or pooling_type == "LAST" else pytest.mark.slow,
        )
        for arch in TINY_MODELS
        for pooling_type in ("LAST", "MEAN", "CLS")
    ],
)
def test_embeddings_equal_transformers_hidden_states_pooled(
    arch: str, pooling_type: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    model_dir = tiny_model_dir(arch)
    # The second prompt again at the end: its blocks are in the prefix cache by then.
    ids = [*PROMPT_IDS, PROMPT_IDS[1]]
    expected = [pooled(hf_hidden(model_dir, prompt), pooling_type) for prompt in ids]
    with LLM(
        model_dir, runner="pooling", pooler_config={"pooling_type": pooling_type}, **SETTINGS
    ) as llm:
        for params, post in [
            (None, lambda v: F.normalize(v, dim=-1)),
            (PoolingParams(normalize=False), lambda v: v),
            (PoolingParams(dimensions=16), lambda v: F.normalize(v[:16], dim=-1)),
        ]:
            outputs = llm.embed(token_prompts(ids), params, use_tqdm=False)
            assert all(isinstance(output, EmbeddingRequestOutput) for output in outputs)
            for output, vector in zip(outputs, expected, strict=True):
                assert_close(output.outputs.embedding, post(vector))
        # Alone, and with prefix caching: LAST reads the cached blocks, the others do not.
        (alone,) = llm.embed(token_prompts(ids[1:2]), use_tqdm=False)
        assert_close(alone.outputs.embedding, F.normalize(expected[1], dim=-1))
        assert (alone.num_cached_tokens > 0) == (pooling_type == "LAST")


def test_text_prompts_embed_as_their_token_ids(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir("llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with LLM(model_dir, runner="pooling", **SETTINGS) as llm:
        by_text = llm.embed(TEXTS, use_tqdm=False)
        by_dict = llm.embed([{"prompt": text} for text in TEXTS], use_tqdm=False)
    for text, output, other in zip(TEXTS, by_text, by_dict, strict=True):
        ids = tokenizer(text)["input_ids"]
        assert output.prompt_token_ids == ids and output.prompt == text
        assert_close(output.outputs.embedding, F.normalize(hf_hidden(model_dir, ids)[-1], dim=-1))
        # The second call reads the first one's blocks from the prefix cache.
        assert_close(other.outputs.embedding, torch.tensor(output.outputs.embedding))


@pytest.mark.parametrize("arch", list(TINY_MODELS))
def test_classifier_probabilities_equal_transformers_softmax(
    arch: str, tiny_classifier_dir: Callable[[str, int], Path]
) -> None:
    model_dir = tiny_classifier_dir(arch, 3)
    with LLM(model_dir, **SETTINGS) as llm:
        assert llm.config.pooler is not None and llm.config.pooler.convert == "classify"
        outputs = llm.classify(token_prompts(PROMPT_IDS), use_tqdm=False)
        raw = llm.classify(
            token_prompts(PROMPT_IDS), PoolingParams(use_activation=False), use_tqdm=False
        )
        # vLLM's older name of use_activation.
        (softmax_off,) = llm.classify(
            token_prompts(PROMPT_IDS[:1]), PoolingParams(softmax=False), use_tqdm=False
        )
    for ids, output, logits_output in zip(PROMPT_IDS, outputs, raw, strict=True):
        logits = hf_logits(model_dir, ids)
        assert isinstance(output, ClassificationRequestOutput)
        assert output.outputs.num_classes == 3
        assert_close(output.outputs.probs, logits.softmax(dim=-1))
        assert_close(logits_output.outputs.probs, logits)
    assert softmax_off.outputs.probs == raw[0].outputs.probs


def test_a_one_label_classifier_applies_a_sigmoid_and_scores_pairs_as_a_cross_encoder(
    tiny_classifier_dir: Callable[[str, int], Path],
) -> None:
    model_dir = tiny_classifier_dir("llama", 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    queries = ["What is the capital of France?", "Who wrote Hamlet?"]
    documents = ["Paris is the capital of France.", "Shakespeare wrote many plays."]
    with LLM(model_dir, **SETTINGS) as llm:
        (classified,) = llm.classify(token_prompts(PROMPT_IDS[1:2]), use_tqdm=False)
        one_to_n = llm.score(queries[0], documents, use_tqdm=False)
        n_to_n = llm.score(queries, documents, use_tqdm=False)
    assert_close(classified.outputs.probs, hf_logits(model_dir, PROMPT_IDS[1]).sigmoid())
    for outputs, pairs in [
        (one_to_n, [(queries[0], document) for document in documents]),
        (n_to_n, list(zip(queries, documents, strict=True))),
    ]:
        for output, (query, document) in zip(outputs, pairs, strict=True):
            ids = tokenizer(query, document)["input_ids"]
            assert isinstance(output, ScoringRequestOutput) and output.prompt_token_ids == ids
            assert_close(output.outputs.score, hf_logits(model_dir, ids).sigmoid()[0])


def test_score_of_an_embedding_model_is_the_cosine_of_the_embeddings(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    model_dir = tiny_model_dir("qwen2")
    first, second = token_prompts(PROMPT_IDS[:2]), token_prompts(PROMPT_IDS[2:])
    with LLM(model_dir, runner="pooling", **SETTINGS) as llm:
        one_to_n = llm.score(first[0], second, use_tqdm=False)
        n_to_n = llm.score(first, second, use_tqdm=False)
    last = [hf_hidden(model_dir, ids)[-1] for ids in PROMPT_IDS]
    assert [o.outputs.score for o in one_to_n] == pytest.approx(
        [F.cosine_similarity(last[0], last[j], dim=0).item() for j in (2, 3)], abs=TOLERANCE
    )
    assert [o.outputs.score for o in n_to_n] == pytest.approx(
        [F.cosine_similarity(last[i], last[i + 2], dim=0).item() for i in (0, 1)],
        abs=TOLERANCE,
    )
    assert n_to_n[1].prompt_token_ids == PROMPT_IDS[1] + PROMPT_IDS[3]


def test_reward_and_encode_give_every_tokens_output(
    tiny_model_dir: Callable[[str], Path], tiny_classifier_dir: Callable[[str, int], Path]
) -> None:
    model_dir = tiny_model_dir("mistral")
    states = [hf_hidden(model_dir, ids) for ids in PROMPT_IDS]
    with LLM(model_dir, runner="pooling", **SETTINGS) as llm:
        rewards = llm.reward(token_prompts(PROMPT_IDS), use_tqdm=False)
        encoded = {
            task: llm.encode(token_prompts(PROMPT_IDS), pooling_task=task, use_tqdm=False)
            for task in ("embed", "token_embed", "encode")
        }
    for i, hidden in enumerate(states):
        assert isinstance(rewards[i], PoolingRequestOutput)
        assert rewards[i].outputs.data.shape == (len(PROMPT_IDS[i]), 64)
        assert_close(rewards[i].outputs.data, hidden)
        assert_close(encoded["encode"][i].outputs.data, hidden)
        assert_close(encoded["token_embed"][i].outputs.data, F.normalize(hidden, dim=-1))
        assert_close(encoded["embed"][i].outputs.data, F.normalize(hidden[-1], dim=-1))

    classifier_dir = tiny_classifier_dir("qwen3", 3)
    with LLM(classifier_dir, **SETTINGS) as llm:
        by_task = {
            task: llm.encode(token_prompts(PROMPT_IDS), pooling_task=task, use_tqdm=False)
            for task in ("classify", "token_classify", "reward")
        }
    for i, ids in enumerate(PROMPT_IDS):
        with torch.no_grad():
            classifier = hf_model(classifier_dir, classifier=True)
            token_logits = classifier.score(classifier.model(torch.tensor([ids]))[0][0])
        assert_close(by_task["classify"][i].outputs.data, token_logits[-1].softmax(dim=-1))
        assert_close(by_task["token_classify"][i].outputs.data, token_logits.softmax(dim=-1))
        assert_close(by_task["reward"][i].outputs.data, token_logits)


def test_a_reward_model_pools_all_tokens_by_default(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir("llama")
    with LLM(model_dir, runner="pooling", convert="reward", **SETTINGS) as llm:
        (reward,) = llm.reward(token_prompts(PROMPT_IDS[1:2]), use_tqdm=False)
        with pytest.raises(ValueError, match=r"cannot serve the 'embed' task.*pooling_type"):
            llm.embed("hello")
    assert_close(reward.outputs.data, hf_hidden(model_dir, PROMPT_IDS[1]))


def test_outputs_pickle(tiny_model_dir: Callable[[str], Path]) -> None:
    with LLM(tiny_model_dir("llama"), runner="pooling", **SETTINGS) as llm:
        (output,) = llm.embed("hello", use_tqdm=False)
        (raw,) = llm.encode("hello", use_tqdm=False)
    assert pickle.loads(pickle.dumps(output)) == output
    assert torch.equal(pickle.loads(pickle.dumps(raw)).outputs.data, raw.outputs.data)


def test_misuse_is_an_error_naming_the_fix(
    tiny_model_dir: Callable[[str], Path], tiny_classifier_dir: Callable[[str, int], Path]
) -> None:
    model_dir = tiny_model_dir("llama")
    with LLM(model_dir, max_model_len=64, **SETTINGS) as llm:
        with pytest.raises(ValueError, match=r"LLM.embed needs a pooling model.*runner='pooling'"):
            llm.embed("hello")
        with pytest.raises(ValueError, match=r"runner='pooling'"):
            llm.score("a", "b")
    with LLM(model_dir, runner="pooling", max_model_len=64, **SETTINGS) as llm:
        for call in (
            lambda: llm.generate("hello", SamplingParams(max_tokens=2)),
            lambda: llm.chat([{"role": "user", "content": "hi"}]),
        ):
            with pytest.raises(ValueError, match=r"is a pooling model.*runner='generate'"):
                call()
        with pytest.raises(ValueError, match=r"cannot serve the 'classify' task.*Sequence"):
            llm.classify("hello")
        with pytest.raises(ValueError, match="pooling_task must be one of"):
            llm.encode("hello", pooling_task="generate")
        too_long = {"prompt_token_ids": list(range(100, 165))}
        with pytest.raises(RequestError, match=r"Request 1: the prompt has 65 tokens.*64"):
            llm.embed(["fine", too_long])
        # A prompt as long as max_model_len fits: a pooling request generates nothing.
        assert len(llm.embed({"prompt_token_ids": list(range(100, 164))})) == 1
        with pytest.raises(RequestError, match=r"use_activation.*does not apply to the 'embed'"):
            llm.embed("hello", PoolingParams(use_activation=True))
        with pytest.raises(RequestError, match=r"dimensions=65 is more than.*hidden_size=64"):
            llm.embed("hello", PoolingParams(dimensions=65))
        skipped = llm.embed(["fine", too_long, "also fine"], on_error="skip", use_tqdm=False)
        assert [output.error is None for output in skipped] == [True, False, True]
        assert skipped[1].outputs is None and skipped[1].error_parameter == "prompt"
        assert "the prompt has 65 tokens" in (skipped[1].error or "")
        # Truncation keeps the last tokens, as vLLM's.
        (truncated,) = llm.embed(too_long, truncate_prompt_tokens=10, use_tqdm=False)
        assert truncated.prompt_token_ids == too_long["prompt_token_ids"][-10:]
    with (
        LLM(tiny_classifier_dir("llama", 3), **SETTINGS) as llm,
        pytest.raises(ValueError, match=r"needs one label.*LLM.classify"),
    ):
        llm.score("a", "b")
    with pytest.raises(ValueError, match=r"no LM head.*runner='pooling'"):
        LLM(tiny_classifier_dir("llama", 3), runner="generate")
    with pytest.raises(ValueError, match=r"convert='classify' needs a classifier head"):
        LLM(model_dir, runner="pooling", convert="classify")
    with pytest.raises(ValueError, match=r"convert='embed' configures a pooling model"):
        LLM(model_dir, convert="embed")


@pytest.mark.parametrize(
    ("make", "parameter"),
    [
        (lambda: PoolingParams(dimensions=0), "dimensions"),
        (lambda: PoolingParams(normalize="yes"), "normalize"),
        (lambda: PoolingParams(use_activation=True, softmax=False), "use_activation"),
        (lambda: PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (lambda: PoolerConfig(pooling_type="MAX"), "pooling_type"),
    ],
)
def test_params_are_checked_on_construction(make: Callable[[], object], parameter: str) -> None:
    with pytest.raises(VLLMValidationError, match=parameter) as raised:
        make()
    assert raised.value.parameter == parameter


def test_encode_stream_yields_each_output_with_its_index_and_errors_as_values(
    llama_dir: Path,
) -> None:
    from paged_llm.frontend.input_processor import RejectedRequest

    prompts = [{"prompt_token_ids": [100 + i] * (3 + i)} for i in range(3)]
    prompts.insert(1, {"prompt_token_ids": []})
    with LLM(llama_dir, runner="pooling", max_model_len=64) as llm:
        expected = llm.embed([prompts[0], *prompts[2:]], use_tqdm=False)
        stream = llm.encode_stream(prompts, pooling_task="embed", on_error="skip")
        results = dict(stream.results())
    assert sorted(results) == [0, 1, 2, 3]
    assert isinstance(results[1], RejectedRequest) and results[1].error.parameter == "prompt"
    for index, want in zip([0, 2, 3], expected, strict=True):
        torch.testing.assert_close(
            results[index].outputs.data, torch.tensor(want.outputs.embedding)
        )


def test_llm_engine_runs_pooling_requests_beside_the_loop(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    from paged_llm import EngineArgs, LLMEngine

    model_dir = tiny_model_dir("qwen2")
    states = [hf_hidden(model_dir, ids) for ids in PROMPT_IDS]
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir), runner="pooling", **SETTINGS)
    )
    try:
        for i, ids in enumerate(PROMPT_IDS):
            # vLLM's default for a PoolingParams without a task: the per-token embedding.
            task = None if i % 2 else "embed"
            engine.add_request(f"r{i}", {"prompt_token_ids": ids}, PoolingParams(task=task))
        with pytest.raises(ValueError, match=r"cannot serve the 'classify' task"):
            engine.add_request("bad", "hello", PoolingParams(task="classify"))
        with pytest.raises(ValueError, match=r"is a pooling model.*runner='generate'"):
            engine.add_request("gen", "hello", SamplingParams(max_tokens=2))
        finished: dict[str, PoolingRequestOutput] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                assert output.finished and output.request_id not in finished
                assert isinstance(output, PoolingRequestOutput)
                finished[output.request_id] = output
    finally:
        engine.shutdown()
    assert sorted(finished) == [f"r{i}" for i in range(len(PROMPT_IDS))]
    for i, hidden in enumerate(states):
        expected = F.normalize(hidden, dim=-1)
        assert_close(finished[f"r{i}"].outputs.data, expected if i % 2 else expected[-1])

    generating = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), max_model_len=64))
    try:
        with pytest.raises(ValueError, match=r"needs a pooling model.*runner='pooling'"):
            generating.add_request("p", "hello", PoolingParams(task="embed"))
        assert not generating.has_unfinished_requests()
    finally:
        generating.shutdown()
