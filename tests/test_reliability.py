"""Defects from an adversarial run: streams left early, two threads, bad requests that
escaped validation, unclear errors; and random interleavings of all of them."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from paged_llm import LLM, RequestOutput, SamplingParams
from paged_llm.engine.block_manager import BlockManager
from paged_llm.engine.core import EngineCore
from tests.engine.helpers import Interrupter, assert_pool_consistent

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def _prompts(count: int, first: int = 400) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [first + i] * 10} for i in range(count)]


def _engine_is_idle(llm: LLM) -> bool:
    engine = llm.engine
    assert engine is not None
    return not engine.has_unfinished()


# ----- 1. leaving a stream early ------------------------------------------------------------


def test_breaking_out_of_a_stream_cancels_it_at_once_with_the_gc_off(llm: LLM) -> None:
    gc.disable()
    try:
        stream = llm.generate_stream(_prompts(4), LONG)
        for _ in stream:
            break
        # The stream is still referenced, and no cyclic GC runs: cleanup must have run.
        assert _engine_is_idle(llm)
        outputs = llm.generate(_prompts(3, 600), GREEDY, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]
        assert list(stream) == []
    finally:
        gc.enable()


def test_an_exception_in_the_loop_body_cancels_the_stream(llm: LLM) -> None:
    gc.disable()
    try:
        stream = llm.generate_stream(_prompts(4), LONG)
        with pytest.raises(KeyError):
            for _ in stream:
                raise KeyError("boom")
        assert _engine_is_idle(llm)
        streamed = list(llm.generate_stream(_prompts(3, 700), GREEDY))
        assert sorted(index for index, _ in streamed) == [0, 1, 2]
    finally:
        gc.enable()


def test_a_late_collected_stream_never_cancels_a_later_call(llm: LLM) -> None:
    stream = llm.generate_stream(_prompts(4), LONG)
    iterator = iter(stream)
    next(iterator)
    stream.close()
    del iterator
    later = llm.generate_stream(_prompts(3, 800), GREEDY)
    results = []
    for item in later:
        results.append(item)
        stream.close()  # closing (and dropping) the first stream must not touch this one
        gc.collect()
    assert sorted(index for index, _ in results) == [0, 1, 2]
    assert all(len(output.outputs[0].token_ids) == 4 for _, output in results)


def test_closing_a_stream_before_iterating_runs_nothing(llm: LLM) -> None:
    engine = llm.engine
    assert engine is not None
    before = engine.get_metrics().num_requests
    stream = llm.generate_stream(_prompts(2), GREEDY)
    stream.close()
    assert list(stream) == []
    assert engine.get_metrics().num_requests == before
    assert len(llm.generate(_prompts(2), GREEDY, use_tqdm=False)) == 2


# ----- 2. two threads ------------------------------------------------------------------


def test_a_second_thread_gets_a_clear_error_and_the_first_finishes(llm: LLM) -> None:
    first = llm.generate_stream(_prompts(3), LONG)
    iterator = iter(first)
    next(iterator)  # the main thread now holds the generation
    errors: list[BaseException] = []

    def second() -> None:
        try:
            llm.generate(["x"], GREEDY, use_tqdm=False)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join()
    (error,) = errors
    assert isinstance(error, RuntimeError)
    assert "another thread" in str(error) and "generate_stream" not in str(error)
    rest = list(iterator)
    assert len(rest) == 2 and all(len(o.outputs[0].token_ids) == 30 for _, o in rest)
    assert _engine_is_idle(llm)


def test_two_threads_generating_never_corrupt_each_other(llm: LLM) -> None:
    results: list[list[int]] = []
    refused: list[RuntimeError] = []

    def worker(first: int) -> None:
        for _ in range(3):
            try:
                outputs = llm.generate(_prompts(2, first), GREEDY, use_tqdm=False)
            except RuntimeError as error:
                refused.append(error)
                continue
            results.append([len(o.outputs[0].token_ids) for o in outputs])

    threads = [threading.Thread(target=worker, args=(first,)) for first in (300, 900)]
    # A thread switch every microsecond, as the adversarial run used: the check-then-add
    # guard this replaced crashed inside the engine within a few calls.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert all(lengths == [4, 4] for lengths in results)
    assert len(results) + len(refused) == 6
    assert all("another thread is generating with it" in str(e) for e in refused)
    assert _engine_is_idle(llm)
    engine = llm.engine
    assert isinstance(engine, EngineCore)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert len(llm.generate(_prompts(2), GREEDY, use_tqdm=False)) == 2


# ----- 3. bad requests under on_error="skip" --------------------------------------------


def test_bad_requests_that_broke_the_batch_are_skipped_with_their_index(llm: LLM) -> None:
    prompts = ["good", "bad word", "lone \ud800 surrogate", "logprobs", "prompt logprobs"]
    params = [
        GREEDY,
        SamplingParams(bad_words=[" "], max_tokens=2),
        GREEDY,
        SamplingParams(logprobs=50000, max_tokens=2),
        SamplingParams(prompt_logprobs=50000, max_tokens=2),
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False, on_error="skip")
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 4
    assert "Request 1: bad word ' '" in outputs[1].error
    assert "Request 2:" in outputs[2].error and "surrogate" in outputs[2].error
    assert "Request 3: Requested sample logprobs of 50000" in outputs[3].error
    assert "Request 4: Requested prompt logprobs of 50000" in outputs[4].error
    with pytest.raises(ValueError, match=r"Request 1: the prompt is not valid Unicode"):
        llm.generate(["fine", "\ud800"], GREEDY, use_tqdm=False)


def test_logprobs_above_the_vocabulary_are_refused_even_without_a_cap(
    llama_dir: Path,
) -> None:
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN, max_logprobs=-1) as llm:
        vocab = llm.vocab_size
        with pytest.raises(ValueError, match=rf"logprobs of {vocab + 1}, .* max allowed: {vocab}"):
            llm.generate(["x"], SamplingParams(logprobs=vocab + 1), use_tqdm=False)
        (output,) = llm.generate(["x"], SamplingParams(logprobs=-1, max_tokens=1), use_tqdm=False)
        assert len(output.outputs[0].logprobs[0]) >= vocab


# ----- 4. SamplingParams floats ---------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ],
)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, None, "0.5"])
def test_every_float_field_must_be_a_finite_number(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be a finite number"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_logit_bias_must_be_finite() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: math.nan})


@pytest.mark.parametrize(
    "fields",
    [{"n": True}, {"top_k": True}, {"max_tokens": True}, {"logprobs": True}, {"seed": False}],
)
def test_bools_are_not_integers(fields: dict[str, object]) -> None:
    (name,) = fields
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} must be"):
        SamplingParams(**fields)  # type: ignore[arg-type]


# ----- 5. max_logprobs ----------------------------------------------------------------


def test_max_logprobs_caps_requests_as_vllm_does(llm: LLM) -> None:
    assert llm.config.max_logprobs == 20
    (output,) = llm.generate(["x"], SamplingParams(logprobs=20, max_tokens=1), use_tqdm=False)
    assert output.error is None
    with pytest.raises(
        ValueError,
        match=r"Request 0: Requested sample logprobs of 21, which is greater than max allowed: 20",
    ):
        llm.generate(["x"], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match=r"Requested prompt logprobs of \d+, .*max allowed: 20"):
        llm.generate(["x"], SamplingParams(prompt_logprobs=-1), use_tqdm=False)


def test_max_logprobs_is_validated(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"LLM argument max_logprobs must be"):
        LLM(llama_dir, max_model_len=MAX_MODEL_LEN, max_logprobs=-2)


# ----- 6. unclear errors --------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (None, r"prompts must be a str, .* got NoneType"),
        (5, r"prompts must be a str, .* got int"),
        (b"hello", r"got bytes; decode bytes to a str first"),
        ([b"hello"], r"Request 0: a prompt must be a str, .* got bytes"),
        ([{"prompt_token_ids": [True, False]}], r"Request 0: prompt_token_ids .* type bool"),
        ([{"prompt_token_ids": [1.0, 2.0]}], r"Request 0: prompt_token_ids .* type float"),
    ],
)
def test_bad_prompts_get_clear_errors(llm: LLM, prompts: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)  # type: ignore[arg-type]


def test_numpy_token_ids_are_ints(llm: LLM) -> None:
    ids = [5, 6, 7]
    (expected,) = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    for token_ids in (np.array(ids, dtype=np.int64), [np.int32(t) for t in ids]):
        (output,) = llm.generate([{"prompt_token_ids": token_ids}], GREEDY, use_tqdm=False)
        assert output.prompt_token_ids == ids
        assert all(type(t) is int for t in output.prompt_token_ids)
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids


def test_a_dict_as_sampling_params_is_named(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"sampling_params must be a SamplingParams.* got dict"):
        llm.generate(["x"], {"temperature": 0}, use_tqdm=False)  # type: ignore[arg-type]


def test_chat_errors_name_the_conversation(llm: LLM) -> None:
    good = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"Conversation 1, message 0: 'content' must be a str"):
        llm.chat([good, [{"role": "user", "content": None}]], GREEDY, use_tqdm=False)
    template = "{{ messages[0].missing.deeper }}"
    with pytest.raises(ValueError, match=r"Conversation 0: the chat template .*UndefinedError"):
        llm.chat(good, GREEDY, use_tqdm=False, chat_template=template)


# ----- 7. random interleavings ----------------------------------------------------------

# Shared prefixes (cache hits), n=2 (forks) and a pool of 12 blocks of 16 tokens, so that
# the streams below preempt and evict as they go.
INTERLEAVED_PROMPTS = [
    {"prompt_token_ids": [300 + i % 3] * 24 + [900 + i] * (4 + 7 * i)} for i in range(5)
]
INTERLEAVED_PARAMS = [
    SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True, n=2 if i == 1 else 1)
    for i in range(5)
]
MUTATIONS = [
    BlockManager.allocate_slots,
    BlockManager.fork,
    BlockManager.free,
    BlockManager.cache_full_blocks,
    BlockManager._evict,
]


@pytest.fixture(scope="module")
def crowded_llm(llama_dir: Path) -> Iterator[LLM]:
    # Batch-invariant, so that a run after any history of cache hits and evictions must give
    # exactly the reference tokens.
    with LLM(
        llama_dir,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=12 * 8192,
        max_num_batched_tokens=32,
        batch_invariant=True,
    ) as instance:
        yield instance


def _completions(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in output.outputs] for output in outputs]


def _leave_stream(llm: LLM, after: int, by_raising: bool) -> None:
    stream = llm.generate_stream(INTERLEAVED_PROMPTS, INTERLEAVED_PARAMS)
    with contextlib.suppress(KeyError):
        for count, _ in enumerate(stream):
            if count == after:
                if by_raising:
                    raise KeyError("the loop body failed")
                break


# The first example's run; every later one must reproduce it.
_INTERLEAVED_REFERENCE: dict[str, list[list[list[int]]]] = {}

interleaved_operations = st.one_of(
    st.tuples(st.just("generate")),
    st.tuples(st.sampled_from(["break", "raise"]), st.integers(0, 4)),
    st.tuples(st.just("interrupt"), st.sampled_from(range(len(MUTATIONS))), st.integers(1, 40)),
)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(interleaved_operations, min_size=1, max_size=4))
def test_random_interleavings_of_streams_left_early_and_interrupts_leave_the_engine_whole(
    crowded_llm: LLM, ops: list[tuple[Any, ...]]
) -> None:
    llm = crowded_llm
    engine = llm.engine
    assert isinstance(engine, EngineCore)

    def generate() -> list[RequestOutput]:
        return llm.generate(INTERLEAVED_PROMPTS, INTERLEAVED_PARAMS, use_tqdm=False)

    reference = _INTERLEAVED_REFERENCE.setdefault("tokens", _completions(generate()))
    assert engine.get_metrics().num_preemptions > 0
    for op in ops:
        if op[0] == "generate":
            assert _completions(generate()) == reference
        elif op[0] in ("break", "raise"):
            _leave_stream(llm, op[1], by_raising=op[0] == "raise")
        else:
            Interrupter(MUTATIONS[op[1]].__code__, op[2]).run(generate)
        assert not engine.has_unfinished()
        assert_pool_consistent(engine.scheduler)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert _completions(generate()) == reference


# ----- 8. memory over LLM lifetimes -----------------------------------------------------


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_memory_stays_flat_over_create_and_shutdown_cycles(
    llama_dir: Path,
) -> None:
    # A 64 MiB cache each time: keeping one alive per cycle would add 256 MiB over five.
    cache_bytes = 64 * 2**20
    resident = []
    for _ in range(5):
        with LLM(
            llama_dir, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=cache_bytes
        ) as instance:
            instance.generate(_prompts(4), GREEDY, use_tqdm=False)
        gc.collect()
        resident.append(_resident_bytes())
    assert max(resident) - resident[0] < 100 * 2**20, [r // 2**20 for r in resident]
