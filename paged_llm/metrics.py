"""Metric values as vLLM's `LLM.get_metrics` returns them (`vllm.v1.metrics.reader`).

Each value is one series: a metric name with its labels (``model_name``, ``engine``, and for
``vllm:request_success`` the ``finished_reason``). docs/usage.md ("Metrics") lists the
names and what each measures.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Metric:
    """One series of a metric: its name and its labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows over the engine's lifetime."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered list of counts (vLLM's speculative-decoding acceptances per draft
    position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down (requests running now, the share of the KV cache in
    use)."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets.

    ``buckets`` maps each bucket's upper bound, written as Prometheus writes it ("0.5",
    "16.0", "+Inf"), to the number of observations at or below it: the counts are
    cumulative, and the "+Inf" bucket equals ``count``. ``sum`` is the sum of all the
    observations.
    """

    count: int
    sum: float
    buckets: dict[str, int]
