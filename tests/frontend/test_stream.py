"""The result stream every entry point reads: results as they finish, each once, leaving
early cancels the rest, one stream at a time per engine, the progress bar and the summary
line."""

from __future__ import annotations

import io
import logging

import pytest
from tqdm import tqdm

from paged_llm import LLM, SamplingParams

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_generate_stream_yields_each_request_once_as_it_finishes(llm: LLM) -> None:
    lengths = [9, 1, 5, 3, 7]
    prompts = [{"prompt_token_ids": [300 + i, 301, 302]} for i in range(len(lengths))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    streamed = list(llm.generate_stream(prompts, params))
    indices = [index for index, _ in streamed]
    assert sorted(indices) == list(range(len(prompts)))
    # Shorter completions finish (and are yielded) first.
    assert indices == sorted(range(len(lengths)), key=lambda i: lengths[i])
    batch = llm.generate(prompts, params, use_tqdm=False)
    for index, output in streamed:
        assert output.outputs[0].token_ids == batch[index].outputs[0].token_ids


def test_leaving_a_stream_early_cancels_the_rest(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": [400 + i] * 20} for i in range(6)]
    stream = llm.generate_stream(
        prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    for _ in stream:
        break
    stream.close()
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    (output,) = llm.generate("still works", GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_progress_bar_counts_completions_and_reports_speed(
    llm: LLM, capfd: pytest.CaptureFixture[str]
) -> None:
    captured = io.StringIO()

    def progress_bar(**kwargs: object) -> tqdm:
        return tqdm(**kwargs, file=captured, mininterval=0)

    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True)
    llm.generate(["a", "b", "c"], params, use_tqdm=progress_bar)
    text = captured.getvalue()
    assert "Processed prompts" in text and "6/6" in text
    assert "est. speed input:" in text and "toks/s" in text
    capfd.readouterr()
    llm.generate(["a"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capfd.readouterr().err


def test_summary_line_and_per_request_latencies(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="paged_llm"):
        (output,) = llm.generate(
            "Hello again",
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            use_tqdm=False,
        )
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished")]
    assert "Finished 1 requests" in summary and "5 generated tokens" in summary
    assert "prefix-cache hit rate" in summary and "0 preemptions" in summary
    metrics = output.metrics
    assert metrics.time_to_first_token > 0
    assert metrics.inter_token_latency > 0
    assert metrics.num_generation_tokens == 5


def test_a_second_stream_waits_for_the_first(llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 9, 12)]
    first = llm.generate_stream([{"prompt_token_ids": [500 + i] * 5} for i in range(3)], params)
    iterator = iter(first)
    next(iterator)
    with pytest.raises(RuntimeError, match="Another generation is still running"):
        next(iter(llm.generate_stream(["x"], params[0])))
    assert len(list(iterator)) == 2
