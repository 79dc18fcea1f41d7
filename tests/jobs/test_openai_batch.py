"""OpenAI batch lines into SamplingParams and prompts: field mapping, defaults, ids, and the
error each kind of bad line gets (no model needed)."""

from __future__ import annotations

import json

import pytest

from paged_llm.exceptions import RequestError
from paged_llm.jobs import openai_batch
from paged_llm.sampling_params import SamplingParams
from paged_llm.structured_outputs import StructuredOutputsParams


def parse(record: object, first_line_of: dict[str, int] | None = None) -> openai_batch.BatchRequest:
    raw = record if isinstance(record, bytes) else json.dumps(record).encode()
    return openai_batch.parse_line(3, raw, {} if first_line_of is None else first_line_of)


def chat(body: dict, custom_id: str = "a") -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": openai_batch.CHAT_URL,
        "body": {"messages": messages, **body},
    }


def completion(body: dict) -> dict:
    return {
        "custom_id": "c",
        "method": "POST",
        "url": openai_batch.COMPLETIONS_URL,
        "body": {"prompt": "hi", **body},
    }


def test_body_fields_map_to_sampling_params() -> None:
    body = {
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 3,
        "stop": "###",
        "seed": 11,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"42": -100, "7": 2.5},
        "logprobs": True,
        "top_logprobs": 4,
        "top_k": 5,
    }
    request = parse(chat(body))
    assert request.error is None
    params = openai_batch.sampling_params(request, SamplingParams(), None)
    assert params.max_tokens == 7  # max_completion_tokens wins over the older max_tokens
    assert (params.temperature, params.top_p, params.n, params.seed) == (0.5, 0.9, 3, 11)
    assert params.stop == ["###"]
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.logit_bias == {42: -100.0, 7: 2.5}
    assert (params.logprobs, params.top_k) == (4, 5)


def test_response_format_becomes_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    cases = [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, {"json": schema}),
        ({"type": "json_object"}, {"json_object": True}),
    ]
    for response_format, expected in cases:
        request = parse(chat({"response_format": response_format}))
        params = openai_batch.sampling_params(request, SamplingParams(), None)
        assert params.structured_outputs == StructuredOutputsParams(**expected)
    text = parse(chat({"response_format": {"type": "text"}}))
    assert openai_batch.sampling_params(text, SamplingParams(), None).structured_outputs is None


def test_lengths_default_to_the_models_then_to_openais() -> None:
    defaults = SamplingParams(temperature=0.7)
    chat_params = openai_batch.sampling_params(parse(chat({})), defaults, None)
    completion_params = openai_batch.sampling_params(parse(completion({})), defaults, None)
    assert chat_params.max_tokens is None  # up to the context
    assert completion_params.max_tokens == 16
    assert chat_params.temperature == 0.7 and chat_params.logprobs is None
    assert openai_batch.sampling_params(parse(completion({})), defaults, 64).max_tokens == 64
    logprobs = openai_batch.sampling_params(parse(chat({"logprobs": True})), defaults, None)
    assert logprobs.logprobs == 0


def test_completion_prompts_are_text_or_token_ids() -> None:
    assert openai_batch.completion_prompt(parse(completion({"prompt": ["once"]}))) == "once"
    request = parse(completion({"prompt": [[5, 6, 7]]}))
    assert openai_batch.completion_prompt(request) == {"prompt_token_ids": [5, 6, 7]}


@pytest.mark.parametrize(
    ("record", "message", "param"),
    [
        (b"{not json", "not valid JSON", None),
        (b'{"custom_id": "\xff"}', "not valid UTF-8 (byte 0xff", None),
        ([1, 2], "expected a JSON object, got list", None),
        (
            {"url": openai_batch.CHAT_URL, "body": {}},
            "'custom_id' must be a non-empty string",
            None,
        ),
        ({**chat({}), "url": "/v1/moderations"}, "unsupported url '/v1/moderations'", "url"),
        ({**chat({}), "method": "GET"}, "'method' must be \"POST\"", None),
        ({**chat({}), "body": "hi"}, "'body' must be a JSON object", "body"),
        (chat({"temprature": 1}), "unknown body field(s) 'temprature'", "temprature"),
        (chat({"messages": []}), "'messages' must be a non-empty list", "messages"),
        (chat({"stream": True}), "'stream' must be false", "stream"),
        (
            chat({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            '\'response_format\' must be {"type": "json_schema"',
            "response_format",
        ),
        (completion({"prompt": ["a", "b"]}), "one prompt per line", "prompt"),
        (completion({"suffix": "end"}), "'suffix' (insertion) is not supported", "suffix"),
        (completion({"best_of": 3}), "'best_of' is not supported unless it equals 'n'", "best_of"),
        (completion({"echo": True, "prompt": [1, 2]}), "'echo' needs a text prompt", "echo"),
    ],
)
def test_a_bad_line_gets_its_reason_and_the_field_at_fault(
    record: object, message: str, param: str | None
) -> None:
    request = parse(record)
    assert request.error is not None
    assert message in str(request.error)
    assert request.error.parameter == param
    line = openai_batch.error_line(request, request.error)
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["message"].startswith("line 3: ")
    assert line["error"]["message"] == line["response"]["body"]["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"temperature": -1}, "SamplingParams.temperature must be >= 0"),
        ({"max_tokens": 0}, "SamplingParams.max_tokens must be an integer >= 1"),
        ({"logit_bias": {"x": 1}}, "'logit_bias' must map token ids"),
        ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
        ({"logprobs": 2}, "'logprobs' must be a bool for chat completions"),
    ],
)
def test_values_out_of_range_are_refused_naming_the_field(body: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message.replace("(", r"\(")):
        openai_batch.sampling_params(parse(chat(body)), SamplingParams(), None)


def test_ids_come_from_the_custom_id_and_a_duplicate_gets_its_own() -> None:
    seen: dict[str, int] = {}
    first, again = parse(chat({}, "x"), seen), parse(chat({}, "x"), seen)
    assert first.key == parse(chat({"n": 2}, "x")).key  # the same in every run
    assert first.key != parse(chat({}, "y")).key
    assert again.error is not None and "duplicate custom_id 'x' (first seen on line 3)" in str(
        again.error
    )
    assert again.key != first.key and again.custom_id == "x"
