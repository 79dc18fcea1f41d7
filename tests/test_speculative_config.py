"""`SpeculativeConfig`: vLLM's n-gram keys and defaults; every bad value names its key."""

from __future__ import annotations

import pytest

from paged_llm.speculative import SpeculativeConfig


@pytest.mark.parametrize(
    ("given", "lookup"),
    [
        ({"method": "ngram", "num_speculative_tokens": 3}, (5, 5)),
        ({"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, (4, 4)),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 2}, (2, 2)),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4)),
    ],
)
def test_vllms_defaults(given: dict, lookup: tuple[int, int]) -> None:
    config = SpeculativeConfig.of(given)
    assert config is not None
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == lookup
    assert config.method == "ngram"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, r"'eagle' is a draft model.*'ngram'"),
        ({"method": "typo", "num_speculative_tokens": 3}, r"'typo' is a method paged_llm does"),
        ({"num_speculative_tokens": 0}, r"\['num_speculative_tokens'\] must be an int >= 1"),
        ({"method": "ngram"}, r"\['num_speculative_tokens'\] is required"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 1.5}, r"\['prompt_lookup_max'\]"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"\['prompt_lookup_min'\]=4 must be <=",
        ),
        ({"num_speculative_tokens": 2, "model": "draft"}, r"Unknown speculative_config key.*model"),
        ("ngram", r"must be a dict"),
    ],
)
def test_bad_values_name_the_key(given: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.of(given)  # type: ignore[arg-type]
