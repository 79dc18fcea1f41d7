"""StructuredOutputsParams: one constraint, checked fields, a stable cache key, pickling."""

from __future__ import annotations

import pickle

import pytest

from paged_llm import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, r"exactly one of json, regex, choice, grammar, json_object, got none"),
        ({"json": SCHEMA, "regex": "a+"}, r"got json and regex; pass one constraint"),
        ({"choice": ["a"], "json_object": True}, r"got choice and json_object"),
        ({"choice": []}, r"choice must be a non-empty list of non-empty strs, got \[\]"),
        ({"choice": ["a", ""]}, r"choice must be a non-empty list"),
        ({"regex": ""}, r"regex must be a non-empty str, got ''"),
        ({"grammar": 3}, r"grammar must be a non-empty str, got 3"),
        ({"json": 3}, r"json must be a JSON schema as a dict or a str, got 3"),
        ({"json": "{not json"}, r"json is not valid JSON: Expecting property name"),
        ({"json_object": False}, r"json_object must be True or None, got False"),
        ({"regex": "a", "disable_any_whitespace": 1}, r"disable_any_whitespace must be a bool"),
        ({"regex": "a", "whitespace_pattern": " ?"}, r"whitespace_pattern must be None unless"),
        (
            {"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " ?"},
            r"whitespace_pattern must be None unless json or json_object is set and disable",
        ),
        ({"json_object": True, "whitespace_pattern": ""}, r"whitespace_pattern must be a non-e"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_sampling_params_refuses_what_is_not_structured_outputs_params() -> None:
    with pytest.raises(ValueError, match=r"structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})  # type: ignore[arg-type]


def test_a_schema_as_text_or_as_a_dict_shares_one_cache_key() -> None:
    as_dict = StructuredOutputsParams(json=SCHEMA)
    as_text = StructuredOutputsParams(
        json='{"required": ["a"], "type": "object", "properties": {"a": {"type": "integer"}}}'
    )
    assert as_dict.cache_key() == as_text.cache_key()
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert compact.cache_key() != as_dict.cache_key()
    assert (
        StructuredOutputsParams(regex="a").cache_key()
        != StructuredOutputsParams(grammar="a").cache_key()
    )


def test_params_pickle_for_data_parallel_replicas() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    copy = pickle.loads(pickle.dumps(params))
    assert copy.structured_outputs == params.structured_outputs
    assert copy.structured_outputs is not None and copy.structured_outputs.kind == "choice"
