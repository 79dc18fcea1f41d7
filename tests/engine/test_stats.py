"""The pieces of `EngineStats` that need no engine: vLLM's bucket bounds, their labels as
Prometheus writes them, and counting into buckets."""

from __future__ import annotations

import pytest

from paged_llm.engine.stats import BucketCounts, bucket_label, one_two_five_buckets


def test_token_buckets_go_one_two_five_up_to_the_maximum() -> None:
    assert one_two_five_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert one_two_five_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert one_two_five_buckets(1) == [1]


@pytest.mark.parametrize(
    ("bound", "label"),
    [
        (1, "1.0"),
        (0.001, "0.001"),
        (0.075, "0.075"),
        (2560.0, "2560.0"),
        (500000, "500000.0"),
        (1000000, "1e+06"),
        (1500000, "1.5e+06"),
        (20000000, "2e+07"),
    ],
)
def test_bounds_are_labelled_as_prometheus_writes_them(bound: float, label: str) -> None:
    assert bucket_label(bound) == label


def test_a_value_on_a_bound_counts_in_that_bucket_and_counts_accumulate() -> None:
    counts = BucketCounts([1, 2, 5])
    for value in (0, 1, 1.5, 2, 5, 6, 100):
        counts.observe(value)
    histogram = counts.histogram("vllm:x", {"engine": "0"})
    assert histogram.buckets == {"1.0": 2, "2.0": 4, "5.0": 5, "+Inf": 7}
    assert (histogram.count, histogram.sum) == (7, 115.5)
    assert (histogram.name, histogram.labels) == ("vllm:x", {"engine": "0"})
