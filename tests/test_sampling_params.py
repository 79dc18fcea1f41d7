"""SamplingParams: vLLM's defaults, and a ValueError naming the field for every bad value."""

from __future__ import annotations

import pytest

from paged_llm import SamplingParams


def test_defaults_follow_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert (params.max_tokens, params.min_tokens, params.logprobs, params.prompt_logprobs) == (
        16,
        0,
        None,
        None,
    )
    assert params.stop == [] and params.stop_token_ids == [] and params.bad_words == []
    assert params.skip_special_tokens and params.spaces_between_special_tokens and params.detokenize
    assert not params.ignore_eos and not params.include_stop_str_in_output


def test_normalizations() -> None:
    assert SamplingParams(stop="END").stop == ["END"]
    # -1 is kept as given, as vLLM reports it back; the sampler treats it as 0.
    assert SamplingParams(top_k=-1, temperature=0.8).top_k == -1
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.is_greedy and (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 0}, r"n must be an integer >= 1, got 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2, 2\], got -3.0"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0, got 0.0"),
        ({"temperature": -0.1}, r"temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -2}, r"top_k must be an integer >= 1, or 0 / -1 to disable, got -2"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\], got 1.1"),
        ({"seed": "7"}, r"seed must be an int or None, got '7'"),
        ({"stop": ["ok", ""]}, r"stop must be non-empty strings"),
        ({"stop": ["x"], "detokenize": False}, r"stop must be empty when detokenize=False"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be non-negative token ids"),
        ({"bad_words": [""]}, r"bad_words must be non-empty strings"),
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1, or None"),
        ({"min_tokens": -1}, r"min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be <= max_tokens=4, got 5"),
        ({"logprobs": -2}, r"logprobs must be None, an integer >= 0, or -1"),
        ({"prompt_logprobs": 1.5}, r"prompt_logprobs must be None, an integer >= 0, or -1"),
        (
            {"logit_bias": {5: 101.0}},
            r"logit_bias must be token ids mapped to biases in \[-100, 100\]",
        ),
        ({"allowed_token_ids": []}, r"allowed_token_ids must be a non-empty list of token ids"),
        ({"include_stop_str_in_output": "yes"}, r"include_stop_str_in_output must be a bool"),
        ({"ignore_eos": 1}, r"ignore_eos must be a bool"),
        ({"skip_special_tokens": None}, r"skip_special_tokens must be a bool"),
        ({"spaces_between_special_tokens": "no"}, r"spaces_between_special_tokens must be a bool"),
        ({"detokenize": 0}, r"detokenize must be a bool"),
    ],
    ids=lambda value: str(value) if isinstance(value, dict) else "",
)
def test_every_field_rejects_bad_values(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{message}"):
        SamplingParams(**fields)
