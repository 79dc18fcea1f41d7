"""Rows to requests, shared by every job kind: sampling fields over the model's defaults,
chat rows rendered, and results back at their rows' positions with errors as values."""

from __future__ import annotations

import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.exceptions import RequestError
from paged_llm.jobs.requests import JobRequest, chat_prompt, run_requests, sampling_params_over
from paged_llm.outputs import RequestOutput

MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_sampling_fields_go_over_the_defaults_and_a_bad_one_is_named() -> None:
    defaults = SamplingParams(temperature=0.7, max_tokens=20)
    params = sampling_params_over(defaults, {"top_k": 5, "seed": 3})
    assert (params.temperature, params.max_tokens, params.top_k, params.seed) == (0.7, 20, 5, 3)
    assert defaults.top_k == 0  # the defaults are not changed
    with pytest.raises(RequestError) as caught:
        sampling_params_over(defaults, {"temperature": -1})
    assert caught.value.parameter == "temperature"
    assert "SamplingParams.temperature must be >= 0" in caught.value.reason
    with pytest.raises(RequestError) as caught:
        sampling_params_over(defaults, {"temprature": 1, "max_tokenz": 2})
    assert caught.value.parameter == "max_tokenz"
    assert "unknown SamplingParams field(s) 'max_tokenz', 'temprature'" in caught.value.reason


def test_a_chat_row_renders_or_says_why_not(llm: LLM) -> None:
    prompt = chat_prompt(llm, [{"role": "user", "content": "Hi"}])
    assert prompt["prompt_token_ids"] and "Hi" in prompt["prompt"]
    with pytest.raises(RequestError) as caught:
        chat_prompt(llm, [{"role": "user", "content": 3}])
    assert caught.value.parameter == "messages"
    assert caught.value.reason.startswith("cannot render messages: message 0: 'content' must")


def test_results_come_back_at_their_rows_positions_with_errors_as_values(llm: LLM) -> None:
    early = RequestError("the row is bad", parameter="prompt")
    requests: list[JobRequest | RequestError] = [
        JobRequest("A first row", GREEDY),
        early,
        JobRequest({"prompt_token_ids": []}, GREEDY),
        JobRequest("A last row", GREEDY),
    ]
    results = dict(run_requests(llm, requests, progress=False))
    assert sorted(results) == [0, 1, 2, 3]
    assert results[1] is early
    refused = results[2]
    assert isinstance(refused, RequestError) and refused.parameter == "prompt"
    assert "the prompt is empty" in refused.reason
    for position in (0, 3):
        output = results[position]
        assert isinstance(output, RequestOutput) and len(output.outputs[0].token_ids) == 3
