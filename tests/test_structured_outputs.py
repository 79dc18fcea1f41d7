"""Structured outputs through the whole engine on a tiny random model with SmolLM2's
tokenizer: every completion that ends with "stop" follows its constraint."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from paged_llm import LLM, BeamSearchParams, RequestOutput, SamplingParams, StructuredOutputsParams
from paged_llm.exceptions import RequestError

MAX_MODEL_LEN = 256
PROMPTS = ["Describe a person as JSON:", "The answer is", "Rain fell all night over the"]

_NAME = {"type": "string", "maxLength": 6}
# Bounded lengths everywhere: a random model rambles until a bound stops it.
SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}},
        "required": ["age"],
    },
    {
        "type": "object",
        "properties": {"level": {"enum": ["low", "mid", "high"]}},
        "required": ["level"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": _NAME},
        "required": ["ok"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
        },
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 500},
                    "name": _NAME,
                },
                "required": ["id", "name"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "integer", "minimum": -5, "maximum": 5},
                },
                "required": ["x", "y"],
            },
            "label": {"enum": ["start", "end"]},
        },
        "required": ["point", "label"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "required": ["code"],
    },
    {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 3}, "y": {"type": "null"}},
        "required": ["x"],
    },
    {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["rows"],
    },
    {"enum": ["red", "green", "blue"]},
]
REGEXES = [
    r"[a-z]{2,5}-\d{1,3}",
    r"(yes|no|maybe)",
    r"\d{4}-\d{2}-\d{2}",
    r"[A-Z][a-z]{1,6} [A-Z][a-z]{1,6}",
    r"(0|[1-9][0-9]{0,2})(\.[0-9]{1,2})?",
]
CHOICES = [["positive", "negative", "neutral"], ["A", "B", "C", "D"], ["cat", "dog"]]

# (params, check) pairs: the check says whether a completion's text follows the constraint.
Check = Callable[[str], bool]


def _json_valid(schema: dict) -> Check:
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True

    return check


CONSTRAINTS: list[tuple[StructuredOutputsParams, Check]] = [
    *(
        (StructuredOutputsParams(json=schema, disable_any_whitespace=True), _json_valid(schema))
        for schema in SCHEMAS
    ),
    *(
        (
            StructuredOutputsParams(regex=regex),
            lambda text, r=regex: re.fullmatch(r, text) is not None,
        )
        for regex in REGEXES
    ),
    *(
        (StructuredOutputsParams(choice=choice), lambda text, c=choice: text in c)
        for choice in CHOICES
    ),
]


def _assert_valid(outputs: list[RequestOutput], checks: list[Check], min_share: float) -> None:
    """Every completion that stopped follows its constraint, and most stopped."""
    stopped = total = 0
    for output, check in zip(outputs, checks, strict=True):
        for completion in output.outputs:
            total += 1
            if completion.finish_reason == "stop":
                stopped += 1
                assert check(completion.text), (output.request_id, completion.text)
    assert stopped >= min_share * total, f"only {stopped} of {total} completions stopped"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled-n4"])
def test_constrained_completions_follow_their_constraint_in_a_mixed_batch(
    llm: LLM, sampled: bool
) -> None:
    """All constraints in one batch, with an unconstrained request between each two."""
    base = (
        SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=64)
        if sampled
        else SamplingParams(temperature=0, max_tokens=64)
    )
    prompts: list[str] = []
    params: list[SamplingParams] = []
    for index, (constraint, _) in enumerate(CONSTRAINTS):
        prompts += [PROMPTS[index % len(PROMPTS)], PROMPTS[(index + 1) % len(PROMPTS)]]
        params += [
            SamplingParams(**{**_fields(base), "structured_outputs": constraint}),
            SamplingParams(temperature=1.0, seed=index, max_tokens=12, ignore_eos=True),
        ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _assert_valid(outputs[::2], [check for _, check in CONSTRAINTS], min_share=0.8)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs[1::2]), "free rows unchanged"
    if sampled:
        distinct = {tuple(c.token_ids) for o in outputs[::2] for c in o.outputs}
        assert len(distinct) > len(CONSTRAINTS) * 2, "the n=4 children draw their own tokens"


def _fields(params: SamplingParams) -> dict:
    return {
        name: getattr(params, name)
        for name in ("n", "temperature", "seed", "max_tokens", "min_tokens", "logprobs")
    }


def test_a_constrained_request_alone_equals_itself_in_a_batch(llm: LLM) -> None:
    constraint, check = CONSTRAINTS[0]
    params = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=48, structured_outputs=constraint
    )
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    others = [
        SamplingParams(temperature=1.0, max_tokens=20, structured_outputs=c)
        for c, _ in CONSTRAINTS[1:4]
    ]
    batch = llm.generate([PROMPTS[1]] * 3 + [PROMPTS[0]], [*others, params], use_tqdm=False)[-1]
    assert [c.token_ids for c in batch.outputs] == [c.token_ids for c in alone.outputs]
    _assert_valid([alone], [check], min_share=1.0)


def test_forced_preemption_gives_the_same_constrained_tokens(model_dir: Path, llm: LLM) -> None:
    prompts = [f"{PROMPTS[i % 3]} number {i}" for i in range(6)]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=c)
        for i, (c, _) in enumerate(CONSTRAINTS[:6])
    ]
    expected = llm.generate(prompts, params, use_tqdm=False)
    # 7 blocks of 16 tokens (512 bytes a token): two or three sequences at a time.
    with LLM(
        model_dir, max_model_len=96, block_size=16, kv_cache_memory_bytes=7 * 16 * 512
    ) as small:
        preempted = small.generate(prompts, params, use_tqdm=False)
        assert small.get_engine_metrics().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in preempted] == [o.outputs[0].token_ids for o in expected]
    _assert_valid(preempted, [check for _, check in CONSTRAINTS[:6]], min_share=0.5)


def test_max_tokens_cuts_with_length_and_the_text_may_be_incomplete(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 20}},
        "required": ["name"],
    }
    params = SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema)
    )
    completion = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == 4 and completion.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)


def test_the_grammar_ends_the_sequence_over_ignore_eos_and_min_tokens(llm: LLM) -> None:
    for extra in ({"ignore_eos": True}, {"min_tokens": 30}):
        params = SamplingParams(
            temperature=1.0,
            seed=5,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(choice=["cat", "dog"]),
            **extra,
        )
        completion = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
        assert completion.finish_reason == "stop" and completion.text in ("cat", "dog"), extra


def test_min_tokens_holds_eos_back_while_the_grammar_can_go_on(llm: LLM) -> None:
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=2,
        max_tokens=40,
        min_tokens=6,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{1,60}"),
    )
    for completion in llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs:
        # Six tokens of letters and more still fit the regex, so EOS waits for the sixth.
        assert re.fullmatch(r"[a-z]{1,60}", completion.text)
        assert len(completion.token_ids) >= 6


def test_a_stop_string_ends_a_constrained_completion_early(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        stop=["-"],
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{1,3}"),
    )
    completion = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "-"
    assert re.fullmatch(r"[a-z]{2,5}", completion.text)


def test_logprobs_are_those_of_the_grammar_masked_distribution(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0,
        seed=1,
        max_tokens=8,
        logprobs=20,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    completion = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    assert completion.text in ("yes", "no") and completion.logprobs
    for position in completion.logprobs:
        finite = [lp.logprob for lp in position.values() if math.isfinite(lp.logprob)]
        # The few tokens the grammar allows carry all the probability.
        assert math.isclose(sum(math.exp(lp) for lp in finite), 1.0, rel_tol=1e-4)


def test_chat_replies_follow_a_schema(llm: LLM) -> None:
    schema = SCHEMAS[2]
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )
    reply = llm.chat([{"role": "user", "content": "Rate it."}], params, use_tqdm=False)[0].outputs[
        0
    ]
    assert reply.finish_reason == "stop" and _json_valid(schema)(reply.text)


def test_json_object_and_grammar_constraints(llm: LLM) -> None:
    grammar = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-c]'
    outputs = llm.generate(
        PROMPTS[:2],
        [
            SamplingParams(
                temperature=0,
                max_tokens=80,
                structured_outputs=StructuredOutputsParams(
                    json_object=True, disable_any_whitespace=True
                ),
            ),
            SamplingParams(
                temperature=0,
                max_tokens=40,
                structured_outputs=StructuredOutputsParams(grammar=grammar),
            ),
        ],
        use_tqdm=False,
    )
    json_text, grammar_text = (o.outputs[0] for o in outputs)
    if json_text.finish_reason == "stop":
        assert isinstance(json.loads(json_text.text), dict)
    assert grammar_text.finish_reason == "stop"
    assert re.fullmatch(r"\([a-c](,[a-c]){0,2}\)", grammar_text.text)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            StructuredOutputsParams(json={"type": "integr"}),
            r"Request 1: StructuredOutputsParams.json is not valid for xgrammar: Unsupported type",
        ),
        (
            StructuredOutputsParams(regex="[a-"),
            r"Request 1: StructuredOutputsParams.regex is not valid for xgrammar",
        ),
    ],
)
def test_an_invalid_constraint_fails_its_request_up_front(
    llm: LLM, constraint: StructuredOutputsParams, message: str
) -> None:
    before = llm.get_engine_metrics().num_requests
    params = [
        SamplingParams(max_tokens=4),
        SamplingParams(max_tokens=4, structured_outputs=constraint),
    ]
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert llm.get_engine_metrics().num_requests == before


def test_two_constraints_fail_naming_the_request(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"got json and regex"):
        StructuredOutputsParams(json={"type": "integer"}, regex="a+")
    constraint = StructuredOutputsParams(regex="a+")
    params = SamplingParams(structured_outputs=constraint)
    constraint.choice = ["a"]  # set after construction: the LLM checks again
    with pytest.raises(
        ValueError,
        match=r"Request 1: StructuredOutputsParams needs exactly one of .* got regex and choice",
    ):
        llm.generate(PROMPTS[:2], [SamplingParams(), params], use_tqdm=False)


def test_a_whitespace_pattern_bounds_the_whitespace_of_json(llm: LLM) -> None:
    schema = SCHEMAS[7]
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=11,
        max_tokens=64,
        structured_outputs=StructuredOutputsParams(json=schema, whitespace_pattern="[ ]?"),
    )
    output = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    _assert_valid([output], [_json_valid(schema)], min_share=0.5)
    # The schema has no free strings: every blank is whitespace between JSON tokens.
    for completion in output.outputs:
        assert "\n" not in completion.text and "  " not in completion.text


# A character class nothing matches: "a" may start, then nothing can follow.
DEAD_END_REGEX = StructuredOutputsParams(regex=r"a[^\s\S]")
DEAD_END_SCHEMA = StructuredOutputsParams(
    json={
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": r"^a[^\s\S]$"}},
        "required": ["a"],
    },
    disable_any_whitespace=True,
)


def _unsatisfiable(llm: LLM, kind: str) -> SamplingParams:
    if kind == "choice-with-allowed-token-ids":
        # Tokens of " Hello world": none starts "cat" or "dog".
        allowed = llm.get_tokenizer().encode(" Hello world", add_special_tokens=False)
        return SamplingParams(
            temperature=0,
            max_tokens=20,
            allowed_token_ids=allowed,
            structured_outputs=StructuredOutputsParams(choice=["cat", "dog"]),
        )
    constraint = DEAD_END_REGEX if kind == "regex" else DEAD_END_SCHEMA
    return SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)


def _assert_engine_idle(llm: LLM) -> None:
    """No request left behind, every block back in the pool."""
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("kind", "parameter"),
    [
        ("regex", "structured_outputs"),
        ("json-pattern", "structured_outputs"),
        ("choice-with-allowed-token-ids", "allowed_token_ids"),
    ],
)
def test_an_unsatisfiable_constraint_fails_its_request_alone(
    llm: LLM, kind: str, parameter: str
) -> None:
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True)
    choice = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES[0])
    )
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    params = [free, _unsatisfiable(llm, kind), sampled, choice]
    outputs = llm.generate(prompts, params, use_tqdm=False, on_error="skip")

    failed = outputs[1]
    assert failed.outputs == [] and failed.finished
    assert failed.error is not None
    assert failed.error.startswith("Request 1: no token satisfies the constraint")
    assert failed.error_parameter == parameter and parameter in failed.error
    assert [len(c.token_ids) for c in outputs[0].outputs] == [8]
    assert [len(c.token_ids) for c in outputs[2].outputs] == [8, 8]
    assert outputs[3].outputs[0].text in CHOICES[0]
    assert all(o.error is None for o in (outputs[0], outputs[2], outputs[3]))
    _assert_engine_idle(llm)


def test_under_on_error_raise_the_failure_raises_naming_the_request(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=8), _unsatisfiable(llm, "regex")]
    with pytest.raises(RequestError, match="no token satisfies the constraint") as caught:
        llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert (caught.value.index, caught.value.parameter) == (1, "structured_outputs")
    _assert_engine_idle(llm)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs


def test_an_unsatisfiable_constraint_fails_all_n_sequences_of_its_request(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=20)
    failing = SamplingParams(
        n=3, temperature=1.0, seed=9, max_tokens=20, structured_outputs=DEAD_END_REGEX
    )
    ok, failed = llm.generate(PROMPTS[:2], [params, failing], use_tqdm=False, on_error="skip")
    assert len(ok.outputs) == 3 and ok.error is None
    assert failed.outputs == [] and failed.error_parameter == "structured_outputs"
    _assert_engine_idle(llm)


def test_a_beam_search_whose_constraint_leaves_nothing_raises_naming_the_request(
    llm: LLM,
) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=8, structured_outputs=DEAD_END_REGEX)
    with pytest.raises(RequestError, match="no token satisfies the constraint") as caught:
        llm.beam_search(PROMPTS[:2], params)
    assert caught.value.index in (0, 1) and caught.value.parameter == "structured_outputs"
    _assert_engine_idle(llm)
