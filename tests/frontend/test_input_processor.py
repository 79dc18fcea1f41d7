"""The request intake: every prompt form becomes an `EngineRequest`, or a `RequestError`
that carries the request's index, the parameter at fault and the reason apart."""

from __future__ import annotations

import pytest

from paged_llm import LLM, BeamSearchParams, SamplingParams
from paged_llm.engine.request import EngineRequest
from paged_llm.exceptions import RequestError
from paged_llm.frontend.input_processor import RejectedRequest

MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def test_each_prompt_form_becomes_an_engine_request(llm: LLM) -> None:
    text_ids = llm.get_tokenizer()("Hello there")["input_ids"]
    prompts = ["Hello there", {"prompt": "Hello there"}, {"prompt_token_ids": text_ids}]
    requests = [
        request
        for request in llm.processor.process(prompts, [GREEDY] * 3)
        if isinstance(request, EngineRequest)
    ]
    assert [r.prompt_token_ids for r in requests] == [text_ids] * 3
    assert [r.prompt for r in requests] == ["Hello there", "Hello there", None]
    assert len({r.request_id for r in requests}) == 3


@pytest.mark.parametrize(
    ("prompt", "params", "parameter", "reason"),
    [
        ({"prompt_token_ids": []}, GREEDY, "prompt", "the prompt is empty"),
        ({"prompt_token_ids": [5] * MAX_MODEL_LEN}, GREEDY, "prompt", "max_model_len=64"),
        ({"prompt_token_ids": [10**9]}, GREEDY, "prompt_token_ids", "outside the vocabulary"),
        ({"prompt_token_ids": "5 6"}, GREEDY, "prompt_token_ids", "must be a list of ints"),
        (["not", "a", "prompt"], GREEDY, "prompt", "a prompt must be a str"),
        ("\ud83d half an emoji", GREEDY, "prompt", "not valid Unicode"),
        ("hi", SamplingParams(logprobs=10**6), "logprobs", "greater than max allowed"),
        ("hi", SamplingParams(stop_token_ids=[10**9]), "token_ids", "outside the vocabulary"),
        ("hi", SamplingParams(bad_words=[" "]), "bad_words", "is no tokens"),
        ("hi", BeamSearchParams(beam_width=2, max_tokens=2), "sampling_params", "must be a"),
    ],
)
def test_a_refused_request_carries_its_index_parameter_and_reason(
    llm: LLM, prompt: object, params: object, parameter: str, reason: str
) -> None:
    good, refused = llm.processor.process(["fine", prompt], [GREEDY, params])
    assert isinstance(good, EngineRequest)
    assert isinstance(refused, RejectedRequest)
    error = refused.error
    assert (error.index, error.parameter) == (1, parameter)
    assert reason in error.reason
    assert str(error) == f"Request 1: {error.reason}"


def test_generate_raises_the_first_refused_requests_error_before_any_work(llm: LLM) -> None:
    before = llm.get_engine_metrics().num_requests
    with pytest.raises(RequestError) as caught:
        llm.generate(["fine", {"prompt_token_ids": []}, ""], GREEDY, use_tqdm=False)
    assert (caught.value.index, caught.value.parameter) == (1, "prompt")
    assert llm.get_engine_metrics().num_requests == before


def test_a_beam_search_checks_its_prompts_and_its_params_once(llm: LLM) -> None:
    params = llm.processor.check_beam_search(BeamSearchParams(beam_width=2, max_tokens=3))
    requests = llm.processor.process_beam_search(["fine", {"prompt_token_ids": []}], params)
    assert isinstance(requests[0], EngineRequest) and requests[0].params is params
    assert isinstance(requests[1], RejectedRequest) and requests[1].error.index == 1
    with pytest.raises(ValueError, match="beam_width=1000 exceeds max_num_seqs"):
        llm.processor.check_beam_search(BeamSearchParams(beam_width=1000, max_tokens=3))


def test_bad_words_are_tokenized_with_and_without_a_leading_space(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    (request,) = llm.processor.process(["hi"], [SamplingParams(bad_words=["ocean"])])
    assert isinstance(request, EngineRequest)
    bare = tokenizer.encode("ocean", add_special_tokens=False)
    spaced = tokenizer.encode(" ocean", add_special_tokens=False)
    assert request.bad_words_token_ids[0] == bare
    assert (spaced in request.bad_words_token_ids) == (
        spaced[0] != bare[0] and len(spaced) == len(bare)
    )


def test_allowed_token_ids_that_min_tokens_or_bad_words_ban_entirely_are_refused(
    llm: LLM,
) -> None:
    """Only allowed ids may ever come out: where the bans leave none of them, the request
    is refused up front, naming both parameters."""
    (eos,) = llm.eos_token_ids
    ocean = llm.get_tokenizer().encode("ocean", add_special_tokens=False)
    refused = {
        "min_tokens": [
            SamplingParams(min_tokens=2, allowed_token_ids=[eos]),
            SamplingParams(min_tokens=1, allowed_token_ids=[eos, 7], stop_token_ids=[7]),
            SamplingParams(
                min_tokens=1, allowed_token_ids=[7], stop_token_ids=[7], ignore_eos=True
            ),
        ],
        "bad_words": [SamplingParams(allowed_token_ids=ocean, bad_words=["ocean"])],
    }
    for other, cases in refused.items():
        for params in cases:
            _, request = llm.processor.process(["fine", "hi"], [GREEDY, params])
            assert isinstance(request, RejectedRequest), params
            error = request.error
            assert (error.index, error.parameter) == (1, "allowed_token_ids")
            assert "allowed_token_ids" in error.reason and other in error.reason
    accepted = [
        SamplingParams(min_tokens=2, allowed_token_ids=[eos], ignore_eos=True),
        SamplingParams(min_tokens=2, allowed_token_ids=[eos, 7]),
        SamplingParams(allowed_token_ids=[eos]),
    ]
    for params in accepted:
        (request,) = llm.processor.process(["hi"], [params])
        assert isinstance(request, EngineRequest), params


def test_allowed_token_ids_with_min_tokens_only_ever_produce_allowed_ids(llm: LLM) -> None:
    (eos,) = llm.eos_token_ids
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, seed=3, max_tokens=6, min_tokens=3, allowed_token_ids=[eos, 9]
        )
        (output,) = llm.generate(["hi"], params, use_tqdm=False)
        assert set(output.outputs[0].token_ids) <= {eos, 9}
        assert len(output.outputs[0].token_ids) >= 3
